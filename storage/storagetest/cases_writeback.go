package storagetest

import (
	"slices"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// dueTolerance is how far a stored due time may drift from the RetryAt given:
// storages may keep time to the millisecond.
const dueTolerance = time.Millisecond

func nackCases() []testCase {
	return []testCase{
		{name: "SchedulesRetry", run: testNackSchedulesRetry},
		{name: "RecordsError", inspect: true, run: testNackRecordsError},
	}
}

// testRetryAt checks that record id, just given back by worker-1 with
// RetryAt retryAt, is not claimable before retryAt and is claimable after.
func testRetryAt(t *testing.T, e *env, id int64, retryAt time.Time, method string, attempts int) {
	t.Helper()
	got := e.claim("worker-2", 10, longLease)
	end := time.Now()
	if !hasID(got, id) {
		got, end = e.claimUntil("worker-2", 10, longLease, id, "a record must be claimable once the RetryAt of its "+method+" has passed")
	}
	if end.Before(retryAt) {
		t.Fatalf("Claim returned record %d %v before the RetryAt of its %s: a record is not claimable before it is due",
			id, retryAt.Sub(end), method)
	}
	if r, _ := find(got, id); r.Attempts != attempts {
		t.Fatalf("Claim returned attempts %d for record %d after a %s, want %d", r.Attempts, id, method, attempts)
	}
}

func testNackSchedulesRetry(t *testing.T, e *env) {
	id := e.insert("")[0]
	e.claim("worker-1", 10, longLease)
	retryAt := time.Now().Add(e.lease).Truncate(time.Millisecond)
	e.nack("worker-1", id, "publish failed", retryAt)
	testRetryAt(t, e, id, retryAt, "Nack", 2)
}

func testNackRecordsError(t *testing.T, e *env) {
	id := e.insert("")[0]
	e.claim("worker-1", 10, longLease)
	retryAt := time.Now().Add(time.Minute).Truncate(time.Millisecond)
	const reason = "publish to broker: connection refused"
	e.nack("worker-1", id, reason, retryAt)
	st, _ := e.state(id)
	if st.LastError != reason {
		t.Errorf("Inspect reports error %q after Nack with error %q: Nack records the error", st.LastError, reason)
	}
	if st.Status != storage.StatusPending {
		t.Errorf("Inspect reports status %q after Nack, want %q: a nacked record is retried", st.Status, storage.StatusPending)
	}
	if st.LeasedBy != "" {
		t.Errorf("Inspect reports record leased by %q after Nack: Nack ends the lease", st.LeasedBy)
	}
	if !near(st.DueAt, retryAt, dueTolerance) {
		t.Errorf("Inspect reports due time %v after Nack with RetryAt %v: Nack schedules the retry at RetryAt", st.DueAt, retryAt)
	}
	if st.Attempts != 1 {
		t.Errorf("Inspect reports attempts %d after one claim and a Nack, want 1", st.Attempts)
	}
}

func releaseCases() []testCase {
	return []testCase{
		{name: "RestoresAttempts", run: testReleaseRestoresAttempts},
		{name: "RespectsRetryAt", run: testReleaseRespectsRetryAt},
		{name: "RecordsNoError", inspect: true, run: testReleaseRecordsNoError},
	}
}

func testReleaseRestoresAttempts(t *testing.T, e *env) {
	all := e.insert(keyless(3)...)
	e.claim("worker-1", 10, longLease)
	e.release("worker-1", time.Now(), all...)
	for _, id := range all {
		if st, ok := e.state(id); ok && st.Attempts != 0 {
			t.Fatalf("Inspect reports attempts %d for record %d after one claim and a Release, want 0: Release gives the attempt back (attempts-1)", st.Attempts, id)
		}
	}
	got := e.claim("worker-2", 10, longLease)
	if !slices.Equal(ids(got), all) {
		t.Fatalf("Claim returned records %v after Release with RetryAt now, want %v: released records are due at RetryAt", ids(got), all)
	}
	for _, r := range got {
		if r.Attempts != 1 {
			t.Fatalf("Claim returned attempts %d for record %d after a Release, want 1: Release gives the attempt back (attempts-1), the relay never tried it", r.Attempts, r.ID)
		}
	}
}

func testReleaseRespectsRetryAt(t *testing.T, e *env) {
	id := e.insert("")[0]
	e.claim("worker-1", 10, longLease)
	retryAt := time.Now().Add(e.lease).Truncate(time.Millisecond)
	e.release("worker-1", retryAt, id)
	testRetryAt(t, e, id, retryAt, "Release", 1)
}

func testReleaseRecordsNoError(t *testing.T, e *env) {
	id := e.insert("")[0]
	e.claim("worker-1", 10, longLease)
	retryAt := time.Now().Add(time.Minute).Truncate(time.Millisecond)
	e.release("worker-1", retryAt, id)
	st, _ := e.state(id)
	if st.LastError != "" {
		t.Errorf("Inspect reports error %q after Release: Release records no error, the relay never tried the record", st.LastError)
	}
	if st.Status != storage.StatusPending || st.LeasedBy != "" {
		t.Errorf("Inspect reports record %s leased by %q after Release, want pending and not leased: Release ends the lease", st.Status, st.LeasedBy)
	}
	if !near(st.DueAt, retryAt, dueTolerance) {
		t.Errorf("Inspect reports due time %v after Release with RetryAt %v: the record is due again at RetryAt", st.DueAt, retryAt)
	}
}

func deadLetterCases() []testCase {
	return []testCase{
		{name: "NeverClaimedAgain", run: testDeadLetterNeverClaimedAgain},
		{name: "RecordsStatusAndError", inspect: true, run: testDeadLetterRecordsError},
	}
}

func testDeadLetterNeverClaimedAgain(t *testing.T, e *env) {
	all := e.insert(keyless(2)...)
	e.claim("worker-1", 10, e.lease)
	e.deadLetter("worker-1", all[0], "poison message")
	// Past the lease: a dead record must not come back when its lease ends.
	got := e.claimNothingFor(2*e.lease, "worker-2", all[:1],
		"it was dead-lettered: a dead-lettered record is never claimed again, not even after its lease ends")
	if !hasID(got, all[1]) {
		t.Fatalf("record %d, claimed with record %d and never written back, was not claimable after its lease expired", all[1], all[0])
	}
}

func testDeadLetterRecordsError(t *testing.T, e *env) {
	id := e.insert("")[0]
	e.claim("worker-1", 10, longLease)
	const reason = "max attempts reached: broker rejected the message"
	e.deadLetter("worker-1", id, reason)
	st, _ := e.state(id)
	if st.Status != storage.StatusDead {
		t.Errorf("Inspect reports status %q after DeadLetter, want %q", st.Status, storage.StatusDead)
	}
	if st.LastError != reason {
		t.Errorf("Inspect reports error %q after DeadLetter with error %q: DeadLetter records the reason", st.LastError, reason)
	}
}

func ackCases() []testCase {
	return []testCase{
		{name: "NeverClaimedAgain", run: testAckNeverClaimedAgain},
	}
}

func testAckNeverClaimedAgain(t *testing.T, e *env) {
	all := e.insert(keyless(3)...)
	e.claim("worker-1", 10, e.lease)
	acked := []int64{all[0], all[2]}
	e.ack("worker-1", acked...)
	for _, id := range acked {
		if st, ok := e.state(id); ok && st.Status != storage.StatusDelivered {
			t.Fatalf("Inspect reports status %q for record %d after Ack, want %q", st.Status, id, storage.StatusDelivered)
		}
	}
	got := e.claimNothingFor(2*e.lease, "worker-2", acked,
		"it was acked: an acked record is delivered and never claimed again, not even after its lease ends")
	if !slices.Equal(ids(got), all[1:2]) {
		t.Fatalf("Claim returned records %v after the lease expired, want %v: the record claimed with the acked ones and not acked is claimable again", ids(got), all[1:2])
	}
}
