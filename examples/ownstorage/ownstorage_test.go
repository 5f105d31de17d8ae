package ownstorage

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/storagetest"
)

// TestContract runs the storage contract suite against the table, with
// strict ordering on and off, each case on a table of its own in the local
// PostgreSQL.
func TestContract(t *testing.T) {
	db := openDB(t)
	for _, strict := range []bool{true, false} {
		t.Run(fmt.Sprintf("strict=%v", strict), func(t *testing.T) {
			storagetest.Run(t, storagetest.Harness{
				New: func(t *testing.T) storage.Storage {
					return newTable(t, db, Config{DisableStrictOrdering: !strict})
				},
				Insert: func(t *testing.T, s storage.Storage, records ...storage.Record) []int64 {
					return insert(t, db, s.(*Storage), records)
				},
				Inspect: func(t *testing.T, s storage.Storage, id int64) storagetest.State {
					return inspect(t, db, s.(*Storage), id)
				},
				StrictOrdering: strict,
			})
		})
	}
}

// TestNewRejectsBadTableName checks that a table name that is not a plain
// identifier is refused before any SQL runs.
func TestNewRejectsBadTableName(t *testing.T) {
	for _, name := range []string{"events; DROP TABLE x", "Events", `"events"`, "public.events", strings.Repeat("a", 64)} {
		if _, err := New(nil, Config{Table: name}); err == nil || !strings.Contains(err.Error(), storage.ErrInvalidIdentifier.Error()) {
			t.Errorf("New(Table: %q) returned %v, want storage.ErrInvalidIdentifier", name, err)
		}
	}
}

func openDB(t *testing.T) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		msg := "PostgreSQL not reachable at TEST_DATABASE_URL: " + err.Error() + "; start it with: pg_ctlcluster --skip-systemctl-redirect 15 main start"
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return db
}

var tables atomic.Int64

// newTable creates an empty table of its own for one test and drops it after.
func newTable(t *testing.T, db *sql.DB, config Config) *Storage {
	t.Helper()
	config.Table = fmt.Sprintf("ownstorage_%d_%d", os.Getpid(), tables.Add(1))
	s, err := New(db, config)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(s.SchemaSQL()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Exec("DROP TABLE " + config.Table) })
	return s
}

func insert(t *testing.T, db *sql.DB, s *Storage, records []storage.Record) []int64 {
	t.Helper()
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	ids, err := s.InsertIDs(ctx, tx, records)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return ids
}

func inspect(t *testing.T, db *sql.DB, s *Storage, id int64) storagetest.State {
	t.Helper()
	var state string
	var st storagetest.State
	var lastError, lockedBy sql.NullString
	var lockedUntil, notBefore sql.NullTime
	err := db.QueryRow(`SELECT state, tries, error_text, locked_by, locked_until, not_before FROM `+s.table+` WHERE event_id = $1`, id).
		Scan(&state, &st.Attempts, &lastError, &lockedBy, &lockedUntil, &notBefore)
	if err != nil {
		t.Fatalf("inspect %d: %v", id, err)
	}
	st.Status = map[string]storage.Status{"NEW": storage.StatusPending, "SENT": storage.StatusDelivered, "FAILED": storage.StatusDead}[state]
	st.LastError, st.LeasedBy, st.LeasedUntil, st.DueAt = lastError.String, lockedBy.String, lockedUntil.Time, notBefore.Time
	return st
}
