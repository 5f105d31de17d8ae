package postgres

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

func TestZZDrainProfile(t *testing.T) {
	if os.Getenv("ZZ") == "" {
		t.Skip()
	}
	ctx := t.Context()
	s := newStore(t, Config{})
	_, err := s.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (uuid, topic, key, payload)
SELECT g::text, 't', 'k' || (g %% 1000), convert_to(repeat('x', 256), 'UTF8') FROM generate_series(1, 50000) g`, s.table))
	must(t, err)
	_, err = s.pool.Exec(ctx, "VACUUM ANALYZE "+s.table)
	must(t, err)
	var prev []int64
	var tc, ta time.Duration
	n := 0
	for i := 0; ; i++ {
		st := time.Now()
		if i == 3 || i == 10 {
			t.Log(explainClaim(t, s, 1000, true))
		}
		got := claim(t, s, "w", 1000, time.Minute)
		tc += time.Since(st)
		st = time.Now()
		if len(prev) > 0 {
			must(t, s.Ack(ctx, storage.AckParams{IDs: prev, WorkerID: "w"}))
		}
		ta += time.Since(st)
		n += len(got)
		t.Logf("claim %d: %d", i, len(got))
		if len(got) == 0 && len(prev) == 0 {
			break
		}
		prev = idsOf(got)
	}
	t.Logf("claimed %d: claims %s, acks %s", n, tc, ta)
}

func TestZZAckProfile(t *testing.T) {
	if os.Getenv("ZZ") == "" {
		t.Skip()
	}
	ctx := t.Context()
	s := newStore(t, Config{})
	_, err := s.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (uuid, topic, key, payload)
SELECT g::text, 't', 'k' || (g %% 1000), convert_to(repeat('x', 256), 'UTF8') FROM generate_series(1, 50000) g`, s.table))
	must(t, err)
	_, err = s.pool.Exec(ctx, "VACUUM ANALYZE "+s.table)
	must(t, err)
	for i := 0; i < 5; i++ {
		got := claim(t, s, "w", 1000, time.Minute)
		if i < 4 {
			must(t, s.Ack(ctx, storage.AckParams{IDs: idsOf(got), WorkerID: "w"}))
			continue
		}
		tx, err := s.pool.Begin(ctx)
		must(t, err)
		rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS) "+s.q.ack, idsOf(got), "w")
		must(t, err)
		for rows.Next() {
			var l string
			must(t, rows.Scan(&l))
			t.Log(l)
		}
		must(t, tx.Rollback(ctx))
	}
}
