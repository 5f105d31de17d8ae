package txoutbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage/postgres"
)

// TestNoWorkerRowsLeftBehind: a forwarder leaves no row in the worker table
// when it is done, strict or not: Run leaves when it returns, RunOnce (a
// cron job, a fresh WorkerID each time) leaves after its claim, and without
// strict ordering nothing joins at all. A row left behind counted as a
// claimer with a share of the key slots for up to 10 s (or the lease).
func TestNoWorkerRowsLeftBehind(t *testing.T) {
	pool := testPool(t)
	for _, strict := range []bool{true, false} {
		t.Run(fmt.Sprintf("strict=%v", strict), func(t *testing.T) {
			s := newPostgresStorage(t, pool, postgres.Config{DisableStrictOrdering: !strict})
			ctx := context.Background()
			workers := func() int {
				var n int
				if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+s.WorkerTable()).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			}
			postgresBackend(pool).insert(t, s, record("t", "k", "a"), record("t", "k", "b"))
			for i := range 3 {
				cfg := fastConfig()
				cfg.WorkerID = fmt.Sprintf("cron-%d", i)
				if _, err := newForwarder(t, s, newRecorder(), cfg).RunOnce(ctx); err != nil {
					t.Fatal(err)
				}
				if n := workers(); n != 0 {
					t.Fatalf("after RunOnce %d: %d worker rows, want 0", i, n)
				}
			}
			cfg := fastConfig()
			cfg.WorkerID = "runner"
			target := newRecorder()
			stop := runForwarder(t, newForwarder(t, s, target, cfg))
			postgresBackend(pool).insert(t, s, record("t", "k", "c"))
			waitFor(t, 10*time.Second, "a record published by Run", func() bool { return len(target.deliveries()) > 0 })
			stop()
			if n := workers(); n != 0 {
				t.Fatalf("after Run returned: %d worker rows, want 0", n)
			}
			st, err := s.Stats(ctx)
			if err != nil || st.Pending != 0 {
				t.Fatalf("stats %+v, %v: want nothing pending", st, err)
			}
		})
	}
}
