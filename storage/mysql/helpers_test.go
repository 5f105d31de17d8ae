package mysql

import (
	"cmp"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"go.uber.org/goleak"

	"github.com/txoutbox/txoutbox/storage"
)

const defaultTestDSN = "root@tcp(127.0.0.1:3306)/test"

const startHint = "start it with: start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd"

func testDSN() string { return cmp.Or(os.Getenv("TEST_MYSQL_DSN"), defaultTestDSN) }

var (
	dbOnce sync.Once
	dbErr  error
	testDB *sql.DB
)

func TestMain(m *testing.M) {
	flag.Parse()
	// The kill test makes the driver log every broken connection.
	_ = mysql.SetLogger(log.New(io.Discard, "", 0))
	if err := probe(); err != nil && os.Getenv("CI") != "true" {
		// Tests skip on their own; examples cannot, so leave them out.
		fmt.Fprintf(os.Stderr, "MySQL not reachable at TEST_MYSQL_DSN (%v): tests skip and examples are not run; %s\n", err, startHint)
		if err := flag.Set("test.run", "^Test"); err != nil {
			panic(err)
		}
	}
	code := m.Run()
	if testDB != nil {
		testDB.Close()
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goroutines left running after the tests:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func probe() error {
	db, err := sql.Open("mysql", testDSN())
	if err != nil {
		return err
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	return db.PingContext(ctx)
}

// openDB returns the package's shared pool, skipping the test when no server
// answers (failing instead with CI=true).
func openDB(t testing.TB) *sql.DB {
	t.Helper()
	dbOnce.Do(func() {
		db, err := sql.Open("mysql", testDSN())
		if err != nil {
			dbErr = err
			return
		}
		db.SetMaxOpenConns(32)
		db.SetMaxIdleConns(32)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := db.PingContext(ctx); err != nil {
			db.Close()
			dbErr = err
			return
		}
		testDB = db
	})
	if dbErr != nil {
		msg := fmt.Sprintf("MySQL not reachable at TEST_MYSQL_DSN (%s): %v; %s", testDSN(), dbErr, startHint)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return testDB
}

// newTable returns a fresh table name, dropped when the test ends.
func newTable(t testing.TB, db *sql.DB) string {
	t.Helper()
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "txo_test_" + hex.EncodeToString(b[:])
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS `"+name+"`, `"+name+"_skipped`, `"+name+"_migrations`, `"+name+"_keys`, `"+name+"_inbox`"); err != nil {
			t.Errorf("drop table %s: %v", name, err)
		}
	})
	return name
}

// newStore returns a storage on a fresh table.
func newStore(t testing.TB, cfg Config) *Storage {
	t.Helper()
	db := openDB(t)
	cfg.Table = newTable(t, db)
	s, err := New(db, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if err := s.CreateSchema(t.Context()); err != nil {
		t.Fatalf("CreateSchema: %v", err)
	}
	return s
}

// insert commits records through a transaction and returns their ids: the
// ids of one multi-row INSERT are consecutive from LAST_INSERT_ID()
// (innodb_autoinc_lock_mode 1 or 2 with a single statement both keep them
// so for a simple insert).
func insert(t testing.TB, s *Storage, records ...storage.Record) []int64 {
	t.Helper()
	ctx := t.Context()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatalf("begin: %v", err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after commit
	if err := s.Insert(ctx, tx, records); err != nil {
		t.Fatalf("insert: %v", err)
	}
	var first int64
	if err := tx.QueryRowContext(ctx, "SELECT LAST_INSERT_ID()").Scan(&first); err != nil {
		t.Fatalf("last insert id: %v", err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatalf("commit: %v", err)
	}
	ids := make([]int64, len(records))
	for i := range ids {
		ids[i] = first + int64(i)
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

// inspect reads the stored state of one record.
func inspect(t testing.TB, s *Storage, id int64) rowState {
	t.Helper()
	var st rowState
	var status string
	var leasedUntil, dueAt sql.NullInt64
	var leased, dueLater bool
	err := s.db.QueryRowContext(t.Context(), "SELECT status, attempts, COALESCE(last_error, ''), COALESCE(leased_by, ''), "+
		micros("leased_until")+", "+micros("due_at")+", COALESCE(leased_until > UTC_TIMESTAMP(6), 0), due_at > UTC_TIMESTAMP(6) FROM "+s.table+" WHERE id = ?", id).
		Scan(&status, &st.Attempts, &st.LastError, &st.LeasedBy, &leasedUntil, &dueAt, &leased, &dueLater)
	if err != nil {
		t.Fatalf("inspect record %d: %v", id, err)
	}
	st.Status = storage.Status(status)
	if st.LeasedBy != "" && leasedUntil.Valid {
		st.LeasedUntil = fromMicros(leasedUntil.Int64)
	}
	// While leased, due_at is the lease's end; otherwise it is the retry time.
	if st.LeasedBy == "" && dueLater {
		st.DueAt = fromMicros(dueAt.Int64)
	}
	_ = leased
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

func idsOf(records []storage.Record) []int64 {
	out := make([]int64, len(records))
	for i, r := range records {
		out[i] = r.ID
	}
	return out
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
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
	if len(ids) == 0 {
		return
	}
	rows, err := s.db.QueryContext(context.Background(), "SELECT id, attempts FROM "+s.table+" WHERE id IN ("+idsText(ids)+")")
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
