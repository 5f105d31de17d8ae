package postgres

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// fill adds n pending rows over keys distinct keys with 256-byte payloads in
// one statement.
func fill(tb testing.TB, s *Storage, n, keys int) {
	tb.Helper()
	_, err := s.pool.Exec(tb.Context(), fmt.Sprintf(`INSERT INTO %s (uuid, topic, key, payload, metadata)
SELECT md5(g::text), 'bench', 'k' || (g %% $2), convert_to(repeat('x', 256), 'UTF8'), '{"a":"b"}'
FROM generate_series(1, $1) g`, s.table), n, keys)
	must(tb, err)
	_, err = s.pool.Exec(tb.Context(), "ANALYZE "+s.table)
	must(tb, err)
}

// BenchmarkClaimAck measures one worker claiming and acking batches with a
// no-op publish; msgs/s is the figure to read.
func BenchmarkClaimAck(b *testing.B) {
	for _, strict := range []bool{true, false} {
		for _, batch := range []int{100, 1000} {
			b.Run(fmt.Sprintf("strict=%v/batch=%d", strict, batch), func(b *testing.B) {
				s := newStore(b, Config{DisableStrictOrdering: !strict})
				const backlog = 50_000
				fill(b, s, backlog, 1000)
				left := backlog
				ctx := b.Context()
				ids := make([]int64, 0, batch)
				msgs := 0
				b.ResetTimer()
				for b.Loop() {
					if left < batch {
						b.StopTimer()
						fill(b, s, backlog, 1000)
						left += backlog
						b.StartTimer()
					}
					got, err := s.Claim(ctx, storage.ClaimParams{BatchSize: batch, Lease: time.Minute, WorkerID: "bench"})
					if err != nil {
						b.Fatal(err)
					}
					if len(got) != batch {
						b.Fatalf("claimed %d, want %d", len(got), batch)
					}
					ids = ids[:0]
					for _, r := range got {
						ids = append(ids, r.ID)
					}
					if err := s.Ack(ctx, storage.AckParams{IDs: ids, WorkerID: "bench"}); err != nil {
						b.Fatal(err)
					}
					left -= len(got)
					msgs += len(got)
				}
				b.ReportMetric(float64(msgs)/b.Elapsed().Seconds(), "msgs/s")
			})
		}
	}
}

// BenchmarkDrainWorkers drains a 5k backlog with four workers under strict
// ordering, over many keys and over a few hot ones: the case where a naive
// ordering check collapses.
func BenchmarkDrainWorkers(b *testing.B) {
	for _, keys := range []int{1000, 10} {
		for _, batch := range []int{100, 1000} {
			b.Run(fmt.Sprintf("keys=%d/batch=%d", keys, batch), func(b *testing.B) {
				const backlog, workers = 5_000, 4
				total := 0
				var elapsed time.Duration
				for b.Loop() {
					b.StopTimer()
					s := newStore(b, Config{})
					fill(b, s, backlog, keys)
					b.StartTimer()
					start := time.Now()
					var wg sync.WaitGroup
					var delivered atomic.Int64
					for w := range workers {
						wg.Go(func() {
							worker := fmt.Sprintf("w%d", w)
							for delivered.Load() < backlog {
								got, err := s.Claim(b.Context(), storage.ClaimParams{BatchSize: batch, Lease: time.Minute, WorkerID: worker})
								if err != nil {
									b.Error(err)
									return
								}
								if len(got) == 0 {
									time.Sleep(time.Millisecond) // an idle worker polls, as the forwarder would
									continue
								}
								ids := make([]int64, len(got))
								for i, r := range got {
									ids[i] = r.ID
								}
								if err := s.Ack(b.Context(), storage.AckParams{IDs: ids, WorkerID: worker}); err != nil {
									b.Error(err)
									return
								}
								delivered.Add(int64(len(got)))
							}
						})
					}
					wg.Wait()
					elapsed += time.Since(start)
					total += backlog
				}
				b.ReportMetric(float64(total)/elapsed.Seconds(), "msgs/s")
			})
		}
	}
}
