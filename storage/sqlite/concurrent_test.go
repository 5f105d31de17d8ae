package sqlite

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// delivery is one claimed record as a drain loop saw it.
type delivery struct {
	id    int64
	key   string
	at    int64 // Unix nanoseconds right after the claim returned, before the ack
	owner string
}

// drain claims and acks until the storage has nothing pending, calling seen
// for each claimed record before acking it.
func drain(ctx context.Context, s *Storage, worker string, batch int, seen func(storage.Record, int64)) error {
	for {
		recs, err := s.Claim(ctx, storage.ClaimParams{BatchSize: batch, Lease: time.Minute, WorkerID: worker})
		if err != nil {
			return err
		}
		at := time.Now().UnixNano()
		if len(recs) == 0 {
			st, err := s.Stats(ctx)
			if err != nil {
				return err
			}
			if st.Pending == 0 {
				return nil
			}
			// Others hold the rest (or the keys they block): poll again.
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(time.Millisecond):
			}
			continue
		}
		for _, r := range recs {
			seen(r, at)
		}
		if err := s.Ack(ctx, storage.AckParams{Records: storage.Refs(recs), WorkerID: worker}); err != nil {
			return err
		}
	}
}

// checkDeliveries fails unless every id in want was delivered exactly once
// and, per key, in id order of claim time.
func checkDeliveries(t *testing.T, want []int64, got []delivery) {
	t.Helper()
	count := make(map[int64]int, len(want))
	for _, d := range got {
		count[d.id]++
	}
	for _, id := range want {
		if count[id] != 1 {
			t.Errorf("record %d delivered %d times, want once", id, count[id])
		}
	}
	if len(got) != len(want) {
		t.Errorf("%d deliveries, want %d", len(got), len(want))
	}
	byKey := map[string][]delivery{}
	for _, d := range got {
		if d.key != "" {
			byKey[d.key] = append(byKey[d.key], d)
		}
	}
	for key, ds := range byKey {
		slices.SortStableFunc(ds, func(a, b delivery) int { return cmp.Compare(a.at, b.at) })
		for i := 1; i < len(ds); i++ {
			if ds[i].id < ds[i-1].id {
				t.Errorf("key %s: record %d (%s) claimed after %d (%s): out of order", key, ds[i-1].id, ds[i-1].owner, ds[i].id, ds[i].owner)
			}
		}
	}
}

func concurrentRecords(n int) []storage.Record {
	records := make([]storage.Record, n)
	for i := range records {
		key := ""
		if i%5 != 0 {
			key = fmt.Sprintf("k%d", i%13)
		}
		records[i] = storage.Record{UUID: strconv.Itoa(i), Topic: "t", Key: key, Payload: []byte("x")}
	}
	return records
}

// TestConcurrentHandles drains one file through separate *sql.DB handles, as
// separate processes would, each shared by two goroutines.
func TestConcurrentHandles(t *testing.T) {
	t.Parallel()
	const handles, perHandle, rows = 4, 2, 500
	first := newTestStorage(t, Config{})
	want := insert(t, first, concurrentRecords(rows)...)
	var dbPath string
	if err := first.db.QueryRow(`SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&dbPath); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var (
		mu  sync.Mutex
		got []delivery
		wg  sync.WaitGroup
	)
	for h := range handles {
		db, err := Open(dbPath)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		s, err := New(db, Config{})
		if err != nil {
			t.Fatal(err)
		}
		for g := range perHandle {
			worker := fmt.Sprintf("h%d-g%d", h, g)
			wg.Go(func() {
				err := drain(ctx, s, worker, 7, func(r storage.Record, at int64) {
					mu.Lock()
					defer mu.Unlock()
					got = append(got, delivery{id: r.ID, key: r.Key, at: at, owner: worker})
				})
				if err != nil {
					t.Errorf("worker %s: %v", worker, err)
				}
			})
		}
	}
	wg.Wait()
	checkDeliveries(t, want, got)
	if st, err := first.Stats(ctx); err != nil || st.Delivered != rows || st.Pending != 0 {
		t.Errorf("final stats %+v, %v", st, err)
	}
}

const (
	childEnvPath   = "TXOUTBOX_SQLITE_CHILD_DB"
	childEnvWorker = "TXOUTBOX_SQLITE_CHILD_WORKER"
	childEnvCount  = "TXOUTBOX_SQLITE_CHILDREN"
	deliveredLine  = "DELIVERED "
)

// TestMultiProcess re-executes the test binary as three child processes that
// drain one database file together.
func TestMultiProcess(t *testing.T) {
	if path := os.Getenv(childEnvPath); path != "" {
		n, _ := strconv.Atoi(os.Getenv(childEnvCount))
		runChild(t, path, os.Getenv(childEnvWorker), n)
		return
	}
	if testing.Short() {
		t.Skip("starts child processes")
	}
	t.Parallel()
	const children = 3
	rows := 2000
	if raceEnabled {
		rows = 600 // the race detector slows SQLite enough for the children to overlap
	}
	s := newTestStorage(t, Config{})
	want := insert(t, s, concurrentRecords(rows)...)
	var dbPath string
	if err := s.db.QueryRow(`SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&dbPath); err != nil {
		t.Fatal(err)
	}

	type result struct {
		worker string
		out    []byte
		err    error
	}
	results := make(chan result, children)
	for i := range children {
		worker := fmt.Sprintf("proc%d", i)
		cmd := exec.Command(os.Args[0], "-test.run=^TestMultiProcess$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), childEnvPath+"="+dbPath, childEnvWorker+"="+worker, childEnvCount+"="+strconv.Itoa(children))
		go func() {
			out, err := cmd.CombinedOutput()
			results <- result{worker, out, err}
		}()
	}
	var got []delivery
	perChild := map[string]int{}
	for range children {
		r := <-results
		if r.err != nil {
			t.Errorf("child %s: %v\n%s", r.worker, r.err, r.out)
			continue
		}
		sc := bufio.NewScanner(bytes.NewReader(r.out))
		for sc.Scan() {
			line, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), deliveredLine)
			if !ok {
				continue
			}
			var d delivery
			if _, err := fmt.Sscanf(line, "%d %d %q", &d.id, &d.at, &d.key); err != nil {
				t.Fatalf("child %s: bad line %q: %v", r.worker, line, err)
			}
			d.owner = r.worker
			got = append(got, d)
			perChild[r.worker]++
		}
	}
	checkDeliveries(t, want, got)
	t.Logf("deliveries per child: %v", perChild)
}

func runChild(t *testing.T, path, worker string, children int) {
	db, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = db.Close() }()
	s, err := New(db, Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Start barrier: every child leaves a ready file next to the database and
	// waits for the others', so the drains overlap.
	dir := filepath.Dir(path)
	if err := os.WriteFile(filepath.Join(dir, "ready-"+worker), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for {
		ready, err := filepath.Glob(filepath.Join(dir, "ready-*"))
		if err != nil {
			t.Fatal(err)
		}
		if len(ready) >= children {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("child %s: only %d of %d children started", worker, len(ready), children)
		case <-time.After(time.Millisecond):
		}
	}
	var out bytes.Buffer
	err = drain(ctx, s, worker, 5, func(r storage.Record, at int64) {
		fmt.Fprintf(&out, "%s%d %d %q\n", deliveredLine, r.ID, at, r.Key)
	})
	os.Stdout.Write(out.Bytes())
	if err != nil {
		t.Fatalf("child %s: %v", worker, err)
	}
}
