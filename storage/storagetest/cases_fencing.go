package storagetest

import (
	"slices"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// writeBack is one of the four fenced methods, applied the way that would be
// most visible if fencing failed: Nack and Release make the record due at
// once, Ack and DeadLetter end it.
type writeBack struct {
	name  string
	apply func(e *env, worker string, ref storage.ClaimRef)
}

var writeBacks = []writeBack{
	{"Ack", func(e *env, worker string, ref storage.ClaimRef) { e.ackRefs(worker, ref) }},
	{"Nack", func(e *env, worker string, ref storage.ClaimRef) {
		e.nackRef(worker, ref, "nack by a worker without the lease", time.Now().Add(-time.Second))
	}},
	{"Release", func(e *env, worker string, ref storage.ClaimRef) {
		e.releaseRefs(worker, time.Now().Add(-time.Second), ref)
	}},
	{"DeadLetter", func(e *env, worker string, ref storage.ClaimRef) {
		e.deadLetterRef(worker, ref, "dead-letter by a worker without the lease")
	}},
}

func fencingCases() []testCase {
	var cases []testCase
	for _, wb := range writeBacks {
		cases = append(cases,
			testCase{name: wb.name + "ByOtherWorkerIgnored", run: func(t *testing.T, e *env) { testFencingOtherWorker(t, e, wb) }},
			testCase{name: wb.name + "AfterTakeoverIgnored", run: func(t *testing.T, e *env) { testFencingAfterTakeover(t, e, wb) }},
			testCase{name: wb.name + "OfEarlierClaimIgnored", run: func(t *testing.T, e *env) { testFencingEarlierClaim(t, e, wb) }},
		)
	}
	return append(cases,
		testCase{name: "UnknownIDsIgnored", run: testFencingUnknownIDs},
		testCase{name: "AckOnlyOwnRecords", run: testFencingAckOnlyOwn},
	)
}

// checkUntouched fails the test, saying it broke rule, unless record id is
// still pending, leased by holder with the given attempts and no error,
// after intruder's write-back: another worker finds nothing to claim, and
// once holder nacks it, due at once, the next claim gets it with one attempt
// more.
func checkUntouched(t *testing.T, e *env, wb writeBack, id int64, holder, intruder string, attempts int, rule string) {
	t.Helper()
	if st, ok := e.state(id); ok {
		if st.Status != storage.StatusPending || st.LeasedBy != holder || st.Attempts != attempts || st.LastError != "" {
			t.Fatalf("Inspect reports record %d %s, leased by %q, attempts %d, error %q after %s by %s; want it untouched: pending, leased by %s, attempts %d, no error: %s",
				id, st.Status, st.LeasedBy, st.Attempts, st.LastError, wb.name, intruder, holder, attempts, rule)
		}
	}
	if got := e.claim("worker-3", 10, longLease); len(got) != 0 {
		t.Fatalf("Claim returned records %v after %s by %s while %s held the lease: %s", ids(got), wb.name, intruder, holder, rule)
	}
	e.nack(holder, id, "publish failed", time.Now())
	got := e.claim("worker-3", 10, longLease)
	if !hasID(got, id) {
		t.Fatalf("record %d was not claimable after %s nacked it due at once, following %s by %s: the intruder's %s must have changed it; %s",
			id, holder, wb.name, intruder, wb.name, rule)
	}
	if r, _ := find(got, id); r.Attempts != attempts+1 {
		t.Fatalf("Claim returned attempts %d for record %d, want %d: %s by %s changed its attempts; %s", r.Attempts, id, attempts+1, wb.name, intruder, rule)
	}
}

const fencingRule = "write-backs only touch records leased by the calling worker (fencing)"

const claimFencingRule = "a write-back only touches the lease of the claim its ClaimRef names: a write-back of an earlier claim whose lease ran out, by the worker that claimed the record again since, must match nothing (fencing on the claim)"

func testFencingOtherWorker(t *testing.T, e *env, wb writeBack) {
	id := e.insert("")[0]
	e.claim("worker-1", 10, longLease)
	wb.apply(e, "worker-2", e.ref("worker-1", id)) // the holder's claim, from another worker
	checkUntouched(t, e, wb, id, "worker-1", "worker-2", 1, fencingRule)
}

func testFencingAfterTakeover(t *testing.T, e *env, wb writeBack) {
	id := e.insert("")[0]
	e.claim("worker-1", 10, e.lease)
	e.claimUntil("worker-2", 10, longLease, id, "a record whose lease expired must be claimable again")
	// worker-1 comes back from a long pause and writes back a record it lost.
	wb.apply(e, "worker-1", e.ref("worker-1", id))
	checkUntouched(t, e, wb, id, "worker-2", "worker-1 (whose lease expired and was taken over)", 2, fencingRule)
}

// testFencingEarlierClaim: the lease of worker-1's first claim runs out and
// worker-1 claims the record again; a write-back of the first claim, late
// (a slow Release behind a database hiccup, say), must leave the second
// lease alone. Fenced on the worker alone, it ended the new lease, and the
// record was published with no lease and then again.
func testFencingEarlierClaim(t *testing.T, e *env, wb writeBack) {
	id := e.insert("")[0]
	first := e.claim("worker-1", 10, e.lease)
	stale, ok := find(first, id)
	if !ok {
		t.Fatalf("Claim returned %v, want record %d", ids(first), id)
	}
	again, _ := e.claimUntil("worker-1", 10, longLease, id, "a record whose lease expired must be claimable again, by the same worker too")
	if r, _ := find(again, id); r.Attempts != stale.Attempts+1 {
		t.Fatalf("Claim returned attempts %d for record %d claimed again after its lease of attempt %d ran out, want %d: each claim counts an attempt",
			r.Attempts, id, stale.Attempts, stale.Attempts+1)
	}
	wb.apply(e, "worker-1", stale.Ref())
	checkUntouched(t, e, wb, id, "worker-1", "worker-1 (a write-back of its earlier claim)", stale.Attempts+1, claimFencingRule)
}

func testFencingUnknownIDs(t *testing.T, e *env) {
	id := e.insert("")[0]
	e.claim("worker-1", 10, longLease)
	unknown := id + 1_000_000
	// Each helper fails the test on an error: unknown ids are ignored silently.
	e.ack("worker-1", unknown)
	e.nack("worker-1", unknown, "unknown", time.Now())
	e.release("worker-1", time.Now(), unknown)
	e.deadLetter("worker-1", unknown, "unknown")
	e.ack("worker-1")
	e.release("worker-1", time.Now())
	if got := e.claim("worker-2", 10, longLease); len(got) != 0 {
		t.Fatalf("Claim returned records %v after write-backs of an unknown id: they must change nothing", ids(got))
	}
}

func testFencingAckOnlyOwn(t *testing.T, e *env) {
	all := e.insert(keyless(4)...)
	e.claim("worker-1", 2, longLease) // all[0], all[1]
	e.claim("worker-2", 2, longLease) // all[2], all[3]
	e.ack("worker-1", all...)
	e.release("worker-2", time.Now(), all[2:]...)
	got := e.claim("worker-3", 10, longLease)
	if !slices.Equal(ids(got), all[2:]) {
		t.Fatalf("Claim returned records %v after worker-1 acked %v of which it held only %v, want %v: %s",
			ids(got), all, all[:2], all[2:], fencingRule)
	}
}
