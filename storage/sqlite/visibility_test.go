package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// createdAts reads created_at of every record in id order.
func createdAts(t *testing.T, s *Storage) (idsOut, created []int64) {
	t.Helper()
	rows, err := s.db.Query(fmt.Sprintf(`SELECT id, created_at FROM %s ORDER BY id`, quote(s.table)))
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var id, c int64
		if err := rows.Scan(&id, &c); err != nil {
			t.Fatal(err)
		}
		idsOut, created = append(idsOut, id), append(created, c)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return idsOut, created
}

func checkCreatedIncreasing(t *testing.T, s *Storage) {
	t.Helper()
	ids, created := createdAts(t, s)
	for i := 1; i < len(ids); i++ {
		if created[i] < created[i-1] {
			t.Fatalf("record %d was created at %d, before record %d (%d): created_at must not decrease in id order",
				ids[i], created[i], ids[i-1], created[i-1])
		}
	}
}

// TestVisibilityDelayClockStepsBack: after the clock steps back 3 s, a
// record inserted then is not visible before the record of its key
// inserted before the step, and created_at does not decrease in id order
// (keyless records too).
func TestVisibilityDelayClockStepsBack(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{VisibilityDelay: time.Second})
	clock := useFakeClock(s)
	first := insert(t, s, rec("t", "k"), rec("t", ""))
	clock.Add(-3 * time.Second)
	second := insert(t, s, rec("t", "k"), rec("t", ""))
	checkCreatedIncreasing(t, s)
	// 1.5 s after the step, the records inserted after it would be visible
	// by the clock they read.
	clock.Add(1500 * time.Millisecond)
	if got := claim(t, s, 10, time.Minute, "w"); len(got) != 0 {
		t.Fatalf("claimed %v 1.5 s after the clock stepped back 3 s: records %v were inserted before the step and are not visible yet",
			ids(got), first)
	}
	clock.Add(3 * time.Second)
	want := []int64{first[0], first[1], second[0], second[1]}
	if got := claim(t, s, 10, time.Minute, "w"); !slices.Equal(ids(got), want) {
		t.Fatalf("claimed %v once all are visible, want %v", ids(got), want)
	}
}

// TestVisibilityDelayDeferredProducers: two producers whose transactions
// begin DEFERRED (their own handle on the file) read the clock in Insert
// before their INSERT waits for the write lock; the one that read it later
// may commit first. created_at still does not decrease in id order, and no
// claim returns the second record of the key without the first.
func TestVisibilityDelayDeferredProducers(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{VisibilityDelay: 300 * time.Millisecond})
	var path string
	if err := s.db.QueryRow(`SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&path); err != nil {
		t.Fatal(err)
	}
	deferred, err := sql.Open(DriverName, "file:"+path+"?_pragma=busy_timeout(60000)")
	if err != nil {
		t.Fatal(err)
	}
	defer deferred.Close()
	ctx := context.Background()
	// A third connection holds the write lock while both producers wait
	// for it: the early one (A) sleeps in SQLite's busy handler in steps
	// that grow to 100 ms, the late one (B), which read the clock 150 ms
	// later, retries every few ms at first, and usually gets the lock
	// first. Runs until B wins, up to 20 times.
	for try := 0; ; try++ {
		if try == 20 {
			t.Skip("the later producer never got the write lock first in 20 runs")
		}
		blocker, err := s.db.BeginTx(ctx, nil) // BEGIN IMMEDIATE: takes the write lock
		if err != nil {
			t.Fatal(err)
		}
		key := fmt.Sprint("k", try)
		results := make(chan error, 2)
		produce := func() {
			tx, err := deferred.BeginTx(ctx, nil)
			if err != nil {
				results <- err
				return
			}
			defer func() { _ = tx.Rollback() }()
			if err := s.Insert(ctx, tx, []storage.Record{rec("t", key)}); err != nil {
				results <- err
				return
			}
			results <- tx.Commit()
		}
		go produce() // A
		time.Sleep(150 * time.Millisecond)
		go produce() // B
		time.Sleep(100 * time.Millisecond)
		if err := blocker.Rollback(); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if err := <-results; err != nil {
				t.Fatal(err)
			}
		}
		checkCreatedIncreasing(t, s)
		var all []int64
		deadline := time.Now().Add(10 * time.Second)
		for len(all) < 2 && time.Now().Before(deadline) {
			got := claim(t, s, 10, time.Minute, "w")
			if len(all) == 0 && len(got) > 0 && got[0].CreatedAt.After(got[len(got)-1].CreatedAt) {
				t.Fatalf("claim returned %v out of created_at order", ids(got))
			}
			for _, r := range got {
				all = append(all, r.ID)
				if err := s.Ack(ctx, storage.AckParams{Records: []storage.ClaimRef{r.Ref()}, WorkerID: "w"}); err != nil {
					t.Fatal(err)
				}
			}
			time.Sleep(time.Millisecond)
		}
		if len(all) != 2 || all[0] > all[1] {
			t.Fatalf("claimed key %s's records in the order %v, want them in id order", key, all)
		}
		// Did B (the later clock) get the first id? Its created_at is then
		// the later one, and A's was raised to it.
		ids, created := createdAts(t, s)
		n := len(ids)
		if created[n-1] == created[n-2] {
			return // A's created_at was raised to B's: the case this test is for
		}
	}
}
