package postgres

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

func TestZZOutage(t *testing.T) {
	if os.Getenv("ZZ") == "" {
		t.Skip()
	}
	ctx := t.Context()
	for _, outage := range []bool{false, true} {
		s := newStore(t, Config{})
		_, err := s.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (uuid, topic, key, payload)
SELECT g::text, 't', 'k' || (g %% 1000), convert_to(repeat('x', 256), 'UTF8') FROM generate_series(1, 200000) g`, s.table))
		must(t, err)
		_, err = s.pool.Exec(ctx, "VACUUM ANALYZE "+s.table)
		must(t, err)
		due := time.Now()
		if outage {
			got := claim(t, s, "w", 1000, time.Hour)
			due = time.Now().Add(3 * time.Second)
			for _, r := range got {
				must(t, s.Nack(ctx, storage.NackParams{ID: r.ID, WorkerID: "w", Error: "down", RetryAt: due}))
			}
			// claims during the outage
			var worst time.Duration
			for time.Now().Before(due.Add(-500 * time.Millisecond)) {
				st := time.Now()
				got := claim(t, s, "w", 1000, time.Minute)
				if d := time.Since(st); d > worst {
					worst = d
				}
				if len(got) > 0 {
					t.Fatalf("claimed %d during the outage", len(got))
				}
				time.Sleep(100 * time.Millisecond)
			}
			t.Logf("outage: slowest empty claim while heads wait: %s", worst)
			time.Sleep(time.Until(due))
		}
		if os.Getenv("ZZE") != "" && outage {
			for i := 0; i < 7; i++ {
				got := claim(t, s, "w", 1000, time.Minute)
				if i == 6 {
					tx, err := s.pool.Begin(ctx)
					must(t, err)
					_, err = tx.Exec(ctx, s.q.plan)
					must(t, err)
					rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS) "+s.q.unpark, idsOf(got))
					must(t, err)
					for rows.Next() {
						var l string
						must(t, rows.Scan(&l))
						t.Log(l)
					}
					must(t, tx.Rollback(ctx))
				}
				must(t, s.Ack(ctx, storage.AckParams{IDs: idsOf(got), WorkerID: "w"}))
			}
		}
		start := time.Now()
		n := 0
		var slowest time.Duration
		for n < 200000 && time.Since(start) < 20*time.Second {
			st := time.Now()
			got := claim(t, s, "w", 1000, time.Minute)
			if d := time.Since(st); d > slowest {
				slowest = d
			}
			cd := time.Since(st)
			if len(got) == 0 {
				if os.Getenv("ZZV") != "" {
					var parked, pend, due int
					must(t, s.pool.QueryRow(ctx, "SELECT count(*) FILTER (WHERE parked), count(*), count(*) FILTER (WHERE NOT parked AND due_at <= now()) FROM "+s.table+" WHERE status = 'pending'").Scan(&parked, &pend, &due))
					t.Logf("empty claim in %s; parked %d pending %d unparked due %d", cd, parked, pend, due)
				}
				time.Sleep(5 * time.Millisecond)
				continue
			}
			st = time.Now()
			must(t, s.Ack(ctx, storage.AckParams{IDs: idsOf(got), WorkerID: "w"}))
			if os.Getenv("ZZV") != "" && (n%20000 == 0 || outage) {
				t.Logf("claim %d in %s, ack in %s", len(got), cd, time.Since(st))
			}
			n += len(got)
		}
		el := time.Since(start)
		t.Logf("outage=%v: drained %d in %s: %.0f/s, slowest claim %s", outage, n, el, float64(n)/el.Seconds(), slowest)
	}
}
