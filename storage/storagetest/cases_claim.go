package storagetest

import (
	"bytes"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

func claimCases() []testCase {
	return []testCase{
		{name: "EmptyTableReturnsNothing", run: testClaimEmptyTable},
		{name: "InIDOrder", run: testClaimInIDOrder},
		{name: "BatchSizeRespected", run: testClaimBatchSize},
		{name: "LeasedRecordsNotClaimedAgain", run: testClaimLeasedNotClaimedAgain},
		{name: "ReturnsStoredFields", run: testClaimReturnsStoredFields},
		{name: "NotYetDueSkipped", run: testClaimNotYetDueSkipped},
		{name: "DrainedNeverLeavesARecordOut", run: testClaimDrained},
	}
}

// testClaimDrained: a storage.DrainClaimer never reports drained a claim
// that left a claimable record out (a forwarder would then wait before its
// next claim with records ready): a full batch is not drained, and after a
// drained claim another worker's claim finds nothing, with keys held back
// behind a record waiting for its retry and behind one in flight.
func testClaimDrained(t *testing.T, e *env) {
	d, ok := e.s.(storage.DrainClaimer)
	if !ok {
		t.Skip("skipped: the storage does not implement storage.DrainClaimer")
	}
	first := e.insert("held", "flight")
	e.claim("worker-0", 2, longLease)
	e.nack("worker-0", first[0], "broker down", time.Now().Add(time.Hour))
	want := e.insert("held", "flight", "a", "", "b", "c", "", "held")
	if e.h.StrictOrdering {
		want = want[2:7] // the rest wait for the records before them
	}
	var got []int64
	for i := 1; i <= 10; i++ {
		batch, drained, err := d.ClaimDrained(e.ctx, storage.ClaimParams{BatchSize: 2, Lease: longLease, WorkerID: "worker-1"})
		if err != nil {
			t.Fatalf("ClaimDrained %d returned error %v", i, err)
		}
		got = append(got, ids(batch)...)
		if !drained {
			if len(batch) == 0 {
				break
			}
			continue
		}
		if left := len(want) - len(got); left > 0 {
			t.Fatalf("ClaimDrained %d returned %v and drained, with %d records left claimable: drained means no claimable record was left out", i, ids(batch), left)
		}
		if more := e.claim("worker-2", 100, longLease); len(more) > 0 {
			t.Fatalf("ClaimDrained %d returned %v and drained, and the next claim found %v claimable", i, ids(batch), ids(more))
		}
		break
	}
	slices.Sort(got) // claims may take keys in another order (the PostgreSQL storage's key slots)
	if !slices.Equal(got, want) {
		t.Fatalf("successive ClaimDrained returned records %v, want %v, as Claim would", got, want)
	}
}

func testClaimEmptyTable(t *testing.T, e *env) {
	got, err := e.s.Claim(e.ctx, storage.ClaimParams{BatchSize: 10, Lease: longLease, WorkerID: "worker-1"})
	if err != nil {
		t.Fatalf("Claim on an empty table returned error %v: it must return an empty slice and no error", err)
	}
	if len(got) != 0 {
		t.Fatalf("Claim on an empty table returned records %v: it must return an empty slice", ids(got))
	}
}

func testClaimInIDOrder(t *testing.T, e *env) {
	// Distinct keys and keyless records mixed, so strict ordering has nothing
	// to hold back.
	want := e.insert("a", "", "b", "c", "", "d", "e", "", "f", "g")
	got := e.claim("worker-1", 100, longLease)
	if !slices.Equal(ids(got), want) {
		t.Fatalf("Claim returned records %v, want %v: a claim takes every due, unleased, pending record in id order", ids(got), want)
	}
}

func testClaimBatchSize(t *testing.T, e *env) {
	want := e.insert(keyless(10)...)
	var got []int64
	for i, size := range []int{4, 4, 2, 0} {
		batch := e.claim("worker-1", 4, longLease)
		if len(batch) != size {
			t.Fatalf("claim %d of batch size 4 over 10 records returned %d records %v, want %d: a claim takes up to its batch size",
				i+1, len(batch), ids(batch), size)
		}
		got = append(got, ids(batch)...)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("successive claims returned records %v, want %v: each claim continues in id order where the last stopped", got, want)
	}
}

func testClaimLeasedNotClaimedAgain(t *testing.T, e *env) {
	e.insert(keyless(3)...)
	before := time.Now()
	first := e.claim("worker-1", 10, longLease)
	after := time.Now()
	if len(first) != 3 {
		t.Fatalf("Claim returned %d records, want 3", len(first))
	}
	if got := e.claim("worker-2", 10, longLease); len(got) != 0 {
		t.Fatalf("Claim gave records %v to worker-2 while worker-1 held their lease: a leased record is not claimable until its lease expires", ids(got))
	}
	for _, r := range first {
		if st, ok := e.state(r.ID); ok {
			if st.LeasedBy != "worker-1" || st.Status != storage.StatusPending {
				t.Errorf("Inspect reports record %d %s leased by %q after worker-1 claimed it, want pending leased by worker-1", r.ID, st.Status, st.LeasedBy)
			}
			if st.LeasedUntil.Before(before.Add(longLease-time.Second)) || st.LeasedUntil.After(after.Add(longLease+time.Second)) {
				t.Errorf("Inspect reports record %d leased until %v after a claim for %v between %v and %v: the lease ends at claim time + lease",
					r.ID, st.LeasedUntil, longLease, before, after)
			}
		}
	}
}

func testClaimReturnsStoredFields(t *testing.T, e *env) {
	in := []storage.Record{
		{
			UUID:     newUUID(),
			Topic:    "storagetest.orders",
			Key:      "order-42",
			Payload:  []byte{0x00, 0x01, '"', '\\', 0xfe, 0xff},
			Metadata: map[string]string{"name": "value", "unicode": "ünïcödé ✓", "empty": ""},
		},
		{UUID: newUUID(), Topic: "storagetest.empty"},
	}
	before := time.Now()
	idsIn := e.insertRecords(in...)
	after := time.Now()
	got := e.claim("worker-1", 10, longLease)
	if len(got) != len(in) {
		t.Fatalf("Claim returned %d records, want %d", len(got), len(in))
	}
	for i, r := range got {
		want := in[i]
		switch {
		case r.ID != idsIn[i]:
			t.Errorf("record %d: Claim returned id %d, want %d (the id Insert returned)", i, r.ID, idsIn[i])
		case r.UUID != want.UUID:
			t.Errorf("record %d: Claim returned UUID %q, want %q: the UUID must be stored as given", r.ID, r.UUID, want.UUID)
		case r.Topic != want.Topic:
			t.Errorf("record %d: Claim returned topic %q, want %q", r.ID, r.Topic, want.Topic)
		case r.Key != want.Key:
			t.Errorf("record %d: Claim returned key %q, want %q", r.ID, r.Key, want.Key)
		case !bytes.Equal(r.Payload, want.Payload):
			t.Errorf("record %d: Claim returned payload %q, want %q: payloads are bytes, stored unchanged", r.ID, r.Payload, want.Payload)
		case len(r.Metadata) != len(want.Metadata) || (len(want.Metadata) > 0 && !maps.Equal(r.Metadata, want.Metadata)):
			t.Errorf("record %d: Claim returned metadata %v, want %v", r.ID, r.Metadata, want.Metadata)
		case r.Attempts != 1:
			t.Errorf("record %d: Claim returned attempts %d on the first claim, want 1: attempts are incremented at claim time", r.ID, r.Attempts)
		case r.CreatedAt.Before(before.Add(-time.Minute)) || r.CreatedAt.After(after.Add(time.Minute)):
			t.Errorf("record %d: Claim returned CreatedAt %v for a record inserted between %v and %v", r.ID, r.CreatedAt, before, after)
		case r.DecodeError != nil:
			t.Errorf("record %d: Claim returned DecodeError %v for a record stored by Insert", r.ID, r.DecodeError)
		}
	}
}

func testClaimNotYetDueSkipped(t *testing.T, e *env) {
	all := e.insert(keyless(3)...)
	e.claim("worker-1", 10, longLease)
	retryAt := time.Now().Add(time.Minute)
	e.release("worker-1", retryAt, all[0])
	e.release("worker-1", time.Now(), all[1:]...)
	got := e.claim("worker-2", 10, longLease)
	if hasID(got, all[0]) {
		t.Fatalf("Claim returned record %d whose due time is a minute away: only due records are claimable", all[0])
	}
	if !slices.Equal(ids(got), all[1:]) {
		t.Fatalf("Claim returned records %v, want %v: a record that is not due yet must not hold back due records", ids(got), all[1:])
	}
}

func leaseCases() []testCase {
	return []testCase{
		{name: "ExpiryMakesRecordClaimableAgain", run: testLeaseExpiry},
		{name: "AttemptsCountedAtClaim", run: testAttemptsCountedAtClaim},
	}
}

func testLeaseExpiry(t *testing.T, e *env) {
	id := e.insert("")[0]
	start := time.Now()
	e.claim("worker-1", 10, e.lease)
	leaseEnd := start.Add(e.lease) // worker-1's lease ends no earlier than this

	got := e.claim("worker-2", 10, longLease)
	end := time.Now()
	if !hasID(got, id) {
		got, end = e.claimUntil("worker-2", 10, longLease, id,
			"a record whose lease expired must be claimable again (a crashed worker must not hold it forever)")
	}
	if end.Before(leaseEnd) {
		t.Fatalf("Claim gave record %d to worker-2 %v after worker-1 leased it for %v: the lease must run its full length",
			id, end.Sub(start), e.lease)
	}
	r, _ := find(got, id)
	if r.Attempts != 2 {
		t.Fatalf("Claim returned attempts %d for the second claim of record %d, want 2: every claim counts an attempt, also one whose lease expired", r.Attempts, id)
	}
	if st, ok := e.state(id); ok && st.LeasedBy != "worker-2" {
		t.Fatalf("Inspect reports record %d leased by %q after worker-2 took it over, want worker-2", id, st.LeasedBy)
	}
}

func testAttemptsCountedAtClaim(t *testing.T, e *env) {
	id := e.insert("")[0]
	wantAttempts := func(step string, want int) {
		t.Helper()
		if st, ok := e.state(id); ok && st.Attempts != want {
			t.Fatalf("Inspect reports attempts %d %s, want %d", st.Attempts, step, want)
		}
	}
	claimOne := func(step string, want int, rule string) {
		t.Helper()
		got := e.claim("worker-1", 10, longLease)
		if len(got) != 1 || got[0].ID != id {
			t.Fatalf("Claim returned records %v %s, want [%d]", ids(got), step, id)
		}
		if got[0].Attempts != want {
			t.Fatalf("Claim returned attempts %d %s, want %d: %s", got[0].Attempts, step, want, rule)
		}
		wantAttempts(step, want)
	}
	wantAttempts("before any claim", 0)
	claimOne("on the first claim", 1, "attempts are incremented at claim time")
	e.nack("worker-1", id, "publish failed", time.Now())
	wantAttempts("after a Nack (Nack does not count attempts: the claim did)", 1)
	claimOne("on the claim after a Nack", 2, "attempts are incremented at claim time, not by Nack")
	e.release("worker-1", time.Now(), id)
	wantAttempts("after a Release (Release gives the attempt back)", 1)
	claimOne("on the claim after a Release", 2, "Release gives the attempt back (attempts-1), then the claim counts one")
}
