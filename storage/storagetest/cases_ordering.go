package storagetest

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

func keyCases() []testCase {
	return []testCase{
		{name: "KeylessNeverHeldBack", run: testKeylessNeverHeldBack},
		{name: "OtherKeysNotHeldBack", run: testOtherKeysNotHeldBack},
	}
}

func testKeylessNeverHeldBack(t *testing.T, e *env) {
	all := e.insert(keyless(3)...)
	e.claim("worker-1", 1, longLease)
	e.nack("worker-1", all[0], "publish failed", time.Now().Add(time.Minute))
	got := e.claim("worker-2", 10, longLease)
	if hasID(got, all[0]) {
		t.Fatalf("Claim returned record %d a minute before the RetryAt of its Nack: a record is not claimable before it is due", all[0])
	}
	if !slices.Equal(ids(got), all[1:]) {
		t.Fatalf("Claim returned records %v while keyless record %d waited for its retry, want %v: records with an empty key are independent, never held back",
			ids(got), all[0], all[1:])
	}
}

func testOtherKeysNotHeldBack(t *testing.T, e *env) {
	all := e.insert("a", "a", "b", "c")
	e.claim("worker-1", 1, longLease)
	e.nack("worker-1", all[0], "publish failed", time.Now().Add(time.Minute))
	got := e.claim("worker-2", 10, longLease)
	if hasID(got, all[0]) {
		t.Fatalf("Claim returned record %d a minute before the RetryAt of its Nack: a record is not claimable before it is due", all[0])
	}
	for _, id := range all[2:] {
		if !hasID(got, id) {
			t.Fatalf("Claim returned records %v, without record %d of key b or c, while record %d of key a waited for its retry: a key's failure must not hold back other keys",
				ids(got), id, all[0])
		}
	}
}

func strictOrderingCases() []testCase {
	return []testCase{
		{name: "HeldBackWhileEarlierLeased", strict: true, run: testHeldBackWhileEarlierLeased},
		{name: "HeldBackWhileEarlierNackedNotDue", strict: true, run: testHeldBackWhileEarlierNacked},
		{name: "HeldBackWhileEarlierReleasedNotDue", strict: true, run: testHeldBackWhileEarlierReleased},
		{name: "HeldBackUntilEarlierExpiredLeaseReclaimed", strict: true, run: testHeldBackUntilExpiredReclaimed},
		{name: "BatchTakesKeyInOrder", strict: true, run: testBatchTakesKeyInOrder},
	}
}

// heldBack explains a strict-ordering failure.
func heldBack(later, earlier int64, key, why string) string {
	return fmt.Sprintf("Claim returned record %d while earlier record %d of key %q %s: strict ordering holds a record back while an earlier pending record of its key is not claimable",
		later, earlier, key, why)
}

func testHeldBackWhileEarlierLeased(t *testing.T, e *env) {
	all := e.insert("a", "a", "b", "", "a")
	a1, a2, b3, k4, a5 := all[0], all[1], all[2], all[3], all[4]
	e.claim("worker-1", 1, longLease) // a1
	got := e.claim("worker-2", 10, longLease)
	for _, id := range []int64{a2, a5} {
		if hasID(got, id) {
			t.Fatal(heldBack(id, a1, "a", "was leased"))
		}
	}
	if !slices.Equal(ids(got), []int64{b3, k4}) {
		t.Fatalf("Claim returned records %v while record %d of key a was leased, want [%d %d]: records of other keys and keyless records are not held back",
			ids(got), a1, b3, k4)
	}

	e.ack("worker-1", a1)
	got = e.claim("worker-3", 10, longLease)
	if len(got) == 0 || got[0].ID != a2 {
		t.Fatalf("Claim returned records %v after record %d was acked, want %d first: once the earlier record is delivered the next one of its key is claimable",
			ids(got), a1, a2)
	}
	if !hasID(got, a5) {
		e.ack("worker-3", a2)
		e.claimUntil("worker-3", 10, longLease, a5, "once every earlier record of its key is delivered a record is claimable")
	}
}

func testHeldBackWhileEarlierNacked(t *testing.T, e *env) {
	all := e.insert("a", "a", "b")
	a1, a2, b3 := all[0], all[1], all[2]
	e.claim("worker-1", 1, longLease) // a1
	retryAt := time.Now().Add(e.lease)
	e.nack("worker-1", a1, "publish failed", retryAt)

	got := e.claim("worker-2", 10, longLease)
	if hasID(got, a2) && !hasID(got, a1) {
		t.Fatal(heldBack(a2, a1, "a", "was nacked and not yet due"))
	}
	if !hasID(got, b3) {
		t.Fatalf("Claim returned records %v without record %d of key b while record %d of key a waited for its retry: other keys are not held back", ids(got), b3, a1)
	}
	if hasID(got, a1) {
		// A slow run reached the RetryAt already: give key a back and go on.
		if time.Now().Before(retryAt) {
			t.Fatalf("Claim returned record %d before the RetryAt of its Nack: a record is not claimable before it is due", a1)
		}
		e.release("worker-2", time.Now(), a1, a2)
	}
	// Once a1 is due it comes first (claimUntil fails on a claim without it);
	// dead-lettering it then lets a2 through.
	e.claimUntil("worker-3", 1, longLease, a1, "the earlier record must be claimable once its RetryAt passed, and come before the later one")
	if got := e.claim("worker-4", 10, longLease); hasID(got, a2) {
		t.Fatal(heldBack(a2, a1, "a", "was leased"))
	}
	e.deadLetter("worker-3", a1, "poison message")
	got = e.claim("worker-4", 10, longLease)
	if !slices.Equal(ids(got), []int64{a2}) {
		t.Fatalf("Claim returned records %v after record %d was dead-lettered, want [%d]: a dead-lettered record no longer holds back its key", ids(got), a1, a2)
	}
}

func testHeldBackWhileEarlierReleased(t *testing.T, e *env) {
	all := e.insert("a", "a")
	e.claim("worker-1", 1, longLease)
	e.release("worker-1", time.Now().Add(time.Minute), all[0])
	if got := e.claim("worker-2", 10, longLease); hasID(got, all[1]) {
		t.Fatal(heldBack(all[1], all[0], "a", "was released and not yet due"))
	}
}

func testHeldBackUntilExpiredReclaimed(t *testing.T, e *env) {
	all := e.insert("a", "a")
	e.claim("worker-1", 1, e.lease)
	// claimUntil fails if a claim returns a2 without a1 before it.
	e.claimUntil("worker-2", 10, longLease, all[0],
		"after the earlier record's lease expired it must be claimed again first: the later record stays held back until then")
}

func testBatchTakesKeyInOrder(t *testing.T, e *env) {
	all := e.insert("a", "a", "a")
	got := e.claim("worker-1", 2, longLease)
	if !slices.Equal(ids(got), all[:2]) {
		t.Fatalf("Claim of batch size 2 returned records %v, want %v: claimable records of one key may share a batch, in id order", ids(got), all[:2])
	}
	if got := e.claim("worker-2", 10, longLease); hasID(got, all[2]) {
		t.Fatal(heldBack(all[2], all[0], "a", "was leased"))
	}
	e.ack("worker-1", all[0])
	if got := e.claim("worker-2", 10, longLease); hasID(got, all[2]) {
		t.Fatal(heldBack(all[2], all[1], "a", "was leased"))
	}
	e.ack("worker-1", all[1])
	got = e.claim("worker-2", 10, longLease)
	if !slices.Equal(ids(got), all[2:]) {
		t.Fatalf("Claim returned records %v after the earlier records of key a were acked, want %v", ids(got), all[2:])
	}
}
