package storagetest

import (
	"context"
	"crypto/rand"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// ShortLeaseDefault is the lease, and the retry delay, of the cases that wait
// for a lease to expire or a retry to fall due, when Harness.ShortLease is 0.
const ShortLeaseDefault = 250 * time.Millisecond

const (
	// longLease never expires during a test: it makes "still leased" certain.
	longLease = time.Minute
	// waitTimeout bounds every wait for something that must happen.
	waitTimeout = 10 * time.Second
	// pollInterval is the pause between two looks at the storage.
	pollInterval = 5 * time.Millisecond
	// topic is the topic of the records the suite inserts.
	topic = "storagetest"
)

// testCase is one contract case.
type testCase struct {
	name string
	// strict marks cases that only make sense with strict ordering.
	strict bool
	// inspect marks cases that cannot say anything without Harness.Inspect.
	inspect bool
	// hold marks cases that run on Harness.NewHoldOnDeadLetter's storage.
	hold bool
	// delay marks cases that need Harness.DelayedDelivery.
	delay bool
	run   func(t *testing.T, e *env)
}

// group is a set of cases run under one parent test.
type group struct {
	name  string
	cases []testCase
}

// Run runs the contract suite against the storage h makes, as subtests of t.
// Every case gets a fresh storage from h.New. Cases that need Harness.Inspect
// are skipped when it is nil, and the strict-ordering cases when
// h.StrictOrdering is false. Stats, Maintenance and Operator cases run only
// when the storage implements [storage.StatsReader], [storage.Maintainer] or
// [storage.Operator], and HoldOnDeadLetter cases only with
// h.NewHoldOnDeadLetter.
func Run(t *testing.T, h Harness) {
	t.Helper()
	if h.New == nil || h.Insert == nil {
		t.Fatal("storagetest: Harness.New and Harness.Insert are required")
	}
	if h.ShortLease <= 0 {
		h.ShortLease = ShortLeaseDefault
	}
	for _, g := range groups() {
		t.Run(g.name, func(t *testing.T) {
			if h.Parallel {
				t.Parallel()
			}
			for _, c := range g.cases {
				t.Run(c.name, func(t *testing.T) {
					if c.strict && !h.StrictOrdering {
						t.Skip("skipped: Harness.StrictOrdering is false, the storage does not promise strict ordering")
					}
					if c.delay && !h.DelayedDelivery {
						t.Skip("skipped: Harness.DelayedDelivery is false, Insert does not honour Record.DueAt")
					}
					if c.inspect && h.Inspect == nil {
						t.Skip("skipped: needs Harness.Inspect to read the stored status and error")
					}
					if c.hold && (h.NewHoldOnDeadLetter == nil || !h.StrictOrdering) {
						t.Skip("skipped: needs Harness.NewHoldOnDeadLetter (and StrictOrdering)")
					}
					if h.Parallel {
						t.Parallel()
					}
					if c.hold {
						hh := h
						hh.New = h.NewHoldOnDeadLetter
						c.run(t, newEnv(t, hh))
						return
					}
					c.run(t, newEnv(t, h))
				})
			}
		})
	}
}

func groups() []group {
	return []group{
		{"Claim", claimCases()},
		{"Lease", leaseCases()},
		{"Fencing", fencingCases()},
		{"Nack", nackCases()},
		{"Release", releaseCases()},
		{"DeadLetter", deadLetterCases()},
		{"Ack", ackCases()},
		{"Extend", extendCases()},
		{"Keys", keyCases()},
		{"StrictOrdering", strictOrderingCases()},
		{"DelayedDelivery", delayCases()},
		{"Concurrency", concurrencyCases()},
		{"Stats", statsCases()},
		{"Maintenance", maintenanceCases()},
		{"Prune", pruneCases()},
		{"Operator", operatorCases()},
		{"HoldOnDeadLetter", holdCases()},
	}
}

// env is one case's storage and the helpers to drive it. Every helper fails
// the test when the storage returns an error: the contract has no error for
// any of the situations the suite creates.
type env struct {
	t     *testing.T
	h     Harness
	s     storage.Storage
	ctx   context.Context
	lease time.Duration // h.ShortLease

	mu sync.Mutex
	// claims holds, per worker, the attempts its latest claim of each
	// record returned; last, those of the latest claim of each record by
	// any worker. The id-based helpers name records by them (see ref).
	claims map[string]map[int64]int
	last   map[int64]int
}

func newEnv(t *testing.T, h Harness) *env {
	s := h.New(t)
	if s == nil {
		t.Fatal("storagetest: Harness.New returned a nil storage")
	}
	return &env{t: t, h: h, s: s, ctx: t.Context(), lease: h.ShortLease,
		claims: make(map[string]map[int64]int), last: make(map[int64]int)}
}

// insert commits one record per key (empty = keyless) and returns the ids,
// checking that they grow with insertion order.
func (e *env) insert(keys ...string) []int64 {
	e.t.Helper()
	records := make([]storage.Record, len(keys))
	for i, k := range keys {
		records[i] = newRecord(k, i)
	}
	return e.insertRecords(records...)
}

func (e *env) insertRecords(records ...storage.Record) []int64 {
	e.t.Helper()
	ids := e.h.Insert(e.t, e.s, records...)
	if len(ids) != len(records) {
		e.t.Fatalf("Harness.Insert returned %d ids for %d records: it must return one id per record", len(ids), len(records))
	}
	for i := 1; i < len(ids); i++ {
		if ids[i] <= ids[i-1] {
			e.t.Fatalf("Harness.Insert returned id %d after id %d: ids must grow in insertion order", ids[i], ids[i-1])
		}
	}
	return ids
}

// keyless returns n empty keys, for insert.
func keyless(n int) []string { return make([]string, n) }

func newRecord(key string, i int) storage.Record {
	return storage.Record{
		UUID:     newUUID(),
		Topic:    topic,
		Key:      key,
		Payload:  fmt.Appendf(nil, `{"n":%d}`, i),
		Metadata: map[string]string{"storagetest_n": fmt.Sprint(i)},
	}
}

// newUUID returns a random version 4 UUID, so storages with a uuid column
// accept it.
func newUUID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand documents it)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// claim calls Claim and checks the promises every claim keeps: id order, the
// batch size, attempts of at least one.
func (e *env) claim(worker string, batch int, lease time.Duration) []storage.Record {
	e.t.Helper()
	got, err := e.s.Claim(e.ctx, storage.ClaimParams{BatchSize: batch, Lease: lease, WorkerID: worker})
	if err != nil {
		e.t.Fatalf("Claim(batch %d, lease %v, worker %q) returned error %v: claiming must not fail", batch, lease, worker, err)
	}
	if err := checkClaim(got, batch); err != nil {
		e.t.Fatal(err)
	}
	e.mu.Lock()
	if e.claims[worker] == nil {
		e.claims[worker] = make(map[int64]int)
	}
	for _, r := range got {
		e.claims[worker][r.ID] = r.Attempts
		e.last[r.ID] = r.Attempts
	}
	e.mu.Unlock()
	return got
}

// ref names record id for a write-back by worker: as worker's latest claim
// returned it, or, for a record worker never claimed, as the latest claim
// of anyone did (so that only the worker tells the write-back apart), or
// with attempts 0 for a record nobody claimed.
func (e *env) ref(worker string, id int64) storage.ClaimRef {
	e.mu.Lock()
	defer e.mu.Unlock()
	if a, ok := e.claims[worker][id]; ok {
		return storage.ClaimRef{ID: id, Attempt: a}
	}
	return storage.ClaimRef{ID: id, Attempt: e.last[id]}
}

func (e *env) refs(worker string, ids []int64) []storage.ClaimRef {
	refs := make([]storage.ClaimRef, len(ids))
	for i, id := range ids {
		refs[i] = e.ref(worker, id)
	}
	return refs
}

// checkClaim returns what is wrong with a claim result, nil when nothing is.
func checkClaim(got []storage.Record, batch int) error {
	if len(got) > batch {
		return fmt.Errorf("Claim returned %d records for batch size %d: a claim must not exceed its batch size", len(got), batch)
	}
	for i, r := range got {
		if i > 0 && r.ID <= got[i-1].ID {
			return fmt.Errorf("Claim returned record %d before record %d: claims must be in id order", got[i-1].ID, r.ID)
		}
		if r.Attempts < 1 {
			return fmt.Errorf("Claim returned record %d with attempts %d: attempts are incremented at claim time, so they are at least 1", r.ID, r.Attempts)
		}
	}
	return nil
}

// The write-back helpers name each record as worker's latest claim of it
// returned it (see ref); the ...Ref ones take the ClaimRef to send.

func (e *env) ack(worker string, ids ...int64) {
	e.t.Helper()
	e.ackRefs(worker, e.refs(worker, ids)...)
}

func (e *env) ackRefs(worker string, refs ...storage.ClaimRef) {
	e.t.Helper()
	if err := e.s.Ack(e.ctx, storage.AckParams{Records: refs, WorkerID: worker}); err != nil {
		e.t.Fatalf("Ack(%v, worker %q) returned error %v: ack must not fail", refs, worker, err)
	}
}

func (e *env) nack(worker string, id int64, reason string, retryAt time.Time) {
	e.t.Helper()
	e.nackRef(worker, e.ref(worker, id), reason, retryAt)
}

func (e *env) nackRef(worker string, ref storage.ClaimRef, reason string, retryAt time.Time) {
	e.t.Helper()
	err := e.s.Nack(e.ctx, storage.NackParams{Record: ref, WorkerID: worker, Error: reason, RetryAt: retryAt})
	if err != nil {
		e.t.Fatalf("Nack(%v, worker %q) returned error %v: nack must not fail", ref, worker, err)
	}
}

func (e *env) release(worker string, retryAt time.Time, ids ...int64) {
	e.t.Helper()
	e.releaseRefs(worker, retryAt, e.refs(worker, ids)...)
}

func (e *env) releaseRefs(worker string, retryAt time.Time, refs ...storage.ClaimRef) {
	e.t.Helper()
	if err := e.s.Release(e.ctx, storage.ReleaseParams{Records: refs, WorkerID: worker, RetryAt: retryAt}); err != nil {
		e.t.Fatalf("Release(%v, worker %q) returned error %v: release must not fail", refs, worker, err)
	}
}

func (e *env) deadLetter(worker string, id int64, reason string) {
	e.t.Helper()
	e.deadLetterRef(worker, e.ref(worker, id), reason)
}

func (e *env) deadLetterRef(worker string, ref storage.ClaimRef, reason string) {
	e.t.Helper()
	if err := e.s.DeadLetter(e.ctx, storage.DeadLetterParams{Record: ref, WorkerID: worker, Error: reason}); err != nil {
		e.t.Fatalf("DeadLetter(%v, worker %q) returned error %v: dead-letter must not fail", ref, worker, err)
	}
}

// state returns Inspect's view of the record, and false without Inspect.
func (e *env) state(id int64) (State, bool) {
	e.t.Helper()
	if e.h.Inspect == nil {
		return State{}, false
	}
	return e.h.Inspect(e.t, e.s, id), true
}

// claimUntil claims with worker every pollInterval until a claim returns a
// record with id want, and returns that claim's records and the time the
// claim returned. It fails the test with what when waitTimeout passes first.
func (e *env) claimUntil(worker string, batch int, lease time.Duration, want int64, what string) ([]storage.Record, time.Time) {
	e.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		got := e.claim(worker, batch, lease)
		end := time.Now()
		if hasID(got, want) {
			return got, end
		}
		if len(got) > 0 {
			e.t.Fatalf("Claim returned %v while waiting for record %d: %s", ids(got), want, what)
		}
		if end.After(deadline) {
			e.t.Fatalf("record %d was not claimable within %v: %s", want, waitTimeout, what)
		}
		e.pause()
	}
}

// claimNothingFor claims with worker every pollInterval for d, failing the
// test if any claim returns one of the ids in never; the records of the
// other ids are returned as claimed, in order.
func (e *env) claimNothingFor(d time.Duration, worker string, never []int64, why string) []storage.Record {
	e.t.Helper()
	var claimed []storage.Record
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		for _, r := range e.claim(worker, 10, longLease) {
			if slices.Contains(never, r.ID) {
				e.t.Fatalf("Claim returned record %d: %s", r.ID, why)
			}
			if hasID(claimed, r.ID) {
				e.t.Fatalf("Claim returned record %d again within %v of a claim that leased it for %v: a leased record is not claimable until its lease expires",
					r.ID, d, longLease)
			}
			claimed = append(claimed, r)
		}
		e.pause()
	}
	return claimed
}

func (e *env) pause() {
	select {
	case <-e.ctx.Done():
	case <-time.After(pollInterval):
	}
}

func ids(records []storage.Record) []int64 {
	out := make([]int64, len(records))
	for i, r := range records {
		out[i] = r.ID
	}
	return out
}

func hasID(records []storage.Record, id int64) bool {
	return slices.ContainsFunc(records, func(r storage.Record) bool { return r.ID == id })
}

func find(records []storage.Record, id int64) (storage.Record, bool) {
	i := slices.IndexFunc(records, func(r storage.Record) bool { return r.ID == id })
	if i < 0 {
		return storage.Record{}, false
	}
	return records[i], true
}

// near reports whether got is within tolerance of want.
func near(got, want time.Time, tolerance time.Duration) bool {
	d := got.Sub(want)
	return d >= -tolerance && d <= tolerance
}
