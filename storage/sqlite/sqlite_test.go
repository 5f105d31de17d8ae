package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

func TestOpenSettings(t *testing.T) {
	t.Parallel()
	// A name with URI-special characters still names that file.
	path := filepath.Join(t.TempDir(), "odd name?#%.db")
	db, err := Open(path)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer func() { _ = db.Close() }()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("database file not created at %q: %v", path, err)
	}
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	for pragma, want := range map[string]string{"journal_mode": "wal", "busy_timeout": "5000", "synchronous": "1"} {
		var got string
		if err := conn.QueryRowContext(ctx, "PRAGMA "+pragma).Scan(&got); err != nil {
			t.Fatalf("PRAGMA %s: %v", pragma, err)
		}
		if got != want {
			t.Errorf("PRAGMA %s = %q, want %q", pragma, got, want)
		}
	}

	// _txlock=immediate: a second transaction cannot begin while one is
	// open, even before the first one wrote anything.
	tx1, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx1.Rollback() }()
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	tx2, err := db.BeginTx(short, nil)
	if err == nil {
		_ = tx2.Rollback()
		t.Fatal("second BEGIN succeeded while a transaction was open: not BEGIN IMMEDIATE")
	}
}

func TestOpenRejectsNonFiles(t *testing.T) {
	t.Parallel()
	for _, path := range []string{"", ":memory:", "file:x.db"} {
		if db, err := Open(path); err == nil {
			_ = db.Close()
			t.Errorf("Open(%q) succeeded, want an error", path)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	for _, table := range []string{"1outbox", "out-box", `out"box`, "out box", "sqlite_outbox", "SQLITE_x", strings.Repeat("a", 65), "main.outbox"} {
		_, err := New(&sql.DB{}, Config{Table: table})
		if !errors.Is(err, storage.ErrInvalidIdentifier) {
			t.Errorf("New(Table %q) error = %v, want ErrInvalidIdentifier", table, err)
		}
	}
	for _, table := range []string{"", "outbox", "_x", "Outbox_2", strings.Repeat("a", 64)} {
		if err := (Config{Table: table}).Validate(); err != nil {
			t.Errorf("Validate(Table %q) = %v, want nil", table, err)
		}
	}
	if err := (Config{VisibilityDelay: -time.Second}).Validate(); err == nil {
		t.Error("negative VisibilityDelay accepted")
	}
	if _, err := New(nil, Config{}); err == nil {
		t.Error("New(nil db) succeeded")
	}
	s := newStorage(&sql.DB{}, Config{}) // New's defaults, without New's look at the database
	if s.Table() != TableDefault || !s.StrictOrdering() {
		t.Errorf("defaults: table %q strict %v, want %q true", s.Table(), s.StrictOrdering(), TableDefault)
	}
}

func TestCreateSchemaIdempotentAndCustomTable(t *testing.T) {
	t.Parallel()
	db, _ := openTestDB(t)
	ctx := context.Background()
	for _, table := range []string{"events_outbox", "order"} { // "order" is a keyword: quoting matters
		s, err := New(db, Config{Table: table})
		if err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if err := s.CreateSchema(ctx); err != nil {
				t.Fatalf("CreateSchema(%s): %v", table, err)
			}
		}
		got := insert(t, s, rec("t", "k"))
		if recs := claim(t, s, 10, time.Minute, "w"); !slices.Equal(ids(recs), got) {
			t.Fatalf("table %s: claimed %v, want %v", table, ids(recs), got)
		}
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM sqlite_master WHERE type = 'index' AND tbl_name = 'events_outbox' AND sql IS NOT NULL`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 7 {
		t.Errorf("events_outbox has %d indexes, want 7", n)
	}
}

func TestInsertClaimAckRoundTrip(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{})
	clock := useFakeClock(s)
	want := []storage.Record{
		{UUID: "u1", Topic: "orders", Key: "o-1", Payload: []byte{0, 1, 2, 0xff}, Metadata: map[string]string{"a": "1", "ü": "✓"}},
		{UUID: "u2", Topic: "orders", Payload: nil},
		{UUID: "u3", Topic: "payments", Key: "o-2", Payload: []byte(`{"x":1}`), Metadata: map[string]string{}},
	}
	gotIDs := insert(t, s, want...)
	if !slices.IsSorted(gotIDs) {
		t.Fatalf("ids not ascending: %v", gotIDs)
	}
	recs := claim(t, s, 10, time.Minute, "w1")
	if len(recs) != 3 {
		t.Fatalf("claimed %d records, want 3", len(recs))
	}
	for i, r := range recs {
		w := want[i]
		if r.ID != gotIDs[i] || r.UUID != w.UUID || r.Topic != w.Topic || r.Key != w.Key || string(r.Payload) != string(w.Payload) {
			t.Errorf("record %d = %+v, want %+v", i, r, w)
		}
		if len(r.Metadata) != len(w.Metadata) {
			t.Errorf("record %d metadata = %v, want %v", i, r.Metadata, w.Metadata)
		}
		for k, v := range w.Metadata {
			if r.Metadata[k] != v {
				t.Errorf("record %d metadata[%q] = %q, want %q", i, k, r.Metadata[k], v)
			}
		}
		if r.Attempts != 1 || r.DecodeError != nil || !r.CreatedAt.Equal(clock.Now()) {
			t.Errorf("record %d: attempts %d, decode error %v, created %v", i, r.Attempts, r.DecodeError, r.CreatedAt)
		}
		st := inspect(t, s, r.ID)
		if st.LeasedBy != "w1" || !st.LeasedUntil.Equal(clock.Now().Add(time.Minute)) {
			t.Errorf("record %d state %+v, want leased by w1 for 1m", i, st)
		}
	}
	if again := claim(t, s, 10, time.Minute, "w2"); len(again) != 0 {
		t.Fatalf("leased records claimed again: %v", ids(again))
	}
	if err := s.Ack(context.Background(), storage.AckParams{Records: liveRefs(t, s, gotIDs...), WorkerID: "w1"}); err != nil {
		t.Fatal(err)
	}
	clock.Add(time.Hour) // leases long expired: delivered records stay delivered
	if again := claim(t, s, 10, time.Minute, "w2"); len(again) != 0 {
		t.Fatalf("delivered records claimed again: %v", ids(again))
	}
	for _, id := range gotIDs {
		if st := inspect(t, s, id); st.Status != storage.StatusDelivered || st.LeasedBy != "" {
			t.Errorf("record %d after ack: %+v", id, st)
		}
	}
}

func TestInsertValidation(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{})
	ctx := context.Background()
	good := rec("t", "")
	for name, bad := range map[string]storage.Record{
		"empty topic":           {UUID: "u", Payload: []byte("x")},
		"topic not utf8":        {UUID: "u", Topic: "t\xff"},
		"key not utf8":          {UUID: "u", Topic: "t", Key: "\xc3"},
		"uuid not utf8":         {UUID: "\xff", Topic: "t"},
		"metadata value":        {UUID: "u", Topic: "t", Metadata: map[string]string{"k": "\xff"}},
		"metadata key":          {UUID: "u", Topic: "t", Metadata: map[string]string{"\xfe": "v"}},
		"empty topic, metadata": {UUID: "u", Topic: "", Metadata: map[string]string{"k": "v"}},
	} {
		tx, err := s.db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		err = s.Insert(ctx, tx, []storage.Record{good, bad})
		if !errors.Is(err, storage.ErrInvalidRecord) {
			t.Errorf("%s: Insert error = %v, want ErrInvalidRecord", name, err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
	}
	if st, err := s.Stats(ctx); err != nil || st.Pending != 0 {
		t.Fatalf("after rejected inserts: stats %+v, %v; want nothing written", st, err)
	}

	for _, tx := range []any{nil, (*sql.Tx)(nil), s.db, "tx"} {
		if err := s.Insert(ctx, tx, []storage.Record{good}); !errors.Is(err, storage.ErrUnsupportedTx) {
			t.Errorf("Insert(tx %T) error = %v, want ErrUnsupportedTx", tx, err)
		}
	}
}

func TestInsertLargeBatchKeepsOrder(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{})
	records := make([]storage.Record, 2*insertChunk+17)
	for i := range records {
		records[i] = storage.Record{UUID: fmt.Sprint(i), Topic: "t", Key: fmt.Sprint(i % 7), Payload: []byte(fmt.Sprint(i))}
	}
	insert(t, s, records...)
	var got []storage.Record
	for {
		recs := claim(t, s, 500, time.Minute, "w")
		if len(recs) == 0 {
			break
		}
		got = append(got, recs...)
		if err := s.Ack(context.Background(), storage.AckParams{Records: storage.Refs(recs), WorkerID: "w"}); err != nil {
			t.Fatal(err)
		}
	}
	if len(got) != len(records) {
		t.Fatalf("claimed %d records, want %d", len(got), len(records))
	}
	for i, r := range got {
		if r.UUID != fmt.Sprint(i) || (i > 0 && r.ID <= got[i-1].ID) {
			t.Fatalf("record %d: uuid %s id %d, out of insertion order", i, r.UUID, r.ID)
		}
	}
}

func TestLeaseExpiryAndFencing(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{})
	clock := useFakeClock(s)
	ctx := context.Background()
	id := insert(t, s, rec("t", "k"))[0]

	if r := claim(t, s, 1, time.Minute, "w1"); len(r) != 1 || r[0].Attempts != 1 {
		t.Fatalf("first claim: %+v", r)
	}
	clock.Add(time.Minute - time.Nanosecond)
	if r := claim(t, s, 1, time.Minute, "w2"); len(r) != 0 {
		t.Fatal("claimed before the lease expired")
	}
	clock.Add(time.Nanosecond)
	r := claim(t, s, 1, time.Minute, "w2")
	if len(r) != 1 || r[0].Attempts != 2 {
		t.Fatalf("claim after expiry: %+v, want the record with attempts 2", r)
	}

	// w1 lost its lease: every write-back of w1 is ignored.
	if err := s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, id), WorkerID: "w1"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Nack(ctx, storage.NackParams{Record: liveRef(t, s, id), WorkerID: "w1", Error: "boom", RetryAt: clock.Now().Add(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, storage.ReleaseParams{Records: liveRefs(t, s, id), WorkerID: "w1"}); err != nil {
		t.Fatal(err)
	}
	if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: liveRef(t, s, id), WorkerID: "w1", Error: "x"}); err != nil {
		t.Fatal(err)
	}
	// Empty worker ids and unknown ids are ignored too.
	if err := s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, id, 9999), WorkerID: ""}); err != nil {
		t.Fatal(err)
	}
	st := inspect(t, s, id)
	if st.Status != storage.StatusPending || st.LeasedBy != "w2" || st.Attempts != 2 || st.LastError != "" {
		t.Fatalf("fenced write-backs changed the record: %+v", st)
	}
	if err := s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, id, 9999), WorkerID: "w2"}); err != nil {
		t.Fatal(err)
	}
	if st := inspect(t, s, id); st.Status != storage.StatusDelivered {
		t.Fatalf("ack by the lease holder: %+v", st)
	}
}

func TestNackReleaseDeadLetterRedrive(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{DisableStrictOrdering: true})
	clock := useFakeClock(s)
	ctx := context.Background()
	ids3 := insert(t, s, rec("a", "k"), rec("a", "k"), rec("b", ""))
	claimed := claim(t, s, 3, time.Minute, "w")
	if len(claimed) != 3 {
		t.Fatalf("claimed %d, want 3", len(claimed))
	}
	retryAt := clock.Now().Add(10*time.Second + 123) // odd nanoseconds survive
	if err := s.Nack(ctx, storage.NackParams{Record: liveRef(t, s, ids3[0]), WorkerID: "w", Error: "broker down", RetryAt: retryAt}); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, storage.ReleaseParams{Records: liveRefs(t, s, ids3[1:2]...), WorkerID: "w", RetryAt: retryAt}); err != nil {
		t.Fatal(err)
	}
	if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: liveRef(t, s, ids3[2]), WorkerID: "w", Error: "poison"}); err != nil {
		t.Fatal(err)
	}
	if st := inspect(t, s, ids3[0]); st.Status != storage.StatusPending || st.Attempts != 1 || st.LastError != "broker down" || st.LeasedBy != "" || !st.DueAt.Equal(retryAt) {
		t.Errorf("after nack: %+v", st)
	}
	if st := inspect(t, s, ids3[1]); st.Status != storage.StatusPending || st.Attempts != 0 || st.LastError != "" || st.LeasedBy != "" || !st.DueAt.Equal(retryAt) {
		t.Errorf("after release: %+v", st)
	}
	if st := inspect(t, s, ids3[2]); st.Status != storage.StatusDead || st.LastError != "poison" || st.LeasedBy != "" {
		t.Errorf("after dead-letter: %+v", st)
	}
	if r := claim(t, s, 10, time.Minute, "w"); len(r) != 0 {
		t.Fatalf("claimed %v before retryAt", ids(r))
	}
	clock.Add(10*time.Second + 123)
	r := claim(t, s, 10, time.Minute, "w")
	if !slices.Equal(ids(r), ids3[:2]) || r[0].Attempts != 2 || r[1].Attempts != 1 {
		t.Fatalf("claim at retryAt: %+v, want first two with attempts 2 and 1", r)
	}

	if _, err := s.Redrive(ctx, storage.RedriveParams{}); err == nil {
		t.Error("Redrive with neither IDs nor Topic succeeded")
	}
	if _, err := s.Redrive(ctx, storage.RedriveParams{IDs: []int64{1}, Topic: "b"}); err == nil {
		t.Error("Redrive with both IDs and Topic succeeded")
	}
	n, err := s.Redrive(ctx, storage.RedriveParams{IDs: ids3}) // only the dead one changes
	if err != nil || n != 1 {
		t.Fatalf("Redrive(ids) = %d, %v; want 1", n, err)
	}
	if st := inspect(t, s, ids3[2]); st.Status != storage.StatusPending || st.Attempts != 0 || st.LastError != "" {
		t.Errorf("after redrive: %+v", st)
	}
	r = claim(t, s, 10, time.Minute, "w2")
	if !slices.Equal(ids(r), ids3[2:]) || r[0].Attempts != 1 {
		t.Fatalf("claim after redrive: %+v", r)
	}
	if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: liveRef(t, s, ids3[2]), WorkerID: "w2", Error: "again"}); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Redrive(ctx, storage.RedriveParams{Topic: "a"}); err != nil || n != 0 {
		t.Fatalf("Redrive(topic a) = %d, %v; want 0", n, err)
	}
	if n, err := s.Redrive(ctx, storage.RedriveParams{Topic: "b"}); err != nil || n != 1 {
		t.Fatalf("Redrive(topic b) = %d, %v; want 1", n, err)
	}
}

func TestStrictOrdering(t *testing.T) {
	t.Parallel()
	for _, strict := range []bool{true, false} {
		t.Run(fmt.Sprintf("strict=%v", strict), func(t *testing.T) {
			t.Parallel()
			s := newTestStorage(t, Config{DisableStrictOrdering: !strict})
			clock := useFakeClock(s)
			ctx := context.Background()
			// a1 a2 b1 free1 a3
			id := insert(t, s, rec("t", "a"), rec("t", "a"), rec("t", "b"), rec("t", ""), rec("t", "a"))
			if r := claim(t, s, 1, time.Minute, "w1"); !slices.Equal(ids(r), id[:1]) {
				t.Fatalf("w1 claimed %v, want %v", ids(r), id[:1])
			}
			want := []int64{id[1], id[2], id[3], id[4]}
			if strict {
				want = []int64{id[2], id[3]} // a2, a3 wait for leased a1
			}
			r := claim(t, s, 10, time.Minute, "w2")
			if !slices.Equal(ids(r), want) {
				t.Fatalf("w2 claimed %v, want %v", ids(r), want)
			}
			if !strict {
				return
			}
			// a1 fails and waits for its retry: a2 and a3 still wait.
			if err := s.Nack(ctx, storage.NackParams{Record: liveRef(t, s, id[0]), WorkerID: "w1", Error: "e", RetryAt: clock.Now().Add(time.Second)}); err != nil {
				t.Fatal(err)
			}
			if r := claim(t, s, 10, time.Minute, "w3"); len(r) != 0 {
				t.Fatalf("w3 claimed %v while a1 waits for its retry", ids(r))
			}
			// Once due, a1 comes first and a2, a3 with it, in id order.
			clock.Add(time.Second)
			if r := claim(t, s, 10, time.Minute, "w3"); !slices.Equal(ids(r), []int64{id[0], id[1], id[4]}) {
				t.Fatalf("w3 claimed %v, want a1 a2 a3", ids(r))
			}
			// A dead-lettered head no longer holds its key back.
			if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: liveRef(t, s, id[0]), WorkerID: "w3", Error: "dead"}); err != nil {
				t.Fatal(err)
			}
			if err := s.Release(ctx, storage.ReleaseParams{Records: liveRefs(t, s, id[1], id[4]), WorkerID: "w3"}); err != nil {
				t.Fatal(err)
			}
			if r := claim(t, s, 10, time.Minute, "w4"); !slices.Equal(ids(r), []int64{id[1], id[4]}) {
				t.Fatalf("w4 claimed %v, want a2 a3", ids(r))
			}
		})
	}
}

func TestDecodeErrorDoesNotFailClaim(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{})
	id := insert(t, s, rec("t", "k"), rec("t", "k"))
	if _, err := s.db.Exec(`UPDATE outbox SET metadata = '{not json' WHERE id = ?`, id[0]); err != nil {
		t.Fatal(err)
	}
	r := claim(t, s, 10, time.Minute, "w")
	if len(r) != 2 {
		t.Fatalf("claimed %d records, want 2", len(r))
	}
	if r[0].DecodeError == nil || r[0].Metadata != nil {
		t.Errorf("corrupt record: DecodeError %v, Metadata %v", r[0].DecodeError, r[0].Metadata)
	}
	if r[1].DecodeError != nil {
		t.Errorf("healthy record: DecodeError %v", r[1].DecodeError)
	}
}

func TestVisibilityDelay(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{VisibilityDelay: time.Second})
	clock := useFakeClock(s)
	insert(t, s, rec("t", ""))
	if r := claim(t, s, 10, time.Minute, "w"); len(r) != 0 {
		t.Fatal("claimed a record younger than the visibility delay")
	}
	clock.Add(time.Second)
	if r := claim(t, s, 10, time.Minute, "w"); len(r) != 1 {
		t.Fatalf("claimed %d records after the visibility delay, want 1", len(r))
	}
}

func TestStatsAndPurge(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{DisableStrictOrdering: true})
	clock := useFakeClock(s)
	ctx := context.Background()
	if st, err := s.Stats(ctx); err != nil || st != (storage.Stats{}) {
		t.Fatalf("empty table stats %+v, %v", st, err)
	}
	n := PurgeBatchSize*2 + 5
	records := make([]storage.Record, n)
	for i := range records {
		records[i] = rec("t", "")
	}
	all := insert(t, s, records...)
	clock.Add(time.Minute)
	claimed := claim(t, s, n-3, time.Minute, "w") // 3 stay unclaimed
	if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: claimed[0].Ref(), WorkerID: "w", Error: "x"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Ack(ctx, storage.AckParams{Records: storage.Refs(claimed[2:]), WorkerID: "w"}); err != nil { // claimed[1] stays leased
		t.Fatal(err)
	}
	st, err := s.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := storage.Stats{Pending: 4, Leased: 1, Delivered: int64(n - 5), Dead: 1, OldestPendingAge: time.Minute, Forwarders: 1}
	if st != want {
		t.Fatalf("stats %+v, want %+v", st, want)
	}

	clock.Add(time.Hour)
	if got, err := s.Purge(ctx, 2*time.Hour); err != nil || got != 0 {
		t.Fatalf("Purge(2h) = %d, %v; want 0", got, err)
	}
	got, err := s.Purge(ctx, time.Hour-time.Nanosecond)
	if err != nil || got != int64(n-5) {
		t.Fatalf("Purge = %d, %v; want %d", got, err, n-5)
	}
	if st, _ := s.Stats(ctx); st.Delivered != 0 || st.Pending != 4 || st.Dead != 1 {
		t.Fatalf("stats after purge %+v", st)
	}
	// AUTOINCREMENT: ids are never reused, even after the newest rows are gone.
	if _, err := s.db.Exec(`DELETE FROM outbox`); err != nil {
		t.Fatal(err)
	}
	if next := insert(t, s, rec("t", ""))[0]; next <= all[len(all)-1] {
		t.Fatalf("id %d reused (last was %d)", next, all[len(all)-1])
	}
}

func TestClaimValidatesParams(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{})
	for _, p := range []storage.ClaimParams{
		{BatchSize: 0, Lease: time.Second, WorkerID: "w"},
		{BatchSize: 1, Lease: 0, WorkerID: "w"},
		{BatchSize: 1, Lease: time.Second},
	} {
		if _, err := s.Claim(context.Background(), p); err == nil {
			t.Errorf("Claim(%+v) succeeded", p)
		}
	}
}

// A claim that finds nothing to claim does not wait for the write lock: an
// idle relay's polls never hold up the application's writers, which SQLite's
// unfair lock would otherwise starve.
func TestEmptyClaimTakesNoWriteLock(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{})
	insert(t, s, rec("t", ""))
	if r := claim(t, s, 1, time.Minute, "w"); len(r) != 1 {
		t.Fatalf("first claim: %d records, want 1", len(r))
	}
	// Another connection holds the write lock; the only record is leased.
	tx, err := s.db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 1, Lease: time.Second, WorkerID: "w2"})
	if err != nil {
		t.Fatalf("claim with nothing claimable waited for the write lock: %v", err)
	}
	if len(r) != 0 {
		t.Fatalf("claim handed out %d records while the only one is leased", len(r))
	}
}

// Outside WAL mode a read waits for a writer too. A claim whose look for
// claimable records is refused (no busy timeout here) claims as it did
// before the look: it waits for the lock, retrying, until its context ends.
func TestClaimWaitsWhenItsLookIsRefused(t *testing.T) {
	t.Parallel()
	db, err := sql.Open(DriverName, "file:"+filepath.Join(t.TempDir(), "rollback.db")+"?_pragma=journal_mode(DELETE)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	// New refuses such a database; another process may still have switched
	// the file out of WAL mode under a running storage.
	s := newStorage(db, Config{})
	ctx := context.Background()
	if err := s.CreateSchema(ctx); err != nil {
		t.Fatal(err)
	}
	insert(t, s, rec("t", ""))
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	if _, err := conn.ExecContext(ctx, "BEGIN EXCLUSIVE"); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(300 * time.Millisecond)
		_, _ = conn.ExecContext(ctx, "COMMIT")
	}()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	r, err := s.Claim(cctx, storage.ClaimParams{BatchSize: 1, Lease: time.Minute, WorkerID: "w"})
	if err != nil {
		t.Fatalf("claim while another connection held the lock: %v", err)
	}
	if len(r) != 1 {
		t.Fatalf("claim returned %d records, want 1", len(r))
	}
}

func TestClaimHonoursContext(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{})
	insert(t, s, rec("t", ""))
	// Another connection holds the write lock: the claim waits, then gives
	// up when its context ends instead of waiting the full busy timeout.
	tx, err := s.db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = s.Claim(ctx, storage.ClaimParams{BatchSize: 1, Lease: time.Second, WorkerID: "w"})
	if err == nil {
		t.Fatal("claim succeeded while another transaction held the write lock")
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("claim gave up after %s, want about 100ms", d)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if r := claim(t, s, 1, time.Second, "w"); len(r) != 1 {
		t.Fatalf("claim after the lock was freed: %d records", len(r))
	}
}
