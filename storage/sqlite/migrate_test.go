package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// schemaV1 is SchemaSQL as it was before migrations were versioned, for
// table "outbox": step 1 must be exactly it, so that databases made by the
// old CreateSchema are version 1.
const schemaV1 = `CREATE TABLE IF NOT EXISTS "outbox" (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    uuid         TEXT    NOT NULL,
    topic        TEXT    NOT NULL,
    "key"        TEXT    NOT NULL DEFAULT '',
    payload      BLOB    NOT NULL,
    metadata     TEXT,
    created_at   INTEGER NOT NULL,
    due_at       INTEGER NOT NULL DEFAULT 0,
    attempts     INTEGER NOT NULL DEFAULT 0,
    leased_by    TEXT,
    leased_until INTEGER,
    status       TEXT    NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'delivered', 'dead')),
    last_error   TEXT,
    delivered_at INTEGER
);
CREATE INDEX IF NOT EXISTS "outbox_pending" ON "outbox" (id) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS "outbox_pending_key" ON "outbox" ("key", max(due_at, ifnull(leased_until, 0)))
    WHERE status = 'pending' AND "key" <> '';
CREATE INDEX IF NOT EXISTS "outbox_delivered" ON "outbox" (delivered_at) WHERE status = 'delivered';
CREATE INDEX IF NOT EXISTS "outbox_dead_topic" ON "outbox" (topic, id) WHERE status = 'dead';
`

func newUnmigrated(t *testing.T) (*Storage, *sql.DB, string) {
	t.Helper()
	db, path := openTestDB(t)
	s, err := New(db, Config{})
	if err != nil {
		t.Fatal(err)
	}
	return s, db, path
}

func TestMigrationsStepOneIsTheOriginalSchema(t *testing.T) {
	t.Parallel()
	s, _, _ := newUnmigrated(t)
	migs := s.Migrations()
	if len(migs) != LatestVersion() || LatestVersion() < 2 {
		t.Fatalf("%d migrations, LatestVersion %d", len(migs), LatestVersion())
	}
	// Step 1 is the schema databases were made with, then its recording
	// in the version table.
	if !strings.HasPrefix(migs[0].Up, schemaV1) || !strings.Contains(migs[0].Up[len(schemaV1):], `INSERT OR IGNORE INTO "outbox_migrations"`) {
		t.Fatalf("step 1 is not the schema databases were made with, then its recording:\n%s", migs[0].Up)
	}
	for i, m := range migs {
		if m.Version != i+1 || m.Name == "" || m.Up == "" || strings.Contains(m.Up+m.Down, "{table}") {
			t.Errorf("migration %d: %+v", i, m)
		}
	}
	if migs[1].Down == "" {
		t.Error("step 2 has no down step; it only adds indexes")
	}
	var all strings.Builder
	for _, m := range migs {
		all.WriteString(m.Up)
	}
	if s.SchemaSQL() != all.String() {
		t.Error("SchemaSQL is not every up step in order")
	}
}

// dump reads every row of the outbox table, in id order, as text.
func dump(t *testing.T, db *sql.DB) []string {
	t.Helper()
	rows, err := db.Query(`SELECT id, uuid, topic, "key", hex(payload), ifnull(metadata, 'NULL'), created_at, due_at, attempts,
    ifnull(leased_by, 'NULL'), ifnull(leased_until, 'NULL'), status, ifnull(last_error, 'NULL'), ifnull(delivered_at, 'NULL')
FROM outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		v := make([]any, 14)
		p := make([]any, 14)
		for i := range v {
			p[i] = &v[i]
		}
		if err := rows.Scan(p...); err != nil {
			t.Fatal(err)
		}
		out = append(out, fmt.Sprint(v...))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestMigrateFromEveryVersionWithRecordsInFlight builds a database at each
// earlier version (0: made by the old CreateSchema, no version table), with
// records pending, leased, waiting for a retry, dead and delivered, migrates
// it, and checks that no row changed, ids go on from where they were, and
// the records are claimed as before, in id order.
func TestMigrateFromEveryVersionWithRecordsInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for from := 0; from < LatestVersion(); from++ {
		t.Run(fmt.Sprintf("from=%d", from), func(t *testing.T) {
			t.Parallel()
			s, db, _ := newUnmigrated(t)
			clock := useFakeClock(s)
			// Version `from`: step 1 as the old CreateSchema ran it, and the
			// version table with the steps up to `from`.
			if _, err := db.Exec(schemaV1); err != nil {
				t.Fatal(err)
			}
			if from > 0 {
				if _, err := db.Exec(`CREATE TABLE outbox_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)`); err != nil {
					t.Fatal(err)
				}
				for _, m := range s.Migrations()[:from] {
					if m.Version > 1 {
						if _, err := db.Exec(m.Up); err != nil {
							t.Fatal(err)
						}
					}
					if _, err := db.Exec(`INSERT OR IGNORE INTO outbox_migrations VALUES (?, ?, 1)`, m.Version, m.Name); err != nil { // the steps record themselves too
						t.Fatal(err)
					}
				}
			}
			// Records in every state, as the code of version `from` left
			// them, the highest id purged (ids must not be reused): a1
			// leased by w1, a2 and a3 given back, b delivered, c dead, a
			// keyless one pending, d waiting for its retry, e delivered and
			// purged.
			now := nanos(clock.Now())
			lease, retry := nanos(clock.Now().Add(time.Minute)), nanos(clock.Now().Add(time.Second))
			var all []int64
			for _, r := range []struct {
				key, status, leasedBy, lastError string
				attempts                         int
				leasedUntil, dueAt, deliveredAt  any
			}{
				{"a", "pending", "w1", "", 1, lease, 0, nil},
				{"a", "pending", "", "", 0, nil, now, nil},
				{"b", "delivered", "", "", 1, nil, 0, now},
				{"c", "dead", "", "poison", 1, nil, now, nil},
				{"", "pending", "", "", 0, nil, now, nil},
				{"d", "pending", "", "later", 1, nil, retry, nil},
				{"a", "pending", "", "", 0, nil, now, nil},
				{"e", "delivered", "", "", 1, nil, 0, now},
			} {
				res, err := db.Exec(`INSERT INTO outbox (uuid, topic, "key", payload, metadata, created_at, due_at, attempts,
    leased_by, leased_until, status, last_error, delivered_at) VALUES (?, 't', ?, x'70', NULL, ?, ?, ?, nullif(?, ''), ?, ?, nullif(?, ''), ?)`,
					fmt.Sprint("u", len(all)), r.key, now, r.dueAt, r.attempts, r.leasedBy, r.leasedUntil, r.status, r.lastError, r.deliveredAt)
				if err != nil {
					t.Fatal(err)
				}
				id, err := res.LastInsertId()
				if err != nil {
					t.Fatal(err)
				}
				all = append(all, id)
			}
			must := func(err error) {
				t.Helper()
				if err != nil {
					t.Fatal(err)
				}
			}
			if _, err := db.Exec(`DELETE FROM outbox WHERE id = ?`, all[7]); err != nil {
				t.Fatal(err)
			}
			// all[0] (a1) stays leased by w1.
			before := dump(t, db)

			if err := s.Migrate(ctx); err != nil {
				t.Fatalf("Migrate from version %d: %v", from, err)
			}
			if after := dump(t, db); !slices.Equal(before, after) {
				t.Fatalf("Migrate changed rows:\nbefore %q\nafter  %q", before, after)
			}
			ms, err := s.MigrationStatus(ctx)
			if err != nil || ms.Current != LatestVersion() || len(ms.Applied) != LatestVersion() {
				t.Fatalf("MigrationStatus = %+v, %v; want version %d with every step applied", ms, err, LatestVersion())
			}
			findings, err := s.Diagnose(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range findings {
				if f.Severity != storage.SeverityOK {
					t.Errorf("Diagnose after Migrate: %+v", f)
				}
			}
			// The records go on as before: a1 is leased (a2, a3 wait behind it),
			// d waits for its retry, the keyless one is claimable now.
			if got := claim(t, s, 100, time.Minute, "w2"); !slices.Equal(ids(got), []int64{all[4]}) {
				t.Fatalf("claim after Migrate = %v, want [%d]", ids(got), all[4])
			}
			must(s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, all[0]), WorkerID: "w1"}))
			clock.Add(2 * time.Second)
			if got := claim(t, s, 100, time.Minute, "w2"); !slices.Equal(ids(got), []int64{all[1], all[5], all[6]}) {
				t.Fatalf("claim after a1 acked = %v, want [%d %d %d] in id order", ids(got), all[1], all[5], all[6])
			}
			if n, err := s.Redrive(ctx, storage.RedriveParams{All: true}); err != nil || n != 1 {
				t.Fatalf("Redrive(All) after Migrate = %d, %v; want the dead record", n, err)
			}
			next := insert(t, s, rec("t", "f"))
			if next[0] <= all[7] {
				t.Fatalf("id %d after Migrate reuses an id up to %d", next[0], all[7])
			}
		})
	}
}

// TestMigrateConcurrent: many callers, each with its own connection pool
// like separate processes, migrate one fresh file at once; one applies the
// steps, the others find them applied.
func TestMigrateConcurrent(t *testing.T) {
	t.Parallel()
	_, path := openTestDB(t)
	ctx := context.Background()
	const callers = 8
	var wg sync.WaitGroup
	errs := make(chan error, callers*2)
	stores := make([]*Storage, callers)
	for i := range stores {
		db, err := Open(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		if stores[i], err = New(db, Config{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range stores {
		for range 2 { // two goroutines per pool: two connections of one process
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- s.Migrate(ctx)
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("concurrent Migrate: %v", err)
		}
	}
	ms, err := stores[0].MigrationStatus(ctx)
	if err != nil || ms.Current != LatestVersion() || len(ms.Applied) != LatestVersion() {
		t.Fatalf("MigrationStatus = %+v, %v; want each step recorded once", ms, err)
	}
}

func TestMigrateRefusesNewerDatabase(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{})
	if _, err := s.db.Exec(`INSERT INTO outbox_migrations VALUES (?, 'future', 1)`, LatestVersion()+1); err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err == nil || !strings.Contains(err.Error(), "newer") {
		t.Fatalf("Migrate of a newer database = %v, want an error saying it is newer", err)
	}
}

func TestDiagnose(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	find := func(t *testing.T, s *Storage, check string) storage.Finding {
		t.Helper()
		fs, err := s.Diagnose(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range fs {
			if f.Check == check {
				return f
			}
		}
		t.Fatalf("no %q finding in %+v", check, fs)
		return storage.Finding{}
	}
	t.Run("MissingIndex", func(t *testing.T) {
		t.Parallel()
		s := newTestStorage(t, Config{})
		if f := find(t, s, "schema drift"); f.Severity != storage.SeverityOK {
			t.Fatalf("fresh schema: %+v", f)
		}
		if _, err := s.db.Exec(`DROP INDEX outbox_pending_key_id`); err != nil {
			t.Fatal(err)
		}
		if f := find(t, s, "schema drift"); f.Severity != storage.SeverityProblem || !strings.Contains(f.Message, "outbox_pending_key_id is missing") {
			t.Fatalf("after dropping an index: %+v", f)
		}
	})
	t.Run("AlteredAndExtraIndex", func(t *testing.T) {
		t.Parallel()
		s := newTestStorage(t, Config{})
		if _, err := s.db.Exec(`DROP INDEX outbox_pending_hold; CREATE INDEX outbox_pending_hold ON outbox (id); CREATE INDEX mine ON outbox (topic)`); err != nil {
			t.Fatal(err)
		}
		if f := find(t, s, "schema drift"); f.Severity != storage.SeverityProblem || !strings.Contains(f.Message, `outbox_pending_hold differs: found "CREATE INDEX outbox_pending_hold ON outbox (id)", expected "CREATE INDEX`) {
			t.Fatalf("after altering an index: %+v", f)
		}
	})
	t.Run("WrongVersion", func(t *testing.T) {
		t.Parallel()
		s := newTestStorage(t, Config{})
		if f := find(t, s, "schema version"); f.Severity != storage.SeverityOK {
			t.Fatalf("fresh schema: %+v", f)
		}
		if _, err := s.db.Exec(`DELETE FROM outbox_migrations WHERE version = ?`, LatestVersion()); err != nil {
			t.Fatal(err)
		}
		if f := find(t, s, "schema version"); f.Severity != storage.SeverityProblem || !strings.Contains(f.Message, "migrate up") {
			t.Fatalf("behind: %+v", f)
		}
	})
	t.Run("NotWAL", func(t *testing.T) {
		t.Parallel()
		db, err := sql.Open(DriverName, "file:"+t.TempDir()+"/x.db")
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		s := newStorage(db, Config{}) // New refuses it; a file can leave WAL mode under a running storage
		if err := s.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		if f := find(t, s, "journal mode"); f.Severity != storage.SeverityProblem {
			t.Fatalf("rollback journal: %+v", f)
		}
	})
}

func TestHoldOnDeadLetterNeedsStrictOrdering(t *testing.T) {
	db, _ := openTestDB(t)
	if _, err := New(db, Config{HoldOnDeadLetter: true, DisableStrictOrdering: true}); err == nil {
		t.Fatal("New accepted HoldOnDeadLetter without strict ordering")
	}
}

// TestMigrateRefusesAnotherTable: a table of the outbox's name (or of its
// skipped table's) without the columns Migrate would give it is refused,
// naming what it lacks, and nothing is created or recorded.
func TestMigrateRefusesAnotherTable(t *testing.T) {
	t.Parallel()
	for _, foreign := range []string{"outbox", "outbox_skipped"} {
		db, _ := openTestDB(t)
		if _, err := db.Exec(`CREATE TABLE "` + foreign + `" (id INTEGER PRIMARY KEY, key TEXT, note TEXT)`); err != nil {
			t.Fatal(err)
		}
		s, err := New(db, Config{})
		if err != nil {
			t.Fatal(err)
		}
		err = s.Migrate(context.Background())
		if !errors.Is(err, storage.ErrNotOutboxTable) || !strings.Contains(err.Error(), `"`+foreign+`" exists but has no column uuid, topic,`) {
			t.Fatalf("Migrate with another %q table = %v, want ErrNotOutboxTable naming the missing columns", foreign, err)
		}
		names := schemaNames(t, db)
		if !slices.Equal(names, []string{foreign}) {
			t.Fatalf("after the refused Migrate the database holds %q, want only the foreign table", names)
		}
	}
}

// schemaNames returns the names in db's schema (tables, indexes, triggers).
func schemaNames(t *testing.T, db *sql.DB) []string {
	t.Helper()
	rows, err := db.Query(`SELECT name FROM sqlite_master ORDER BY name`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var names []string
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			t.Fatal(err)
		}
		names = append(names, n)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return names
}
