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
	apply func(e *env, worker string, id int64)
}

var writeBacks = []writeBack{
	{"Ack", func(e *env, worker string, id int64) { e.ack(worker, id) }},
	{"Nack", func(e *env, worker string, id int64) {
		e.nack(worker, id, "nack by a worker without the lease", time.Now().Add(-time.Second))
	}},
	{"Release", func(e *env, worker string, id int64) { e.release(worker, time.Now().Add(-time.Second), id) }},
	{"DeadLetter", func(e *env, worker string, id int64) {
		e.deadLetter(worker, id, "dead-letter by a worker without the lease")
	}},
}

func fencingCases() []testCase {
	var cases []testCase
	for _, wb := range writeBacks {
		cases = append(cases,
			testCase{name: wb.name + "ByOtherWorkerIgnored", run: func(t *testing.T, e *env) { testFencingOtherWorker(t, e, wb) }},
			testCase{name: wb.name + "AfterTakeoverIgnored", run: func(t *testing.T, e *env) { testFencingAfterTakeover(t, e, wb) }},
		)
	}
	return append(cases,
		testCase{name: "UnknownIDsIgnored", run: testFencingUnknownIDs},
		testCase{name: "AckOnlyOwnRecords", run: testFencingAckOnlyOwn},
	)
}

// checkUntouched fails the test unless record id is still pending, leased by
// holder with the given attempts and no error, after intruder's write-back:
// another worker finds nothing to claim, and once holder nacks it, due at
// once, the next claim gets it with one attempt more.
func checkUntouched(t *testing.T, e *env, wb writeBack, id int64, holder, intruder string, attempts int) {
	t.Helper()
	if st, ok := e.state(id); ok {
		if st.Status != storage.StatusPending || st.LeasedBy != holder || st.Attempts != attempts || st.LastError != "" {
			t.Fatalf("Inspect reports record %d %s, leased by %q, attempts %d, error %q after %s by %s; want it untouched: pending, leased by %s, attempts %d, no error: %s",
				id, st.Status, st.LeasedBy, st.Attempts, st.LastError, wb.name, intruder, holder, attempts, fencingRule)
		}
	}
	if got := e.claim("worker-3", 10, longLease); len(got) != 0 {
		t.Fatalf("Claim returned records %v after %s by %s while %s held the lease: %s", ids(got), wb.name, intruder, holder, fencingRule)
	}
	e.nack(holder, id, "publish failed", time.Now())
	got := e.claim("worker-3", 10, longLease)
	if !hasID(got, id) {
		t.Fatalf("record %d was not claimable after %s nacked it due at once, following %s by %s: the intruder's %s must have changed it; %s",
			id, holder, wb.name, intruder, wb.name, fencingRule)
	}
	if r, _ := find(got, id); r.Attempts != attempts+1 {
		t.Fatalf("Claim returned attempts %d for record %d, want %d: %s by %s changed its attempts; %s", r.Attempts, id, attempts+1, wb.name, intruder, fencingRule)
	}
}

const fencingRule = "write-backs only touch records leased by the calling worker (fencing)"

func testFencingOtherWorker(t *testing.T, e *env, wb writeBack) {
	id := e.insert("")[0]
	e.claim("worker-1", 10, longLease)
	wb.apply(e, "worker-2", id)
	checkUntouched(t, e, wb, id, "worker-1", "worker-2", 1)
}

func testFencingAfterTakeover(t *testing.T, e *env, wb writeBack) {
	id := e.insert("")[0]
	e.claim("worker-1", 10, e.lease)
	e.claimUntil("worker-2", 10, longLease, id, "a record whose lease expired must be claimable again")
	// worker-1 comes back from a long pause and writes back a record it lost.
	wb.apply(e, "worker-1", id)
	checkUntouched(t, e, wb, id, "worker-2", "worker-1 (whose lease expired and was taken over)", 2)
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
