package postgres

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/txoutbox/txoutbox/storage"
)

const defaultTestDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

func testDatabaseURL() string {
	return cmp.Or(os.Getenv("TEST_DATABASE_URL"), defaultTestDatabaseURL)
}

var (
	poolOnce sync.Once
	poolErr  error
	pool     *pgxpool.Pool
)

func TestMain(m *testing.M) {
	flag.Parse()
	if err := probeDatabase(); err != nil && os.Getenv("CI") != "true" {
		// Tests skip on their own; examples cannot, so leave them out.
		fmt.Fprintf(os.Stderr, "PostgreSQL not reachable (%v): tests skip and examples are not run; start it with: pg_ctlcluster --skip-systemctl-redirect 15 main start\n", err)
		if err := flag.Set("test.run", "^Test"); err != nil {
			panic(err)
		}
	}
	code := m.Run()
	if pool != nil {
		pool.Close()
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goroutines left running after the tests:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func probeDatabase() error {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, testDatabaseURL())
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}

// testPool returns the package's shared pool, skipping the test when no
// database answers (failing instead with CI=true).
func testPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	poolOnce.Do(func() {
		cfg, err := pgxpool.ParseConfig(testDatabaseURL())
		if err != nil {
			poolErr = err
			return
		}
		cfg.MaxConns = 16
		// No schema on the search path: a query that forgets to qualify the
		// table fails instead of finding some other table.
		cfg.ConnConfig.RuntimeParams["search_path"] = ""
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		if err == nil {
			err = p.Ping(ctx)
		}
		if err != nil {
			if p != nil {
				p.Close()
			}
			poolErr = err
			return
		}
		pool = p
	})
	if poolErr != nil {
		msg := fmt.Sprintf("PostgreSQL not reachable at TEST_DATABASE_URL (%s): %v; start it with: pg_ctlcluster --skip-systemctl-redirect 15 main start", testDatabaseURL(), poolErr)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return pool
}

// newSchema creates a schema with a random name, dropped when the test ends.
func newSchema(t testing.TB) string {
	t.Helper()
	return newSchemaOn(t, testPool(t))
}

// newSchemaOn is newSchema in the database of pool p.
func newSchemaOn(t testing.TB, p *pgxpool.Pool) string {
	t.Helper()
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "txo_test_" + hex.EncodeToString(b[:])
	if _, err := p.Exec(t.Context(), "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("create schema %s: %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := p.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", name, err)
		}
	})
	return name
}

// newStore returns a storage on a fresh table in a fresh schema; cfg.Table,
// when set, is the table name inside that schema.
func newStore(t testing.TB, cfg Config) *Storage {
	t.Helper()
	return newStoreOn(t, testPool(t), cfg)
}

// newStoreOn is newStore in the database of pool p.
func newStoreOn(t testing.TB, p *pgxpool.Pool, cfg Config) *Storage {
	t.Helper()
	schema := newSchemaOn(t, p)
	cfg.Table = schema + "." + cmp.Or(cfg.Table, TableDefault)
	s, err := New(p, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if err := s.CreateSchema(t.Context()); err != nil {
		t.Fatalf("CreateSchema: %v", err)
	}
	return s
}

// insert commits records through a pgx transaction and returns their ids.
func insert(t testing.TB, s *Storage, records ...storage.Record) []int64 {
	t.Helper()
	ctx := t.Context()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatalf("begin: %v", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	ids, err := s.insert(ctx, tx, records, true)
	if err != nil {
		t.Fatalf("insert: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit: %v", err)
	}
	return ids
}

// rec returns a record of topic "t" with key.
func rec(key string) storage.Record {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return storage.Record{UUID: hex.EncodeToString(b[:]), Topic: "t", Key: key, Payload: []byte("p")}
}

func recs(keys ...string) []storage.Record {
	out := make([]storage.Record, len(keys))
	for i, k := range keys {
		out[i] = rec(k)
	}
	return out
}

// rowState mirrors storagetest.State.
type rowState struct {
	Status      storage.Status
	Attempts    int
	LastError   string
	LeasedBy    string
	LeasedUntil time.Time
	DueAt       time.Time
}

// inspect reads the stored state of one record: its outbox row, or its row in
// the delivered table once acked.
func inspect(t testing.TB, s *Storage, id int64) rowState {
	t.Helper()
	var st rowState
	var status string
	var attempts int32
	var leasedUntil, dueAt *time.Time
	var dueNow bool
	err := s.pool.QueryRow(t.Context(), fmt.Sprintf(`SELECT o.status, COALESCE(l.attempts, o.attempts), COALESCE(o.last_error, ''), COALESCE(l.leased_by, ''),
    l.leased_until, o.due_at, o.due_at <= now() FROM %s o LEFT JOIN %s l ON l.id = o.id WHERE o.id = $1
UNION ALL
SELECT 'delivered', d.attempts, COALESCE(d.last_error, ''), '', NULL, NULL, true FROM %s d WHERE d.id = $1`, s.table, s.leases, s.delivered), id).
		Scan(&status, &attempts, &st.LastError, &st.LeasedBy, &leasedUntil, &dueAt, &dueNow)
	if err != nil {
		t.Fatalf("inspect record %d: %v", id, err)
	}
	st.Status = storage.Status(status)
	st.Attempts = int(attempts)
	if leasedUntil != nil && st.LeasedBy != "" {
		st.LeasedUntil = *leasedUntil
	}
	if dueAt != nil && !dueNow {
		st.DueAt = *dueAt
	}
	return st
}

func claim(t testing.TB, s *Storage, worker string, batch int, lease time.Duration) []storage.Record {
	t.Helper()
	got, err := s.Claim(t.Context(), storage.ClaimParams{BatchSize: batch, Lease: lease, WorkerID: worker})
	if err != nil {
		t.Fatalf("Claim: %v", err)
	}
	return got
}

// claimDrained is claim through ClaimDrained: the ids it handed out, and
// whether it reported the storage drained.
func claimDrained(t testing.TB, s *Storage, worker string, batch int) ([]int64, bool) {
	t.Helper()
	got, drained, err := s.ClaimDrained(t.Context(), storage.ClaimParams{BatchSize: batch, Lease: time.Minute, WorkerID: worker})
	if err != nil {
		t.Fatalf("ClaimDrained: %v", err)
	}
	return idsOf(got), drained
}

func idsOf(records []storage.Record) []int64 {
	out := make([]int64, len(records))
	for i, r := range records {
		out[i] = r.ID
	}
	return out
}

// waitFor polls cond until it is true, failing the test after timeout.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// pgxpoolWithConfig opens a pool closed when the test ends; it connects lazily.
func pgxpoolWithConfig(t testing.TB, cfg *pgxpool.Config) (*pgxpool.Pool, error) {
	t.Helper()
	p, err := pgxpool.NewWithConfig(t.Context(), cfg)
	if err != nil {
		return nil, err
	}
	t.Cleanup(p.Close)
	return p, nil
}

// liveRefs names records as their live claims returned them (the attempts
// stored with their lease; 0, no claim's, for a record without one), for
// write-backs of the worker holding them. One query for all of them; safe
// from any goroutine: a failure is reported with Errorf.
func liveRefs(t testing.TB, s *Storage, ids ...int64) []storage.ClaimRef {
	t.Helper()
	live := make(map[int64]int, len(ids))
	readLive(t, s, ids, live)
	refs := make([]storage.ClaimRef, len(ids))
	for i, id := range ids {
		refs[i] = storage.ClaimRef{ID: id, Attempt: live[id]}
	}
	return refs
}

// readLive reads into live the attempts of the records of ids that have a
// lease.
func readLive(t testing.TB, s *Storage, ids []int64, live map[int64]int) {
	t.Helper()
	rows, err := s.pool.Query(context.Background(), "SELECT id, attempts FROM "+s.leases+" WHERE id = ANY($1)", ids)
	if err != nil {
		t.Errorf("read the leases of records %v: %v", ids, err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		var attempts int32
		if err := rows.Scan(&id, &attempts); err != nil {
			t.Errorf("read the leases of records %v: %v", ids, err)
			return
		}
		live[id] = int(attempts)
	}
	if err := rows.Err(); err != nil {
		t.Errorf("read the leases of records %v: %v", ids, err)
	}
}

// liveRef is liveRefs for one record.
func liveRef(t testing.TB, s *Storage, id int64) storage.ClaimRef {
	t.Helper()
	return liveRefs(t, s, id)[0]
}
