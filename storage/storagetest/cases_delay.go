package storagetest

import (
	"slices"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

func delayCases() []testCase {
	return []testCase{
		{name: "NotClaimedBeforeDue", delay: true, run: testDelayedNotClaimedBeforeDue},
		{name: "PastDueAtClaimableAtOnce", delay: true, run: testPastDueAtClaimable},
		{name: "DelayedHeadHoldsItsKey", delay: true, strict: true, run: testDelayedHeadHoldsKey},
		{name: "DelayedBehindEarlierRecord", delay: true, strict: true, run: testDelayedBehindEarlier},
	}
}

// delayTolerance is how far apart the test's clock and the storage's may be
// when the suite checks that a delayed record is not claimed before its
// time, and is claimable once it has passed.
const delayTolerance = 25 * time.Millisecond

// delayed returns a record of key due at due.
func delayed(key string, i int, due time.Time) storage.Record {
	r := newRecord(key, i)
	r.DueAt = due
	return r
}

// awaitDue claims with worker until due has passed, failing the test if a
// claim that returned before due (less the tolerance) returned one of the
// ids in never, and returns the other ids it claimed. A claim that returned
// later may have started before due and read the clock after it: what it
// took of never is released, due at once, for the case's next claims.
func (e *env) awaitDue(due time.Time, worker string, never []int64, why string) []int64 {
	e.t.Helper()
	var claimed []int64
	for time.Now().Before(due.Add(delayTolerance)) {
		var late []int64
		for _, r := range e.claim(worker, 10, longLease) {
			if slices.Contains(never, r.ID) {
				if time.Now().Before(due.Add(-delayTolerance)) {
					e.t.Fatalf("Claim returned record %d %v before its time: %s", r.ID, time.Until(due), why)
				}
				late = append(late, r.ID)
				continue
			}
			claimed = append(claimed, r.ID)
		}
		if len(late) > 0 {
			e.release(worker, time.Now(), late...)
		}
		e.pause()
	}
	return claimed
}

func testDelayedNotClaimedBeforeDue(t *testing.T, e *env) {
	due := time.Now().Add(4 * e.lease)
	all := e.insertRecords(delayed("", 0, due), newRecord("", 1), delayed("a", 2, due), newRecord("b", 3))
	k0, k1, a2, b3 := all[0], all[1], all[2], all[3]
	claimed := e.awaitDue(due, "worker-1", []int64{k0, a2},
		"a record is not claimable before its DueAt")
	if !slices.Equal(claimed, []int64{k1, b3}) {
		t.Fatalf("before the delayed records were due, claims returned %v, want %v: records that are not delayed are claimable at once, whatever other keys hold", claimed, []int64{k1, b3})
	}
	got := e.claim("worker-2", 10, longLease)
	if !slices.Equal(ids(got), []int64{k0, a2}) {
		t.Fatalf("the first claim once records %d and %d were due returned %v: a delayed record is claimable as soon as its DueAt has passed", k0, a2, ids(got))
	}
}

func testPastDueAtClaimable(t *testing.T, e *env) {
	all := e.insertRecords(delayed("a", 0, time.Now().Add(-time.Hour)), delayed("", 1, time.Now().Add(-time.Minute)))
	got := e.claim("worker-1", 10, longLease)
	if !slices.Equal(ids(got), all) {
		t.Fatalf("Claim returned %v, want %v: a record whose DueAt has passed is due at once", ids(got), all)
	}
}

func testDelayedHeadHoldsKey(t *testing.T, e *env) {
	due := time.Now().Add(4 * e.lease)
	all := e.insertRecords(delayed("a", 0, due), newRecord("a", 1), newRecord("b", 2))
	all = append(all, e.insert("a")...)
	a0, a1, b2, a3 := all[0], all[1], all[2], all[3]
	claimed := e.awaitDue(due, "worker-1", []int64{a0, a1, a3},
		"under strict ordering a record that is not due yet holds back the later records of its key")
	if !slices.Equal(claimed, []int64{b2}) {
		t.Fatalf("before record %d of key a was due, claims returned %v, want [%d]: another key is not held back", a0, claimed, b2)
	}
	got, _ := e.claimUntil("worker-2", 1, longLease, a0, "the delayed head of key a")
	if !slices.Equal(ids(got), []int64{a0}) {
		t.Fatalf("Claim(batch 1) returned %v once record %d was due, want [%d]: the delayed head goes first", ids(got), a0, a0)
	}
	if got := e.claim("worker-3", 10, longLease); len(got) > 0 {
		t.Fatal(heldBack(got[0].ID, a0, "a", "was leased"))
	}
	e.ack("worker-2", a0)
	var rest []int64
	deadline := time.Now().Add(waitTimeout)
	for len(rest) < 2 && time.Now().Before(deadline) {
		for _, r := range e.claim("worker-3", 10, longLease) {
			rest = append(rest, r.ID)
			e.ack("worker-3", r.ID)
		}
		e.pause()
	}
	if !slices.Equal(rest, []int64{a1, a3}) {
		t.Fatalf("after the delayed head %d was delivered, claims returned %v, want [%d %d]: the rest of its key follows in order", a0, rest, a1, a3)
	}
}

func testDelayedBehindEarlier(t *testing.T, e *env) {
	all := e.insert("a")
	due := time.Now().Add(4 * e.lease)
	all = append(all, e.insertRecords(delayed("a", 1, due), newRecord("a", 2))...)
	a0, a1, a2 := all[0], all[1], all[2]
	got := e.claim("worker-1", 10, longLease)
	if !slices.Equal(ids(got), []int64{a0}) {
		t.Fatalf("Claim returned %v, want [%d]: the record after it is not due yet and holds back the rest of its key", ids(got), a0)
	}
	e.ack("worker-1", a0)
	e.awaitDue(due, "worker-1", []int64{a1, a2},
		"a delayed record is not claimable before its DueAt, nor the later records of its key (strict ordering), once the records before it are delivered")
	got = e.claim("worker-2", 10, longLease)
	if len(got) == 0 || got[0].ID != a1 {
		t.Fatalf("the first claim once record %d was due returned %v: it is claimable as soon as its DueAt has passed, before the rest of its key", a1, ids(got))
	}
}
