package postgres

import (
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// TestClaimCostWithHeldRows measures the claim of 100 fresh rows of other
// keys behind n rows held back: (a) every key's head waiting for its retry,
// nothing behind; (b) one key's head waiting with n rows behind it.
func TestClaimCostWithHeldRows(t *testing.T) {
	if testing.Short() {
		t.Skip("measurement")
	}
	ctx := t.Context()
	for _, shape := range []string{"heads", "behind"} {
		for _, n := range []int{0, 50000, 200000} {
			s := newStore(t, Config{})
			if n > 0 {
				var in []storage.Record
				for i := range n {
					k := "hot"
					if shape == "heads" {
						k = fmt.Sprintf("h%d", i)
					}
					in = append(in, rec(k))
				}
				for i := 0; i < len(in); i += 5000 {
					insert(t, s, in[i:min(i+5000, len(in))]...)
				}
				if shape == "heads" {
					_, err := s.pool.Exec(ctx, "UPDATE "+s.table+" SET due_at = now() + interval '1 hour'")
					must(t, err)
				} else {
					got := claim(t, s, "w", 1, time.Minute)
					must(t, s.Nack(ctx, storage.NackParams{ID: got[0].ID, WorkerID: "w", Error: "x", RetryAt: time.Now().Add(time.Hour)}))
				}
				_, err := s.pool.Exec(ctx, "VACUUM ANALYZE "+s.table)
				must(t, err)
			}
			var ds []time.Duration
			for r := range 7 {
				var in []storage.Record
				for i := range 100 {
					in = append(in, rec(fmt.Sprintf("c%d-%d", r, i)))
				}
				insert(t, s, in...)
				if r == 0 && n > 0 {
					rows, err := s.pool.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS) "+s.q.walk, 100)
					must(t, err)
					for rows.Next() {
						var l string
						must(t, rows.Scan(&l))
						t.Log(l)
					}
				}
				start := time.Now()
				got := claim(t, s, "w", 100, time.Minute)
				ds = append(ds, time.Since(start))
				if len(got) != 100 {
					t.Fatalf("%s n=%d: claimed %d", shape, n, len(got))
				}
				must(t, s.Ack(ctx, storage.AckParams{IDs: idsOf(got), WorkerID: "w"}))
			}
			sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
			t.Logf("shape=%s held=%d claim of 100: median %s", shape, n, ds[3])
		}
	}
}
