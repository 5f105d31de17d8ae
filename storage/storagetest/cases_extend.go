package storagetest

import (
	"slices"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

func extendCases() []testCase {
	return []testCase{
		{name: "KeepsRecordsLeased", run: testExtendKeepsLeased},
		{name: "ByOtherWorkerIgnored", run: testExtendOtherWorker},
		{name: "ExpiredLeaseNotExtended", run: testExtendExpired},
		{name: "AfterTakeoverIgnored", run: testExtendAfterTakeover},
		{name: "OfEarlierClaimIgnored", run: testExtendEarlierClaim},
		{name: "ReturnsOnlyOwnRecords", run: testExtendOnlyOwn},
	}
}

const extendRule = "Extend only extends live leases held by the calling worker (fencing)"

func (e *env) extend(worker string, lease time.Duration, ids ...int64) []int64 {
	e.t.Helper()
	return e.extendRefs(worker, lease, e.refs(worker, ids)...)
}

func (e *env) extendRefs(worker string, lease time.Duration, refs ...storage.ClaimRef) []int64 {
	e.t.Helper()
	got, err := e.s.Extend(e.ctx, storage.ExtendParams{Records: refs, WorkerID: worker, Lease: lease})
	if err != nil {
		e.t.Fatalf("Extend(%v, worker %q) returned error %v: extend must not fail", refs, worker, err)
	}
	slices.Sort(got)
	return got
}

// waitLeaseOver waits until a lease of e.lease taken before start has
// surely run out (twice its length, for storages with a coarse clock).
func (e *env) waitLeaseOver(start time.Time) {
	e.t.Helper()
	for time.Since(start) < 2*e.lease {
		e.pause()
	}
}

func testExtendKeepsLeased(t *testing.T, e *env) {
	id := e.insert("")[0]
	start := time.Now()
	e.claim("worker-1", 10, e.lease)
	if got := e.extend("worker-1", longLease, id); !slices.Equal(got, []int64{id}) {
		t.Fatalf("Extend by the lease holder returned %v, want [%d]: %s", got, id, extendRule)
	}
	// Past the original lease, the record must still be worker-1's.
	e.claimNothingFor(2*e.lease+time.Until(start.Add(e.lease)), "worker-2", []int64{id},
		"the record's lease was extended by its holder; it must not be claimable before the extended lease runs out")
	e.ack("worker-1", id)
	if st, ok := e.state(id); ok && st.Status != storage.StatusDelivered {
		t.Fatalf("Inspect reports record %d %s after its holder acked it following an Extend, want delivered", id, st.Status)
	}
}

func testExtendOtherWorker(t *testing.T, e *env) {
	id := e.insert("")[0]
	start := time.Now()
	e.claim("worker-1", 10, e.lease)
	if got := e.extend("worker-2", longLease, id); len(got) != 0 {
		t.Fatalf("Extend by worker-2 of a record leased by worker-1 returned %v, want none: %s", got, extendRule)
	}
	e.waitLeaseOver(start)
	e.claimUntil("worker-3", 10, longLease, id,
		"worker-1's lease ran out; an Extend by another worker must not have kept the record leased")
}

func testExtendExpired(t *testing.T, e *env) {
	id := e.insert("")[0]
	start := time.Now()
	e.claim("worker-1", 10, e.lease)
	e.waitLeaseOver(start)
	if got := e.extend("worker-1", longLease, id); len(got) != 0 {
		t.Fatalf("Extend of a lease that ran out returned %v, want none: another worker may already have claimed the record; %s", got, extendRule)
	}
	e.claimUntil("worker-2", 10, longLease, id, "a lease that ran out must not be revived by Extend")
}

func testExtendAfterTakeover(t *testing.T, e *env) {
	id := e.insert("")[0]
	start := time.Now()
	e.claim("worker-1", 10, e.lease)
	e.waitLeaseOver(start)
	e.claimUntil("worker-2", 10, longLease, id, "a record whose lease expired must be claimable again")
	if got := e.extend("worker-1", longLease, id); len(got) != 0 {
		t.Fatalf("Extend by worker-1 after worker-2 took the record over returned %v, want none: %s", got, extendRule)
	}
	if st, ok := e.state(id); ok && st.LeasedBy != "worker-2" {
		t.Fatalf("Inspect reports record %d leased by %q after worker-1's Extend, want worker-2: %s", id, st.LeasedBy, extendRule)
	}
	e.ack("worker-2", id)
	if st, ok := e.state(id); ok && st.Status != storage.StatusDelivered {
		t.Fatalf("Inspect reports record %d %s after worker-2 acked it, want delivered: worker-1's Extend must not have taken the lease back", id, st.Status)
	}
}

// testExtendEarlierClaim: an Extend of worker-1's first claim, whose lease
// ran out, must not touch the lease of its second claim of the record: the
// second lease runs out when its own length says.
func testExtendEarlierClaim(t *testing.T, e *env) {
	id := e.insert("")[0]
	first := e.claim("worker-1", 10, e.lease)
	stale, ok := find(first, id)
	if !ok {
		t.Fatalf("Claim returned %v, want record %d", ids(first), id)
	}
	e.claimUntil("worker-1", 10, e.lease, id, "a record whose lease expired must be claimable again, by the same worker too")
	start := time.Now()
	if got := e.extendRefs("worker-1", longLease, stale.Ref()); len(got) != 0 {
		t.Fatalf("Extend by worker-1 of its earlier claim of record %d (attempt %d), which it claimed again since, returned %v, want none: %s",
			id, stale.Attempts, got, claimFencingRule)
	}
	e.waitLeaseOver(start)
	e.claimUntil("worker-2", 10, longLease, id,
		"worker-1's second lease ran out; an Extend of its earlier claim must not have kept the record leased")
}

func testExtendOnlyOwn(t *testing.T, e *env) {
	ids := e.insert(keyless(3)...)
	e.claim("worker-1", 2, longLease) // ids[0], ids[1]
	e.claim("worker-2", 1, longLease) // ids[2]
	got := e.extend("worker-1", longLease, ids[0], ids[1], ids[2], ids[2]+1000)
	if !slices.Equal(got, ids[:2]) {
		t.Fatalf("Extend by worker-1 of %v (its own %v, worker-2's %d and an unknown id) returned %v, want %v: %s",
			[]int64{ids[0], ids[1], ids[2], ids[2] + 1000}, ids[:2], ids[2], got, ids[:2], extendRule)
	}
}
