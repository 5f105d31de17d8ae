package console

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// newPostgres returns a migrated storage holding keys on dead-letter, on a
// table in a schema of its own (dropped when the test ends), and its pool.
// Without a database it skips, or fails with CI=true.
func newPostgres(t *testing.T) (*postgres.Storage, *pgxpool.Pool) {
	t.Helper()
	url := cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, url)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		msg := fmt.Sprintf("PostgreSQL not reachable at %s: %v", url, err)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	t.Cleanup(pool.Close)
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := "txo_console_" + hex.EncodeToString(b[:])
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	s, err := postgres.New(pool, postgres.Config{Table: schema + ".outbox", HoldOnDeadLetter: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return s, pool
}

// insertPostgres inserts recs in one transaction.
func insertPostgres(t *testing.T, s *postgres.Storage, pool *pgxpool.Pool, recs []storage.Record) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Error(err)
		return
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	if err := s.Insert(ctx, tx, recs); err != nil {
		t.Error(err)
		return
	}
	if err := tx.Commit(ctx); err != nil {
		t.Error(err)
	}
}

// seedPostgres does what seed does on a fresh PostgreSQL table.
func seedPostgres(t *testing.T, recs ...deadRec) (testStore, []int64) {
	t.Helper()
	s, pool := newPostgres(t)
	var ids []int64
	if len(recs) > 0 {
		insertPostgres(t, s, pool, records(recs))
		for i := range recs { // a fresh table numbers its records from 1
			ids = append(ids, int64(i+1))
		}
		deadLetter(t, s, ids, recs)
	}
	return s, ids
}

func openPostgresBrowser(t *testing.T) (storage.Storage, func(recs []storage.Record)) {
	s, pool := newPostgres(t)
	return s, func(recs []storage.Record) { insertPostgres(t, s, pool, recs) }
}
