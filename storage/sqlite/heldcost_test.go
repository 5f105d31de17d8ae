package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	msqlite "modernc.org/sqlite"

	"github.com/txoutbox/txoutbox/storage"
)

// outageShape is how the held topic's records are held back during a
// partial outage.
type outageShape struct {
	name string
	keys func(held int) int // keys of the held topic
	hold bool               // HoldOnDeadLetter
	// settle writes back a claimed group of one held key (nil: keep it
	// leased, in flight).
	settle func(ctx context.Context, s *Storage, group []storage.Record) error
}

var outageShapes = []outageShape{
	// Every key's head waits for a retry an hour away, 10 records a key.
	{name: "heads", keys: func(held int) int { return max(held/10, 1) }, settle: retryLater},
	// One key's head waits for its retry, every held record behind it.
	{name: "behind", keys: func(int) int { return 1 }, settle: retryLater},
	// One key's records are in flight (a hung publish), the rest behind.
	{name: "leased", keys: func(int) int { return 1 }},
	// Every key's head is dead and holds its key, 10 records a key.
	{name: "dead", keys: func(held int) int { return max(held/10, 1) }, hold: true, settle: deadLetter},
}

// retryLater is the forwarder's failed publish: the group's first record
// is nacked, the rest released untried, both due in an hour.
func retryLater(ctx context.Context, s *Storage, group []storage.Record) error {
	at := time.Now().Add(time.Hour)
	if err := s.Nack(ctx, storage.NackParams{Record: group[0].Ref(), WorkerID: "fwd", Error: "topic down", RetryAt: at}); err != nil {
		return err
	}
	return s.Release(ctx, storage.ReleaseParams{Records: storage.Refs(group[1:]), WorkerID: "fwd", RetryAt: at})
}

// deadLetter is the forwarder's last attempt: the group's first record is
// dead-lettered, the rest released.
func deadLetter(ctx context.Context, s *Storage, group []storage.Record) error {
	if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: group[0].Ref(), WorkerID: "fwd", Error: "poison"}); err != nil {
		return err
	}
	return s.Release(ctx, storage.ReleaseParams{Records: storage.Refs(group[1:]), WorkerID: "fwd", RetryAt: time.Now()})
}

// outageFigures are what one partial outage measured: times, and the
// database pages each step requested (SQLite's cache hits and misses on
// the connection it ran on), which do not depend on how busy the machine
// is.
type outageFigures struct {
	during    []time.Duration // claims that returned records while the held records came in
	producers []time.Duration // producer transactions meanwhile
	after     []time.Duration // claims of 100 fresh records of other keys, every held record in place
	drain     float64         // records/s draining a backlog of the healthy topic, after

	duringPages               []int64 // per record claimed
	producerPages, afterPages []int64
	drainPages                float64 // per record drained
}

// pinned returns a storage over its own handle on s's file, with one
// connection, so that pages counts what its calls request.
func pinned(t *testing.T, s *Storage, config Config) *Storage {
	t.Helper()
	var path string
	if err := s.db.QueryRow(`SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&path); err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open(DriverName, strings.Replace(dsn(path), "busy_timeout(5000)", "busy_timeout(60000)", 1))
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(1)
	t.Cleanup(func() { _ = db.Close() })
	return newStorage(db, config)
}

// pages is the count of page requests of s's one connection so far.
func pages(t *testing.T, s *Storage) int64 {
	t.Helper()
	conn, err := s.db.Conn(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	var n int64
	err = conn.Raw(func(dc any) error {
		st, ok := dc.(msqlite.DBStatus)
		if !ok {
			return fmt.Errorf("%T has no Status", dc)
		}
		for _, op := range []msqlite.DBStatusOp{msqlite.DBStatusCacheHit, msqlite.DBStatusCacheMiss} {
			cur, _, err := st.Status(op, false)
			if err != nil {
				return err
			}
			n += int64(cur)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func p95n(ns []int64) int64 {
	s := slices.Clone(ns)
	slices.Sort(s)
	return s[(len(s)*95)/100]
}

func p95(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[(len(s)*95)/100]
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

// runOutage runs a partial outage on a fresh database file: a forwarder
// loop claims batches of 100, acks the healthy topic's records and holds
// the held topic's (shape.settle), while one producer inserts held records
// of the held topic, 1000 a transaction, and another the healthy topic's
// traffic, 10 records a transaction; then, with every held record in place,
// claims of 100 fresh records, and the drain of a backlog of healthy
// records over 1,000 keys. held 0 is the outage-free base.
func runOutage(t *testing.T, shape outageShape, held, backlog int) outageFigures {
	t.Helper()
	s := newTestStorage(t, Config{HoldOnDeadLetter: shape.hold})
	fwd := pinned(t, s, Config{HoldOnDeadLetter: shape.hold}) // the forwarder's claims and write-backs
	healthy := pinned(t, s, Config{})                         // the healthy topic's producer
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Minute)
	defer cancel()
	var f outageFigures
	payload := make([]byte, 100)
	insertTx := func(s *Storage, records []storage.Record) (time.Duration, error) {
		start := time.Now()
		tx, err := s.db.BeginTx(ctx, nil)
		if err != nil {
			return 0, err
		}
		defer func() { _ = tx.Rollback() }()
		if err := s.Insert(ctx, tx, records); err != nil {
			return 0, err
		}
		err = tx.Commit()
		return time.Since(start), err
	}

	// The live part: the held records come in while the healthy topic flows.
	var heldDone, healthyIn atomic.Bool
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	wg.Add(2)
	go func() { // the held topic's producer
		defer wg.Done()
		defer heldDone.Store(true)
		keys := shape.keys(max(held, 1))
		for start := 0; start < held; start += 1000 {
			batch := make([]storage.Record, 0, 1000)
			for i := start; i < min(start+1000, held); i++ {
				batch = append(batch, storage.Record{UUID: "h" + strconv.Itoa(i), Topic: "held", Key: "h" + strconv.Itoa(i%keys), Payload: payload})
			}
			if _, err := insertTx(s, batch); err != nil {
				errs <- fmt.Errorf("held producer: %w", err)
				return
			}
		}
	}()
	var mu sync.Mutex
	go func() { // the healthy topic's producer
		defer wg.Done()
		defer healthyIn.Store(true)
		for n := 0; !heldDone.Load() || n < 200; n++ {
			batch := make([]storage.Record, 10)
			for i := range batch {
				batch[i] = storage.Record{UUID: fmt.Sprintf("p%d-%d", n, i), Topic: "healthy", Key: "p" + strconv.Itoa((n*10+i)%1000), Payload: payload}
			}
			before := pages(t, healthy)
			d, err := insertTx(healthy, batch)
			if err != nil {
				errs <- fmt.Errorf("healthy producer: %w", err)
				return
			}
			used := pages(t, healthy) - before
			mu.Lock()
			f.producers = append(f.producers, d)
			f.producerPages = append(f.producerPages, used)
			mu.Unlock()
			time.Sleep(time.Millisecond)
		}
	}()
	// The forwarder: claims until every record came in and nothing is left
	// to claim.
	for {
		before, start := pages(t, fwd), time.Now()
		recs, err := fwd.Claim(ctx, storage.ClaimParams{BatchSize: 100, Lease: time.Hour, WorkerID: "fwd"})
		if err != nil {
			t.Fatal(err)
		}
		if len(recs) == 0 {
			if healthyIn.Load() {
				break
			}
			time.Sleep(time.Millisecond)
			continue
		}
		f.during = append(f.during, time.Since(start))
		f.duringPages = append(f.duringPages, (pages(t, fwd)-before)/int64(len(recs)))
		var acks []int64
		groups := map[string][]storage.Record{}
		var order []string
		for _, r := range recs {
			if r.Topic != "held" {
				acks = append(acks, r.ID)
				continue
			}
			if _, ok := groups[r.Key]; !ok {
				order = append(order, r.Key)
			}
			groups[r.Key] = append(groups[r.Key], r)
		}
		if err := fwd.Ack(ctx, storage.AckParams{Records: liveRefs(t, fwd, acks...), WorkerID: "fwd"}); err != nil {
			t.Fatal(err)
		}
		for _, k := range order {
			if shape.settle != nil {
				if err := shape.settle(ctx, fwd, groups[k]); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	st, err := s.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Pending+st.Dead != int64(held) {
		t.Fatalf("%d pending and %d dead after the live part, want the %d held records", st.Pending, st.Dead, held)
	}

	// Claims of 100 fresh records of other keys, every held record in place.
	for r := range 40 {
		batch := make([]storage.Record, 100)
		for i := range batch {
			batch[i] = storage.Record{UUID: fmt.Sprintf("c%d-%d", r, i), Topic: "healthy", Key: fmt.Sprintf("c%d-%d", r, i), Payload: payload}
		}
		if _, err := insertTx(healthy, batch); err != nil {
			t.Fatal(err)
		}
		before, start := pages(t, fwd), time.Now()
		got := claim(t, fwd, 100, time.Minute, "w")
		d, used := time.Since(start), pages(t, fwd)-before
		if len(got) != 100 {
			t.Fatalf("claimed %d fresh records, want 100", len(got))
		}
		if err := fwd.Ack(ctx, storage.AckParams{Records: storage.Refs(got), WorkerID: "w"}); err != nil {
			t.Fatal(err)
		}
		if r >= 5 { // the first claims warm the cache up
			f.after, f.afterPages = append(f.after, d), append(f.afterPages, used)
		}
	}

	// The healthy topic drains a backlog.
	for start := 0; start < backlog; start += 1000 {
		batch := make([]storage.Record, 1000)
		for i := range batch {
			batch[i] = storage.Record{UUID: fmt.Sprintf("b%d", start+i), Topic: "healthy", Key: "b" + strconv.Itoa((start+i)%1000), Payload: payload}
		}
		if _, err := insertTx(healthy, batch); err != nil {
			t.Fatal(err)
		}
	}
	before, start, done := pages(t, fwd), time.Now(), 0
	for done < backlog {
		got := claim(t, fwd, 100, time.Minute, "w")
		if len(got) == 0 {
			t.Fatalf("claimed nothing after %d of the %d backlog records", done, backlog)
		}
		for _, r := range got {
			if r.Topic == "held" {
				t.Fatalf("claimed held record %d", r.ID)
			}
		}
		if err := fwd.Ack(ctx, storage.AckParams{Records: storage.Refs(got), WorkerID: "w"}); err != nil {
			t.Fatal(err)
		}
		done += len(got)
	}
	f.drain = float64(done) / time.Since(start).Seconds()
	f.drainPages = float64(pages(t, fwd)-before) / float64(done)
	return f
}

// TestHeldRecordsCostOtherKeysNothing: records held back behind a head
// waiting for its retry, behind records in flight, behind a dead head that
// holds its key, cost the claims of other keys nothing measurable however
// many there are. For each shape at 200,000 held records (20,000 keys x
// 10, or one key), against the same run with none held: while the held
// records come in, the p95 of the claims and of the producers'
// transactions stays within 3x (a claim's per record claimed) and 4x;
// afterwards the p95 of claims of 100 fresh records stays within 4x, and a
// backlog of the healthy topic drains with at most 2x the work a record
// (deeper indexes, see below). Each is counted in database pages
// requested, which a busy machine does not change; the times, and the
// drain rate, go to the log (-v). A claim that walked the held records requested
// tens of thousands of pages and took 0.4-6 s here. TXOUTBOX_HELD_ROWS
// sets the count (2,000 under the race detector, as CI runs it).
func TestHeldRecordsCostOtherKeysNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("inserts 200,000 records per shape")
	}
	held := 200000
	if raceEnabled {
		held = 2000 // the race detector slows SQLite down tenfold and more
	}
	if env := os.Getenv("TXOUTBOX_HELD_ROWS"); env != "" {
		var err error
		if held, err = strconv.Atoi(env); err != nil {
			t.Fatal(err)
		}
	}
	backlog := min(20000, max(held/10, 2000))
	base := runOutage(t, outageShape{name: "none", keys: func(int) int { return 1 }}, 0, backlog)
	logFigures(t, "none", 0, base, base)
	for _, shape := range outageShapes {
		t.Run(shape.name, func(t *testing.T) {
			f := runOutage(t, shape, held, backlog)
			logFigures(t, shape.name, held, f, base)
			// The indexes that hold the held records are a level or two
			// deeper than the near-empty ones of the base: every index
			// probe of a claimed or inserted record requests a page or two
			// more (with 20,000 dead heads, the dead-record check of every
			// candidate too). That is the room over 3x below; a claim that
			// stepped over the held records requested 55-265x the pages of
			// the base at 5,000 held records, its drain 32-63x a record.
			check := func(what string, got, want, times int64) {
				if got > times*want+5 {
					t.Errorf("shape %s with %d held records: %s p95 %d pages, over %dx the %d with none held", shape.name, held, what, got, times, want)
				}
			}
			check("claims during (a record)", p95n(f.duringPages), p95n(base.duringPages), 3)
			check("producer transactions", p95n(f.producerPages), p95n(base.producerPages), 4)
			check("claims of 100 after", p95n(f.afterPages), p95n(base.afterPages), 4)
			if f.drainPages > 2*base.drainPages {
				t.Errorf("shape %s with %d held records: drain %.1f pages a record, over 2x the %.1f with none held",
					shape.name, held, f.drainPages, base.drainPages)
			}
		})
	}
}

func logFigures(t *testing.T, name string, held int, f, base outageFigures) {
	t.Helper()
	t.Logf("%s held=%d: claims during p95 %s max %s (%d claims, p95 %d pages a record); producers p95 %s max %s (p95 %d pages); "+
		"claims of 100 after p50 %s p95 %s (p95 %d pages); drain %.0f/s (%.0f%% of none, %.1f pages a record)",
		name, held, p95(f.during), slices.Max(f.during), len(f.during), p95n(f.duringPages),
		p95(f.producers), slices.Max(f.producers), p95n(f.producerPages),
		median(f.after), p95(f.after), p95n(f.afterPages), f.drain, 100*f.drain/base.drain, f.drainPages)
}
