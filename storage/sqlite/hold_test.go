package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// holds reads the hold column of the records, in order.
func holds(t *testing.T, s *Storage, ids ...int64) []string {
	t.Helper()
	out := make([]string, len(ids))
	for i, id := range ids {
		var h sql.NullString
		if err := s.db.QueryRow(fmt.Sprintf(`SELECT hold FROM %s WHERE id = ?`, quote(s.table)), id).Scan(&h); err != nil {
			t.Fatal(err)
		}
		out[i] = cmpOr(h.String, "-")
	}
	return out
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// TestInsertSetsQueuedRecordsAside: a keyed record is inserted behind an
// earlier pending record of its key, in the same Insert or an earlier one;
// the first of a key, and keyless records, are not; without strict
// ordering none is.
func TestInsertSetsQueuedRecordsAside(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{})
	got := insert(t, s, rec("t", "a"), rec("t", "a"), rec("t", ""), rec("t", "b"))
	got = append(got, insert(t, s, rec("t", "b"), rec("t", "c"))...)
	if h := holds(t, s, got...); !slices.Equal(h, []string{"-", "behind", "-", "-", "behind", "-"}) {
		t.Fatalf("holds after insert %v", h)
	}
	loose := newTestStorage(t, Config{DisableStrictOrdering: true})
	got = insert(t, loose, rec("t", "a"), rec("t", "a"))
	if h := holds(t, loose, got...); !slices.Equal(h, []string{"-", "-"}) {
		t.Fatalf("holds without strict ordering %v", h)
	}
}

// TestClaimTakesQueuedRecordsAlong: a claim walks one record per key and
// takes the records queued behind it while there is room, sharing the room
// evenly among the keys it took; the rest stays set aside, and the next
// record of a key is set free when the claimed ones are delivered.
func TestClaimTakesQueuedRecordsAlong(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{})
	a := insert(t, s, rec("t", "a"), rec("t", "a"), rec("t", "a"), rec("t", "a"), rec("t", "a"))
	b := insert(t, s, rec("t", "b"), rec("t", "b"), rec("t", "b"))
	c := insert(t, s, rec("t", ""))
	// The walk: a1, b1, c; the room left (3) shared: two for a, one for b.
	got := claim(t, s, 6, time.Minute, "w")
	want := []int64{a[0], a[1], a[2], b[0], b[1], c[0]}
	if !slices.Equal(ids(got), want) {
		t.Fatalf("claimed %v, want %v", ids(got), want)
	}
	if more := claim(t, s, 10, time.Minute, "w2"); len(more) != 0 {
		t.Fatalf("claimed %v while the earlier records of their keys are in flight", ids(more))
	}
	ctx := context.Background()
	if err := s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, a[0], a[1]), WorkerID: "w"}); err != nil {
		t.Fatal(err)
	}
	if h := holds(t, s, a[3], a[4]); !slices.Equal(h, []string{"behind", "behind"}) {
		t.Fatalf("a's queue freed while a3 is still in flight: %v", h)
	}
	if err := s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, a[2], b[0], b[1]), WorkerID: "w"}); err != nil {
		t.Fatal(err)
	}
	if h := holds(t, s, a[3], a[4], b[2]); !slices.Equal(h, []string{"-", "behind", "-"}) {
		t.Fatalf("holds after the acks %v, want the next record of each key set free", h)
	}
	if got := claim(t, s, 10, time.Minute, "w2"); !slices.Equal(ids(got), []int64{a[3], a[4], b[2]}) {
		t.Fatalf("claimed %v after the acks, want %v", ids(got), []int64{a[3], a[4], b[2]})
	}
}

// TestNextRecordSetFree: every way a key's first pending record goes sets
// the next one free: dead-lettered (without HoldOnDeadLetter), skipped
// after a dead-letter with it, deleted by hand; with HoldOnDeadLetter a
// dead record keeps it set aside until re-driven or skipped.
func TestNextRecordSetFree(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	t.Run("DeadLetter", func(t *testing.T) {
		t.Parallel()
		s := newTestStorage(t, Config{})
		a := insert(t, s, rec("t", "a"), rec("t", "a"))
		claim(t, s, 1, time.Minute, "w")
		if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: liveRef(t, s, a[0]), WorkerID: "w", Error: "poison"}); err != nil {
			t.Fatal(err)
		}
		if got := claim(t, s, 10, time.Minute, "w"); !slices.Equal(ids(got), a[1:]) {
			t.Fatalf("claimed %v after the dead-letter, want %v", ids(got), a[1:])
		}
	})
	t.Run("ByHand", func(t *testing.T) {
		t.Parallel()
		s := newTestStorage(t, Config{})
		a := insert(t, s, rec("t", "a"), rec("t", "a"))
		if _, err := s.db.Exec(`DELETE FROM outbox WHERE id = ?`, a[0]); err != nil {
			t.Fatal(err)
		}
		if got := claim(t, s, 10, time.Minute, "w"); !slices.Equal(ids(got), a[1:]) {
			t.Fatalf("claimed %v after the first record was deleted by hand, want %v", ids(got), a[1:])
		}
	})
	t.Run("HoldOnDeadLetter", func(t *testing.T) {
		t.Parallel()
		s := newTestStorage(t, Config{HoldOnDeadLetter: true})
		a := insert(t, s, rec("t", "a"), rec("t", "a"))
		claim(t, s, 1, time.Minute, "w")
		if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: liveRef(t, s, a[0]), WorkerID: "w", Error: "poison"}); err != nil {
			t.Fatal(err)
		}
		later := insert(t, s, rec("t", "a"))
		if h := holds(t, s, a[0], a[1], later[0]); !slices.Equal(h, []string{"key", "behind", "behind"}) {
			t.Fatalf("holds after the dead-letter %v", h)
		}
		// A storage without HoldOnDeadLetter on the same table: the record
		// dead-lettered with it still holds its key.
		loose, err := New(s.db, Config{})
		if err != nil {
			t.Fatal(err)
		}
		if got := claim(t, loose, 10, time.Minute, "w"); len(got) != 0 {
			t.Fatalf("claimed %v while a dead record holds the key", ids(got))
		}
		if held, err := loose.HeldKeys(ctx, storage.HeldKeysParams{}); err != nil || len(held) != 1 || held[0].Reason != storage.HoldDead {
			t.Fatalf("HeldKeys without HoldOnDeadLetter = %+v, %v; want key a held by its dead record", held, err)
		}
		if err := loose.Skip(ctx, storage.SkipParams{ID: a[0], Reason: "poison"}); err != nil {
			t.Fatal(err)
		}
		if got := claim(t, loose, 10, time.Minute, "w"); !slices.Equal(ids(got), []int64{a[1], later[0]}) {
			t.Fatalf("claimed %v after the skip, want %v", ids(got), []int64{a[1], later[0]})
		}
	})
}

// TestRetryDueComesBack: a nacked record waits out of the walk and comes
// back when due, with the records queued behind it.
func TestRetryDueComesBack(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{})
	clock := useFakeClock(s)
	ctx := context.Background()
	a := insert(t, s, rec("t", "a"), rec("t", "a"), rec("t", "a"))
	got := claim(t, s, 10, time.Minute, "w")
	if !slices.Equal(ids(got), a) {
		t.Fatalf("claimed %v, want %v", ids(got), a)
	}
	if err := s.Nack(ctx, storage.NackParams{Record: liveRef(t, s, a[0]), WorkerID: "w", Error: "down", RetryAt: clock.Now().Add(time.Minute)}); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, storage.ReleaseParams{Records: liveRefs(t, s, a[1:]...), WorkerID: "w", RetryAt: clock.Now()}); err != nil {
		t.Fatal(err)
	}
	if h := holds(t, s, a...); !slices.Equal(h, []string{"retry", "behind", "behind"}) {
		t.Fatalf("holds after the nack and release %v", h)
	}
	if got := claim(t, s, 10, time.Minute, "w"); len(got) != 0 {
		t.Fatalf("claimed %v before the retry is due", ids(got))
	}
	clock.Add(time.Minute)
	if got := claim(t, s, 10, time.Minute, "w"); !slices.Equal(ids(got), a) {
		t.Fatalf("claimed %v once due, want %v", ids(got), a)
	}
}

// TestMigrateOverSchemaMadeByHand: a database made by running SchemaSQL by
// hand is at the latest version, so Migrate runs no step again (step 3's
// ADD COLUMN cannot: SQLite has no ADD COLUMN IF NOT EXISTS).
func TestMigrateOverSchemaMadeByHand(t *testing.T) {
	t.Parallel()
	s, db, _ := newUnmigrated(t)
	if _, err := db.Exec(s.SchemaSQL()); err != nil {
		t.Fatal(err)
	}
	applied, err := s.MigrateReport(context.Background())
	if err != nil || len(applied) != 0 {
		t.Fatalf("Migrate over a schema made from SchemaSQL applied %v, %v; want nothing", applied, err)
	}
	if _, err := db.Exec(s.SchemaSQL()); err == nil || !strings.Contains(err.Error(), "duplicate column") {
		t.Fatalf("SchemaSQL run twice = %v, want the duplicate column error of step 3", err)
	}
}

// TestClaimPlans: the statements of a claim read the indexes they were
// written for: the walk the records not set aside in id order, the
// strict-ordering checks a key's earlier records, the due retries by due
// time. A plan that scans or sorts the table would make a claim's cost grow
// with the held records again.
func TestClaimPlans(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{HoldOnDeadLetter: true, VisibilityDelay: time.Second})
	plan := func(query string) string {
		rows, err := s.db.Query("EXPLAIN QUERY PLAN "+query, 1, 2, 3, 4, 5, sql.Named("now", 1), sql.Named("limit", 1), sql.Named("attempt", 1))
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var out []string
		for rows.Next() {
			var id, parent, unused int
			var detail string
			if err := rows.Scan(&id, &parent, &unused, &detail); err != nil {
				t.Fatal(err)
			}
			out = append(out, detail)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return strings.Join(out, "\n")
	}
	for name, c := range map[string]struct {
		query string
		want  []string
	}{
		"probe": {s.probeSQL, []string{"SEARCH o USING INDEX outbox_pending_hold (hold=?)", "outbox_pending_key_id (key=? AND id<?)",
			"outbox_dead_key (key=? AND id<?)", "INDEX outbox_retry_due (due_at<?)"}},
		"due":   {s.dueSQL, []string{"INDEX outbox_retry_due (due_at<?)", "outbox_pending_key_id (key=? AND id<?)"}},
		"walk":  {s.claimSQL, []string{"SEARCH o USING INDEX outbox_pending_hold (hold=?)", "outbox_pending_key_id (key=? AND id<?)"}},
		"queue": {s.queueSQL, []string{"outbox_pending_key_id (key=? AND id>? AND id<?)", "outbox_dead_key (key=? AND id>?)"}},
		"nack":  {s.nackSQL, []string{"outbox_pending_key_id (key=? AND id<?)"}},
	} {
		got := plan(c.query)
		for _, w := range c.want {
			if !strings.Contains(got, w) {
				t.Errorf("%s: plan has no %q:\n%s", name, w, got)
			}
		}
		if strings.Contains(got, "SCAN outbox") || strings.Contains(got, "SCAN o ") || strings.Contains(got, "TEMP B-TREE") {
			t.Errorf("%s: plan scans or sorts:\n%s", name, got)
		}
	}
}
