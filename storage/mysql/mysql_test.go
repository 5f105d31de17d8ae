package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

func TestConfigRefusesBadIdentifiers(t *testing.T) {
	t.Parallel()
	db := &sql.DB{} // never used: New does not touch the database
	for _, name := range []string{
		"out box", "outbox`; DROP TABLE x; --", "a.b.c", "1outbox", "out-box", "`outbox`", "outbox;", ".outbox", "outbox.",
		strings.Repeat("x", 65), "é",
		// The version table appends "_migrations" (11 bytes) to the name.
		strings.Repeat("x", 54), "app." + strings.Repeat("x", 54),
	} {
		if _, err := New(db, Config{Table: name}); !errors.Is(err, storage.ErrInvalidIdentifier) {
			t.Errorf("New(Table %q) = %v, want an error wrapping ErrInvalidIdentifier", name, err)
		}
	}
	for _, name := range []string{"outbox", "app.outbox", "Out_Box_2", strings.Repeat("x", 53), strings.Repeat("d", 64) + ".outbox"} {
		s, err := New(db, Config{Table: name})
		if err != nil {
			t.Errorf("New(Table %q) = %v, want ok", name, err)
			continue
		}
		if !strings.HasPrefix(s.Table(), "`") {
			t.Errorf("Table() = %s, want it quoted with backticks", s.Table())
		}
	}
	if _, err := New(nil, Config{}); err == nil {
		t.Error("New(nil) returned no error")
	}
	for _, c := range []Config{{VisibilityDelay: -1}, {WalkFactor: -1}, {WalkFactor: 17}, {HoldOnDeadLetter: true, DisableStrictOrdering: true}} {
		if _, err := New(db, c); err == nil {
			t.Errorf("New(%+v) returned no error", c)
		}
	}
}

func TestQualifiedTable(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	name := newTable(t, db)
	var current string
	must(t, db.QueryRowContext(t.Context(), "SELECT DATABASE()").Scan(&current))
	s, err := New(db, Config{Table: current + "." + name})
	must(t, err)
	must(t, s.CreateSchema(t.Context()))
	ids := insert(t, s, recs("k")...)
	if got := claim(t, s, "w", 10, time.Minute); !slices.Equal(idsOf(got), ids) {
		t.Fatalf("claimed %v, want %v", idsOf(got), ids)
	}
}

// TestCreateSchemaConcurrently starts eight CreateSchema calls on one table
// at once: all succeed.
func TestCreateSchemaConcurrently(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	name := newTable(t, db)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			s, err := New(db, Config{Table: name})
			if err == nil {
				err = s.CreateSchema(t.Context())
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}

func TestInsertRefuses(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	ctx := t.Context()
	if err := s.Insert(ctx, "not a tx", recs("k")); !errors.Is(err, storage.ErrUnsupportedTx) {
		t.Errorf("Insert(string) = %v, want ErrUnsupportedTx", err)
	}
	if err := s.Insert(ctx, (*sql.Tx)(nil), recs("k")); !errors.Is(err, storage.ErrUnsupportedTx) {
		t.Errorf("Insert(nil *sql.Tx) = %v, want ErrUnsupportedTx", err)
	}
	for name, r := range map[string]storage.Record{
		"empty topic":           {UUID: "u", Topic: ""},
		"invalid topic":         {UUID: "u", Topic: "\xff"},
		"invalid key":           {UUID: "u", Topic: "t", Key: "\xfe"},
		"long key":              {UUID: "u", Topic: "t", Key: strings.Repeat("k", 256)},
		"long uuid":             {UUID: strings.Repeat("u", 256), Topic: "t"},
		"key ending in a space": {UUID: "u", Topic: "t", Key: "a "},
		"invalid metadata":      {UUID: "u", Topic: "t", Metadata: map[string]string{"a": "\xff"}},
	} {
		tx, err := s.db.BeginTx(ctx, nil)
		must(t, err)
		err = s.Insert(ctx, tx, []storage.Record{rec("ok"), r})
		if !errors.Is(err, storage.ErrInvalidRecord) {
			t.Errorf("%s: Insert = %v, want ErrInvalidRecord", name, err)
		}
		must(t, tx.Commit())
	}
	st, err := s.Stats(ctx)
	must(t, err)
	if st.Pending != 0 {
		t.Errorf("%d rows written by refused inserts, want 0", st.Pending)
	}
}

// TestRoundTrip checks what a claim returns: payloads (nil, empty, binary),
// metadata (nil, empty, unicode), keys that differ only in case, 4-byte
// characters.
func TestRoundTrip(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	in := []storage.Record{
		{UUID: "u1", Topic: "t", Key: "Key", Payload: nil},
		{UUID: "u2", Topic: "t", Key: "key", Payload: []byte{}, Metadata: map[string]string{}},
		{UUID: "u3", Topic: "tópico 🚀", Key: "🔑", Payload: []byte{0, 1, 2, 0xff, '\''}, Metadata: map[string]string{"a": "b\x00c", "ü": "'`\\"}},
	}
	before := time.Now()
	insert(t, s, in...)
	got := claim(t, s, "w", 10, time.Minute)
	if len(got) != len(in) {
		t.Fatalf("claimed %d records, want %d", len(got), len(in))
	}
	for i, r := range got {
		w := in[i]
		if r.UUID != w.UUID || r.Topic != w.Topic || r.Key != w.Key || string(r.Payload) != string(w.Payload) ||
			(r.Payload == nil) != (w.Payload == nil) || fmt.Sprint(r.Metadata) != fmt.Sprint(w.Metadata) ||
			(r.Metadata == nil) != (w.Metadata == nil) || r.Attempts != 1 || r.DecodeError != nil {
			t.Errorf("record %d: got %+v, want %+v", i, r, w)
		}
		if d := r.CreatedAt.Sub(before); d < -5*time.Second || d > 5*time.Second {
			t.Errorf("record %d: CreatedAt %v, inserted at about %v", i, r.CreatedAt, before)
		}
	}
}

func TestCorruptMetadataIsReported(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	id := insert(t, s, rec("k"))[0]
	// JSON but not a map of strings.
	must(t, exec(t, s, fmt.Sprintf("UPDATE %s SET metadata = '[1,2]' WHERE id = %d", s.table, id)))
	got := claim(t, s, "w", 10, time.Minute)
	if len(got) != 1 || got[0].DecodeError == nil {
		t.Fatalf("claim = %+v, want the record with a DecodeError", got)
	}
}

// parkedIDs returns the parked rows.
func parkedIDs(t testing.TB, s *Storage) []int64 {
	t.Helper()
	ids, err := queryIDsDB(t, s, "SELECT id FROM "+s.table+" WHERE parked = 1 ORDER BY id")
	must(t, err)
	return ids
}

func queryIDsDB(t testing.TB, s *Storage, q string) ([]int64, error) {
	tx, err := s.db.BeginTx(t.Context(), nil)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback() //nolint:errcheck // read only
	return queryIDs(t.Context(), tx, q)
}

// TestParking follows one key through parking and promotion: rows behind a
// leased head are parked by the next claim and left out of later walks; the
// head's ack unparks the next row, which is then claimed with its
// followers; a dead-letter promotes too; nack and release do not change
// parking.
func TestParking(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	ctx := t.Context()
	ids := insert(t, s, recs("k", "k", "k", "k", "k", "k")...)
	if got := claim(t, s, "w1", 1, time.Minute); !slices.Equal(idsOf(got), ids[:1]) {
		t.Fatalf("first claim %v, want %v", idsOf(got), ids[:1])
	}
	// The rows behind the leased head get parked, not claimed.
	if got := claim(t, s, "w2", 10, time.Minute); len(got) != 0 {
		t.Fatalf("claim behind a leased head returned %v", idsOf(got))
	}
	if p := parkedIDs(t, s); !slices.Equal(p, ids[1:]) {
		t.Fatalf("parked %v, want %v", p, ids[1:])
	}
	// A keyless record inserted later is claimed at once: parked rows are
	// not walked.
	free := insert(t, s, rec(""))[0]
	if got := claim(t, s, "w2", 10, time.Minute); !slices.Equal(idsOf(got), []int64{free}) {
		t.Fatalf("claim = %v, want only the keyless %d", idsOf(got), free)
	}
	// Ack of the head unparks the next row; a claim takes it with its
	// followers (parked ones included), a prefix of the key.
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[:1]...), WorkerID: "w1"}))
	if p := parkedIDs(t, s); !slices.Equal(p, ids[2:]) {
		t.Fatalf("after ack parked %v, want %v", p, ids[2:])
	}
	got := claim(t, s, "w3", 3, time.Minute)
	if !slices.Equal(idsOf(got), ids[1:4]) {
		t.Fatalf("claim after promotion = %v, want %v", idsOf(got), ids[1:4])
	}
	// Nack of the head, release of its followers (unparked when leased):
	// the key waits for the head's retry and the next claim parks them
	// again.
	must(t, s.Nack(ctx, storage.NackParams{Record: liveRef(t, s, ids[1]), WorkerID: "w3", Error: "boom", RetryAt: time.Now().Add(time.Hour)}))
	must(t, s.Release(ctx, storage.ReleaseParams{Records: liveRefs(t, s, ids[2:4]...), WorkerID: "w3", RetryAt: time.Now()}))
	if got := claim(t, s, "w4", 10, time.Minute); len(got) != 0 {
		t.Fatalf("claim while the head waits for its retry = %v", idsOf(got))
	}
	if p := parkedIDs(t, s); !slices.Equal(p, ids[2:]) {
		t.Fatalf("after nack and release parked %v, want %v", p, ids[2:])
	}
	// Make the head due, claim it alone and dead-letter it: the next row is
	// promoted and claimable.
	must(t, exec(t, s, fmt.Sprintf("UPDATE %s SET due_at = UTC_TIMESTAMP(6) WHERE id = %d", s.table, ids[1])))
	if got := claim(t, s, "w4", 1, time.Minute); !slices.Equal(idsOf(got), ids[1:2]) {
		t.Fatalf("claim of the due head = %v, want %v", idsOf(got), ids[1:2])
	}
	must(t, s.DeadLetter(ctx, storage.DeadLetterParams{Record: liveRef(t, s, ids[1]), WorkerID: "w4", Error: "poison"}))
	if got := claim(t, s, "w5", 10, time.Minute); !slices.Equal(idsOf(got), ids[2:]) {
		t.Fatalf("claim after dead-letter = %v, want %v", idsOf(got), ids[2:])
	}
	// Redrive un-parks and the re-driven row is claimable.
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[2:]...), WorkerID: "w5"}))
	n, err := s.Redrive(ctx, storage.RedriveParams{IDs: ids[1:2]})
	must(t, err)
	if n != 1 {
		t.Fatalf("Redrive changed %d rows, want 1", n)
	}
	if got := claim(t, s, "w6", 10, time.Minute); !slices.Equal(idsOf(got), ids[1:2]) {
		t.Fatalf("claim after redrive = %v, want %v", idsOf(got), ids[1:2])
	}
}

// backlogBehindRetry inserts behind+1 records of key "hot" and nacks the
// first for a retry an hour later, so that the rest are held back behind it
// (not parked yet); it returns their ids.
func backlogBehindRetry(t *testing.T, s *Storage, behind int) []int64 {
	t.Helper()
	keys := make([]string, behind+1)
	for i := range keys {
		keys[i] = "hot"
	}
	ids := insert(t, s, recs(keys...)...)
	head := claim(t, s, "w", 1, time.Minute)
	must(t, s.Nack(t.Context(), storage.NackParams{Record: head[0].Ref(), WorkerID: "w", Error: "later", RetryAt: time.Now().Add(time.Hour)}))
	return ids
}

// TestHeldBackRowsNotWalked: with one key's head waiting for a retry and
// thousands of rows behind it, claims of other keys cost the same as with
// nothing held back, once the rows behind are parked.
func TestHeldBackRowsNotWalked(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	const behind = 5000
	ids := backlogBehindRetry(t, s, behind)
	// Claims park the rows behind, at most 16 batches per claim.
	for range 200 {
		if got := claim(t, s, "w", 100, time.Minute); len(got) != 0 {
			t.Fatalf("claim returned %v behind a head waiting for its retry", idsOf(got))
		}
		if len(parkedIDs(t, s)) == behind {
			break
		}
	}
	if p := parkedIDs(t, s); len(p) != behind || p[0] != ids[1] {
		t.Fatalf("%d rows parked, want %d", len(p), behind)
	}
	// The sweep leaves them parked: each is behind the head.
	sweepStart := time.Now()
	must(t, s.sweep(t.Context()))
	t.Logf("sweep of %d parked rows: %v", behind, time.Since(sweepStart))
	if p := parkedIDs(t, s); len(p) != behind {
		t.Fatalf("%d rows parked after the sweep, want %d", len(p), behind)
	}
	others := make([]string, 100)
	for i := range others {
		others[i] = fmt.Sprint("k", i)
	}
	insert(t, s, recs(others...)...)
	start := time.Now()
	got := claim(t, s, "w", 100, time.Minute)
	took := time.Since(start)
	if len(got) != 100 {
		t.Fatalf("claimed %d of the 100 other keys' records", len(got))
	}
	t.Logf("claim of 100 with %d rows held back: %v", behind, took)
}

// TestClaimWalksPastABacklogItParks: a claim whose walk finds only rows
// to park (a key's backlog behind a head waiting for its retry, not parked
// yet) walks on and returns the other keys' rows behind that backlog rather
// than nothing; with one walk a batch it came back empty ten times in a row.
func TestClaimWalksPastABacklogItParks(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	const behind = 1000
	backlogBehindRetry(t, s, behind)
	others := make([]string, 200)
	for i := range others {
		others[i] = fmt.Sprint("k", i)
	}
	want := insert(t, s, recs(others...)...)
	got := claim(t, s, "w", 100, time.Minute)
	if len(got) != 100 || got[0].ID != want[0] {
		t.Fatalf("claim of 100 returned %d records (first %v), want the other keys' first 100 from id %d", len(got), idsOf(got)[:min(len(got), 1)], want[0])
	}
	if p := parkedIDs(t, s); len(p) != behind {
		t.Fatalf("%d rows parked, want the %d behind the head", len(p), behind)
	}
}

// TestKeysCompareExactly: keys differing in case or accents are different
// keys (utf8mb4_bin). Trailing spaces: TestKeysTrailingSpace.
func TestKeysCompareExactly(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	ids := insert(t, s, recs("a", "A", " a", "á")...)
	if got := claim(t, s, "w", 10, time.Minute); !slices.Equal(idsOf(got), ids) {
		t.Fatalf("claim = %v, want all of %v (four different keys)", idsOf(got), ids)
	}
}

func TestDeleteOnAck(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{DeleteOnAck: true})
	ctx := t.Context()
	ids := insert(t, s, recs("a", "a", "", "")...)
	got := claim(t, s, "w", 10, time.Minute)
	if len(got) != 4 {
		t.Fatalf("claimed %v, want all 4", idsOf(got))
	}
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[:2]...), WorkerID: "other"}))
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[:2]...), WorkerID: "w"}))
	must(t, s.DeadLetter(ctx, storage.DeadLetterParams{Record: liveRef(t, s, ids[2]), WorkerID: "w", Error: "boom"}))
	left, err := queryIDsDB(t, s, "SELECT id FROM "+s.table+" ORDER BY id")
	must(t, err)
	if !slices.Equal(left, ids[2:]) {
		t.Fatalf("rows left %v, want %v (acked rows deleted, dead and unacked kept)", left, ids[2:])
	}
	st, err := s.Stats(ctx)
	must(t, err)
	if st.Delivered != 0 || st.Pending != 1 || st.Dead != 1 || st.Leased != 1 {
		t.Errorf("Stats = %+v, want 1 pending (leased), 1 dead, 0 delivered", st)
	}
}

func TestPurgeInBatches(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{DisableStrictOrdering: true})
	ctx := t.Context()
	n := PurgeBatchSize + 250
	insert(t, s, recs(make([]string, n)...)...)
	var acked int
	for acked < n {
		got := claim(t, s, "w", 1000, time.Minute)
		must(t, s.Ack(ctx, storage.AckParams{Records: storage.Refs(got), WorkerID: "w"}))
		acked += len(got)
	}
	if got, err := s.Purge(ctx, time.Hour); err != nil || got != 0 {
		t.Fatalf("Purge(1h) = %d, %v; want 0 (all delivered just now)", got, err)
	}
	got, err := s.Purge(ctx, 0)
	must(t, err)
	if got != int64(n) {
		t.Fatalf("Purge(0) = %d, want %d", got, n)
	}
}

// TestConcurrentClaimersAndWriters runs many claimers with short leases over
// a few hot keys; each publishes its claim in id order, then acks, nacks,
// releases, extends or just lets the lease run out, at random. Every record
// must end delivered or dead (no row stuck parked), the first publishes of
// each key must follow id order, and no operation may fail (a deadlock is
// retried inside the storage).
func TestConcurrentClaimersAndWriters(t *testing.T) {
	t.Parallel()
	all, claims := stressClaimersAndWriters(t, 30*time.Millisecond, true, 8)
	t.Logf("InnoDB deadlocks, each retried: %d, claims among them: %d", all, claims)
}

// TestClaimDeadlocks runs rounds of 32 claims at once under -race over a few
// hot keys (so that claims take followers and park rows), with leases that
// do not run out; after each round the claimed rows are acked, also at once.
// While claims run only claims run, so a deadlock a claim reports (error
// 1213) is between two claims. No claim may fail: Claim runs a deadlock
// victim again at once, and counts it. Every record must be delivered once.
// Claims used to keep the lock of a claim_idx entry their walk skipped, and
// deadlocked on it in their lease UPDATEs; they no longer lock claim_idx, but
// MariaDB 10.11 was seen with both deadlocked claims in FOR UPDATE SKIP
// LOCKED reads by primary key, each waiting for a row the other held (the
// package documentation, Locks and deadlocks): a few per run remain.
func TestClaimDeadlocks(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	const (
		records  = 6000
		claimers = 32
	)
	keysOf := make([]string, records)
	for i := range keysOf {
		if i%5 != 0 { // every fifth keyless
			keysOf[i] = fmt.Sprint("k", rand.IntN(8))
		}
	}
	for start := 0; start < records; start += 1000 {
		insert(t, s, recs(keysOf[start:start+1000]...)...)
	}
	claimed := make([][]storage.ClaimRef, claimers)
	errs := make([]error, claimers)
	acked := 0
	for acked < records && ctx.Err() == nil {
		var wg sync.WaitGroup
		for w := range claimers {
			wg.Go(func() {
				got, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 10 + rand.IntN(40), Lease: time.Minute, WorkerID: fmt.Sprint("w", w)})
				claimed[w], errs[w] = storage.Refs(got), err
			})
		}
		wg.Wait()
		must(t, errors.Join(errs...))
		for w := range claimers {
			if len(claimed[w]) > 0 {
				wg.Go(func() {
					errs[w] = s.Ack(ctx, storage.AckParams{Records: claimed[w], WorkerID: fmt.Sprint("w", w)})
				})
				acked += len(claimed[w])
			}
		}
		wg.Wait()
		must(t, errors.Join(errs...))
	}
	if st := mustStats(t, s); st.Pending != 0 || st.Delivered != records || acked != records {
		t.Fatalf("Stats = %+v, %d acked; want all %d delivered, each once", st, acked, records)
	}
	t.Logf("InnoDB deadlocks, each retried: %d, between claims: %d", s.deadlocks.Load(), s.claimDeadlocks.Load())
}

// stressClaimersAndWriters runs the workload with workers claimers and
// returns how many deadlocks InnoDB reported to the storage meanwhile, and
// how many of them were claims'; crash lets some claims go
// unwritten-back.
func stressClaimersAndWriters(t *testing.T, lease time.Duration, crash bool, workers int) (all, claims int64) {
	s := newStore(t, Config{})
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	const (
		records = 3000
		keys    = 20
	)
	keysOf := make([]string, records)
	for i := range keysOf {
		if i%7 == 0 {
			continue // keyless
		}
		keysOf[i] = fmt.Sprint("k", rand.IntN(keys))
	}
	for start := 0; start < records; start += 500 {
		insert(t, s, recs(keysOf[start:start+500]...)...)
	}

	var mu sync.Mutex
	first := map[int64]int{}    // id -> sequence number of its first publish
	keyOf := map[int64]string{} // id -> key
	var seq int
	var done atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		worker := fmt.Sprint("w", w)
		wg.Go(func() {
			for ctx.Err() == nil {
				st, err := s.Stats(ctx)
				if err != nil {
					errs <- err
					return
				}
				if st.Pending == 0 {
					return
				}
				got, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 1 + rand.IntN(20), Lease: lease, WorkerID: worker})
				if err != nil {
					errs <- err
					return
				}
				if len(got) == 0 {
					time.Sleep(2 * time.Millisecond)
					continue
				}
				mu.Lock()
				for _, r := range got {
					if _, ok := first[r.ID]; !ok {
						seq++
						first[r.ID] = seq
						keyOf[r.ID] = r.Key
					}
				}
				mu.Unlock()
				var err2 error
				switch x := rand.IntN(20); {
				case x < 12:
					err2 = s.Ack(ctx, storage.AckParams{Records: storage.Refs(got), WorkerID: worker})
				case x < 14:
					err2 = s.Nack(ctx, storage.NackParams{Record: got[0].Ref(), WorkerID: worker, Error: "x", RetryAt: time.Now().Add(5 * time.Millisecond)})
					if err2 == nil && len(got) > 1 {
						err2 = s.Release(ctx, storage.ReleaseParams{Records: storage.Refs(got[1:]), WorkerID: worker, RetryAt: time.Now().Add(5 * time.Millisecond)})
					}
				case x < 15:
					err2 = s.DeadLetter(ctx, storage.DeadLetterParams{Record: got[0].Ref(), WorkerID: worker, Error: "dead"})
					if err2 == nil && len(got) > 1 {
						err2 = s.Ack(ctx, storage.AckParams{Records: storage.Refs(got[1:]), WorkerID: worker})
					}
				case x < 17:
					_, err2 = s.Extend(ctx, storage.ExtendParams{Records: storage.Refs(got), WorkerID: worker, Lease: lease})
					if err2 == nil {
						err2 = s.Ack(ctx, storage.AckParams{Records: storage.Refs(got), WorkerID: worker})
					}
				case crash: // the lease runs out
				default:
					err2 = s.Ack(ctx, storage.AckParams{Records: storage.Refs(got), WorkerID: worker})
				}
				if err2 != nil {
					errs <- err2
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if ctx.Err() != nil {
		dumpPending(t, s)

		t.Fatalf("not finished within the deadline: %+v", mustStats(t, s))
	}
	st := mustStats(t, s)
	if st.Pending != 0 || st.Delivered+st.Dead != records {
		t.Fatalf("Stats = %+v, want every one of %d records delivered or dead", st, records)
	}
	// First publishes per key in id order.
	byKey := map[string][]int64{}
	for id, k := range keyOf {
		if k != "" {
			byKey[k] = append(byKey[k], id)
		}
	}
	for k, ids := range byKey {
		slices.Sort(ids)
		for i := 1; i < len(ids); i++ {
			if first[ids[i]] < first[ids[i-1]] {
				t.Fatalf("key %s: record %d first published before record %d", k, ids[i], ids[i-1])
			}
		}
	}
	t.Logf("%d rounds, stats %+v", done.Load(), st)
	return s.deadlocks.Load(), s.claimDeadlocks.Load()
}

func mustStats(t testing.TB, s *Storage) storage.Stats {
	t.Helper()
	st, err := s.Stats(context.Background())
	must(t, err)
	return st
}

// logBefore logs the rows of key before id.
func logBefore(t testing.TB, s *Storage, key string, id int64) {
	r2, err := s.db.QueryContext(context.Background(), fmt.Sprintf("SELECT id, status, attempts, COALESCE(last_error,''), CAST(COALESCE(delivered_at,'') AS CHAR) FROM %s WHERE `key` = ? AND id < %d ORDER BY id DESC LIMIT 3", s.table, id), key)
	if err != nil {
		t.Log(err)
		return
	}
	defer func() { _ = r2.Close() }()
	for r2.Next() {
		var id2 int64
		var st, le, da string
		var at int
		_ = r2.Scan(&id2, &st, &at, &le, &da)
		t.Logf("   before: %d %s attempts %d error %q delivered %s", id2, st, at, le, da)
	}
	if err := r2.Err(); err != nil {
		t.Log(err)
	}
}

// dumpPending logs the pending rows, for a test that found some stuck.
func dumpPending(t testing.TB, s *Storage) {
	rows, err := s.db.QueryContext(context.Background(), "SELECT id, `key`, parked, COALESCE(leased_by, ''), CAST(COALESCE(leased_until, '') AS CHAR), CAST(due_at AS CHAR), attempts FROM "+s.table+" WHERE status = 'pending' ORDER BY `key`, id LIMIT 50")
	if err != nil {
		t.Log(err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		var key, by, until, due string
		var parked, attempts int
		if err := rows.Scan(&id, &key, &parked, &by, &until, &due, &attempts); err != nil {
			t.Log(err)
			return
		}
		t.Logf("pending %d key %q parked %d leased_by %q until %s due %s attempts %d", id, key, parked, by, until, due, attempts)
		logBefore(t, s, key, id)
	}
	if err := rows.Err(); err != nil {
		t.Log(err)
	}
}
