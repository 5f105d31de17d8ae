package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// openTestDB opens a fresh database file in the test's temp dir.
//
// It has Open's settings but a 60 s busy timeout: the concurrency cases of the
// contract run many writers on one file beside the rest of the suite, and on
// a loaded CI machine a producer's BEGIN once waited out Open's 5 s for the
// write lock (SQLITE_BUSY in OrderPerKeyWhileProducing). The cases check
// order and exactly-once, not how long a writer waits. (The wait itself came
// from claims polling an empty outbox under the write lock, which they no
// longer take: TestEmptyClaimTakesNoWriteLock.)
func openTestDB(t testing.TB) (*sql.DB, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "outbox.db")
	name := strings.Replace(dsn(path), "busy_timeout(5000)", "busy_timeout(60000)", 1)
	if name == dsn(path) {
		t.Fatalf("no busy_timeout(5000) in %q to raise", name)
	}
	db, err := sql.Open(DriverName, name)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db, path
}

// newTestStorage returns a storage with its schema over a fresh file.
func newTestStorage(t testing.TB, config Config) *Storage {
	t.Helper()
	db, _ := openTestDB(t)
	s, err := New(db, config)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if err := s.CreateSchema(context.Background()); err != nil {
		t.Fatalf("CreateSchema: %v", err)
	}
	return s
}

// fakeClock is a settable clock for lease and retry tests.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func useFakeClock(s *Storage) *fakeClock {
	c := &fakeClock{now: time.Unix(1_700_000_000, 0)}
	s.now = c.Now
	return c
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// insert commits records in one transaction and returns their ids in order.
func insert(t testing.TB, s *Storage, records ...storage.Record) []int64 {
	t.Helper()
	ctx := context.Background()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatalf("begin: %v", err)
	}
	defer func() { _ = tx.Rollback() }()
	if err := s.Insert(ctx, tx, records); err != nil {
		t.Fatalf("Insert: %v", err)
	}
	// The transaction holds the write lock, so the newest ids are ours.
	rows, err := tx.QueryContext(ctx, fmt.Sprintf(`SELECT id FROM %s ORDER BY id DESC LIMIT ?`, quote(s.table)), len(records))
	if err != nil {
		t.Fatalf("read ids: %v", err)
	}
	defer rows.Close()
	ids := make([]int64, len(records))
	i := len(records)
	for rows.Next() {
		i--
		if err := rows.Scan(&ids[i]); err != nil {
			t.Fatalf("scan id: %v", err)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("read ids: %v", err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatalf("commit: %v", err)
	}
	return ids
}

// recordState mirrors storagetest.State.
type recordState struct {
	Status      storage.Status
	Attempts    int
	LastError   string
	LeasedBy    string
	LeasedUntil time.Time
	DueAt       time.Time
}

// inspect reads the stored state of one record.
func inspect(t testing.TB, s *Storage, id int64) recordState {
	t.Helper()
	var (
		st           recordState
		status       string
		lastErr      sql.NullString
		leasedBy     sql.NullString
		leasedUntil  sql.NullInt64
		dueAt        int64
		attemptsRead int
	)
	err := s.db.QueryRow(fmt.Sprintf(
		`SELECT status, attempts, last_error, leased_by, leased_until, due_at FROM %s WHERE id = ?`, quote(s.table)), id).
		Scan(&status, &attemptsRead, &lastErr, &leasedBy, &leasedUntil, &dueAt)
	if err != nil {
		t.Fatalf("inspect record %d: %v", id, err)
	}
	st.Status = storage.Status(status)
	st.Attempts = attemptsRead
	st.LastError = lastErr.String
	st.LeasedBy = leasedBy.String
	if leasedUntil.Valid {
		st.LeasedUntil = fromNanos(leasedUntil.Int64)
	}
	st.DueAt = fromNanos(dueAt)
	return st
}

func claim(t testing.TB, s *Storage, n int, lease time.Duration, worker string) []storage.Record {
	t.Helper()
	recs, err := s.Claim(context.Background(), storage.ClaimParams{BatchSize: n, Lease: lease, WorkerID: worker})
	if err != nil {
		t.Fatalf("Claim(%s): %v", worker, err)
	}
	return recs
}

func ids(records []storage.Record) []int64 {
	out := make([]int64, len(records))
	for i, r := range records {
		out[i] = r.ID
	}
	return out
}

func rec(topic, key string) storage.Record {
	return storage.Record{UUID: fmt.Sprintf("uuid-%s-%s-%d", topic, key, time.Now().UnixNano()), Topic: topic, Key: key, Payload: []byte("p")}
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

// readLive reads into live the attempts of the records of ids: those of
// the live claim while a record is leased.
func readLive(t testing.TB, s *Storage, ids []int64, live map[int64]int) {
	t.Helper()
	rows, err := s.db.QueryContext(context.Background(), fmt.Sprintf(`SELECT id, attempts FROM %s WHERE id IN (SELECT value FROM json_each(?))`, quote(s.table)), idsJSON(ids))
	if err != nil {
		t.Errorf("read the attempts of records %v: %v", ids, err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		var attempts int
		if err := rows.Scan(&id, &attempts); err != nil {
			t.Errorf("read the attempts of records %v: %v", ids, err)
			return
		}
		live[id] = attempts
	}
	if err := rows.Err(); err != nil {
		t.Errorf("read the attempts of records %v: %v", ids, err)
	}
}

// liveRef is liveRefs for one record.
func liveRef(t testing.TB, s *Storage, id int64) storage.ClaimRef {
	t.Helper()
	return liveRefs(t, s, id)[0]
}
