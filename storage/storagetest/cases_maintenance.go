package storagetest

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

func statsCases() []testCase {
	return []testCase{
		{name: "EmptyTable", run: testStatsEmpty},
		{name: "CountsByState", run: testStatsCounts},
	}
}

func statsReader(t *testing.T, e *env) storage.StatsReader {
	t.Helper()
	r, ok := e.s.(storage.StatsReader)
	if !ok {
		t.Skip("skipped: the storage does not implement storage.StatsReader")
	}
	return r
}

func testStatsEmpty(t *testing.T, e *env) {
	r := statsReader(t, e)
	st, err := r.Stats(e.ctx)
	if err != nil {
		t.Fatalf("Stats on an empty table returned error %v", err)
	}
	if st != (storage.Stats{}) {
		t.Fatalf("Stats on an empty table returned %+v, want all zero", st)
	}
}

func testStatsCounts(t *testing.T, e *env) {
	r := statsReader(t, e)
	before := time.Now()
	all := e.insert(keyless(5)...)
	e.claim("worker-1", 2, longLease)
	e.ack("worker-1", all[0])
	e.deadLetter("worker-1", all[1], "poison message")
	e.claim("worker-2", 1, longLease) // all[2] stays leased; all[3] and all[4] wait

	st, err := r.Stats(e.ctx)
	if err != nil {
		t.Fatalf("Stats returned error %v", err)
	}
	// Forwarders is optional (0 when not reported); HeldKeys is 0 for
	// keyless records.
	want := storage.Stats{Pending: 3, Leased: 1, Delivered: 1, Dead: 1, OldestPendingAge: st.OldestPendingAge, Forwarders: st.Forwarders,
		OldestDeliveredAge: st.OldestDeliveredAge}
	if st.OldestDeliveredAge < 0 || st.OldestDeliveredAge > time.Since(before)+time.Second {
		t.Errorf("Stats returned OldestDeliveredAge %v for a record delivered within the last %v: it is how long ago the oldest delivered record was delivered", st.OldestDeliveredAge, time.Since(before))
	}
	if st.Forwarders != 0 && st.Forwarders != 1 {
		t.Errorf("Stats returned Forwarders %d while one worker holds a live lease, want 1 (or 0 when the storage does not report it)", st.Forwarders)
	}
	if st != want {
		t.Errorf("Stats returned %+v after 1 ack, 1 dead-letter, 1 claim and 2 untouched records, want %+v: Pending counts records neither delivered nor dead (leased ones included), Leased those whose lease runs", st, want)
	}
	if age := time.Since(before) + time.Minute; st.OldestPendingAge < 0 || st.OldestPendingAge > age {
		t.Errorf("Stats returned OldestPendingAge %v for records inserted %v ago", st.OldestPendingAge, time.Since(before))
	}
}

func maintenanceCases() []testCase {
	return []testCase{
		{name: "RedriveByIDs", run: testRedriveByIDs},
		{name: "RedriveByTopic", run: testRedriveByTopic},
		{name: "RedriveByKeyAndAll", run: testRedriveByKeyAndAll},
		{name: "RedriveRejectsAmbiguousParams", run: testRedriveRejectsAmbiguous},
		{name: "PurgeDeletesOnlyDelivered", run: testPurge},
	}
}

func maintainer(t *testing.T, e *env) storage.Maintainer {
	t.Helper()
	m, ok := e.s.(storage.Maintainer)
	if !ok {
		t.Skip("skipped: the storage does not implement storage.Maintainer")
	}
	return m
}

func testRedriveByIDs(t *testing.T, e *env) {
	m := maintainer(t, e)
	all := e.insert(keyless(3)...)
	e.claim("worker-1", 10, longLease)
	e.deadLetter("worker-1", all[0], "poison message")
	e.deadLetter("worker-1", all[1], "poison message")
	e.ack("worker-1", all[2])

	n, err := m.Redrive(e.ctx, storage.RedriveParams{IDs: []int64{all[0], all[2]}})
	if err != nil {
		t.Fatalf("Redrive returned error %v", err)
	}
	if n != 1 {
		t.Fatalf("Redrive of one dead and one delivered record returned %d, want 1: only dead-lettered records are re-driven", n)
	}
	if st, ok := e.state(all[0]); ok && (st.Status != storage.StatusPending || st.Attempts != 0 || st.LastError != "") {
		t.Fatalf("Inspect reports record %d %s, attempts %d, error %q after Redrive, want pending, attempts 0, no error", all[0], st.Status, st.Attempts, st.LastError)
	}
	got := e.claim("worker-2", 10, longLease)
	if !slices.Equal(ids(got), all[:1]) {
		t.Fatalf("Claim returned records %v after re-driving record %d, want [%d]: a re-driven record is pending and due at once; the others stay dead or delivered",
			ids(got), all[0], all[0])
	}
	if got[0].Attempts != 1 {
		t.Fatalf("Claim returned attempts %d for a re-driven record, want 1: Redrive resets attempts", got[0].Attempts)
	}
}

// testRedriveByKeyAndAll re-drives the dead records of one key, then all
// the others: every Maintainer takes the four ways of RedriveParams.
func testRedriveByKeyAndAll(t *testing.T, e *env) {
	m := maintainer(t, e)
	all := e.insert("a", "b", "a", "")
	e.claim("worker-1", 10, longLease)
	for _, id := range all {
		e.deadLetter("worker-1", id, "poison message")
	}
	n, err := m.Redrive(e.ctx, storage.RedriveParams{Key: "a"})
	if err != nil || n != 2 {
		t.Fatalf("Redrive of key a returned %d, %v; want 2, nil: it re-drives the dead records of that key", n, err)
	}
	if got := e.claim("worker-2", 10, longLease); !slices.Equal(ids(got), []int64{all[0], all[2]}) {
		t.Fatalf("Claim returned records %v after re-driving key a, want %v", ids(got), []int64{all[0], all[2]})
	}
	n, err = m.Redrive(e.ctx, storage.RedriveParams{All: true})
	if err != nil || n != 2 {
		t.Fatalf("Redrive of all returned %d, %v; want 2, nil: it re-drives every dead record", n, err)
	}
	if got := e.claim("worker-3", 10, longLease); !slices.Equal(ids(got), []int64{all[1], all[3]}) {
		t.Fatalf("Claim returned records %v after re-driving all, want %v", ids(got), []int64{all[1], all[3]})
	}
}

func testRedriveByTopic(t *testing.T, e *env) {
	m := maintainer(t, e)
	a, b := newRecord("", 0), newRecord("", 1)
	a.Topic, b.Topic = "storagetest.redrive-a", "storagetest.redrive-b"
	all := e.insertRecords(a, b)
	e.claim("worker-1", 10, longLease)
	e.deadLetter("worker-1", all[0], "poison message")
	e.deadLetter("worker-1", all[1], "poison message")

	n, err := m.Redrive(e.ctx, storage.RedriveParams{Topic: a.Topic})
	if err != nil {
		t.Fatalf("Redrive returned error %v", err)
	}
	if n != 1 {
		t.Fatalf("Redrive of topic %q returned %d, want 1: it re-drives the dead records of that topic only", a.Topic, n)
	}
	got := e.claim("worker-2", 10, longLease)
	if !slices.Equal(ids(got), all[:1]) {
		t.Fatalf("Claim returned records %v after re-driving topic %q, want [%d]", ids(got), a.Topic, all[0])
	}
}

func testRedriveRejectsAmbiguous(t *testing.T, e *env) {
	m := maintainer(t, e)
	id := e.insert("")[0]
	for _, p := range []storage.RedriveParams{{}, {IDs: []int64{id}, Topic: topic}} {
		if _, err := m.Redrive(e.ctx, p); !errors.Is(err, storage.ErrInvalidRedrive) {
			t.Errorf("Redrive(%+v) returned %v: exactly one of IDs or Topic must be set, else an error wrapping storage.ErrInvalidRedrive (see RedriveParams.Validate)", p, err)
		}
	}
}

func testPurge(t *testing.T, e *env) {
	m := maintainer(t, e)
	all := e.insert(keyless(3)...)
	e.claim("worker-1", 10, longLease)
	e.ack("worker-1", all[0])
	e.deadLetter("worker-1", all[1], "poison message")
	// all[2] stays pending, leased by worker-1.

	n, err := m.Purge(e.ctx, time.Hour)
	if err != nil {
		t.Fatalf("Purge returned error %v", err)
	}
	if n != 0 {
		t.Fatalf("Purge(1h) deleted %d records delivered a moment ago: only records delivered more than olderThan ago are purged", n)
	}
	// Storages compare strictly ("delivered before now-olderThan"): poll until
	// the clock has moved past the delivery.
	var total int64
	deadline := time.Now().Add(2 * time.Second)
	for total == 0 && time.Now().Before(deadline) {
		n, err := m.Purge(e.ctx, 0)
		if err != nil {
			t.Fatalf("Purge returned error %v", err)
		}
		total += n
		e.pause()
	}
	if total == 0 {
		t.Fatal("Purge(0) deleted nothing within 2s of an Ack: a record delivered before now-olderThan is purged")
	}
	if total != 1 {
		t.Fatalf("Purge(0) deleted %d records, want 1 (the delivered one): dead and pending records are never purged", total)
	}
	if n, err := m.Redrive(e.ctx, storage.RedriveParams{IDs: all[1:2]}); err != nil || n != 1 {
		t.Fatalf("Redrive of the dead record after Purge returned %d, %v, want 1, nil: Purge must keep dead records", n, err)
	}
	e.release("worker-1", time.Now(), all[2])
	got := e.claim("worker-2", 10, longLease)
	if !slices.Equal(ids(got), all[1:]) {
		t.Fatalf("Claim returned records %v after Purge, want %v: Purge deletes delivered records only", ids(got), all[1:])
	}
}
