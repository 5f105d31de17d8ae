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
// no-op publish; msgs/s is the figure to read, claim-ms and ack-ms split one
// round between its two statements, allocs/msg counts the client side.
func BenchmarkClaimAck(b *testing.B) {
	for _, mode := range []struct {
		name string
		cfg  Config
	}{
		{"strict", Config{}}, {"strict+delete", Config{DeleteOnAck: true}}, {"nostrict", Config{DisableStrictOrdering: true}},
	} {
		for _, batch := range []int{100, 1000} {
			b.Run(fmt.Sprintf("%s/batch=%d", mode.name, batch), func(b *testing.B) {
				s := newStore(b, mode.cfg)
				const backlog = 50_000
				fill(b, s, backlog, 1000)
				left := backlog
				ctx := b.Context()
				ids := make([]int64, 0, batch)
				msgs := 0
				var claimT, ackT time.Duration
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					if left < batch {
						b.StopTimer()
						fill(b, s, backlog, 1000)
						left += backlog
						b.StartTimer()
					}
					t0 := time.Now()
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
					t1 := time.Now()
					if err := s.Ack(ctx, storage.AckParams{IDs: ids, WorkerID: "bench"}); err != nil {
						b.Fatal(err)
					}
					claimT += t1.Sub(t0)
					ackT += time.Since(t1)
					left -= len(got)
					msgs += len(got)
				}
				rounds := float64(msgs / batch)
				b.ReportMetric(float64(msgs)/b.Elapsed().Seconds(), "msgs/s")
				b.ReportMetric(claimT.Seconds()*1000/rounds, "claim-ms")
				b.ReportMetric(ackT.Seconds()*1000/rounds, "ack-ms")
			})
		}
	}
}

// BenchmarkClaimLargeBacklog claims and acks from the head of a backlog of
// 1M pending rows: the claim must cost the same as over 50k.
func BenchmarkClaimLargeBacklog(b *testing.B) {
	s := newStore(b, Config{})
	fill(b, s, 1_000_000, 1000)
	ctx := b.Context()
	const batch = 1000
	msgs := 0
	for b.Loop() {
		got, err := s.Claim(ctx, storage.ClaimParams{BatchSize: batch, Lease: time.Minute, WorkerID: "bench"})
		if err != nil {
			b.Fatal(err)
		}
		ids := make([]int64, len(got))
		for i, r := range got {
			ids[i] = r.ID
		}
		if err := s.Ack(ctx, storage.AckParams{IDs: ids, WorkerID: "bench"}); err != nil {
			b.Fatal(err)
		}
		msgs += len(got)
	}
	b.ReportMetric(float64(msgs)/b.Elapsed().Seconds(), "msgs/s")
}

// BenchmarkDrainWorkers drains a 20k backlog with one and four workers under
// strict ordering, over many keys and over a few hot ones: the case where a
// naive ordering check collapses.
func BenchmarkDrainWorkers(b *testing.B) {
	for _, workers := range []int{1, 4} {
		for _, keys := range []int{1000, 10} {
			for _, batch := range []int{100, 1000} {
				b.Run(fmt.Sprintf("workers=%d/keys=%d/batch=%d", workers, keys, batch), func(b *testing.B) {
					const backlog = 20_000
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
}

// BenchmarkClaimHeld claims 100 rows (rolled back, so every claim sees the
// same table) next to 0, 200k and 1M held-back rows in both shapes of
// holdRows: the claim must cost the same. -benchtime=20x is plenty.
func BenchmarkClaimHeld(b *testing.B) {
	for _, manyKeys := range []bool{true, false} {
		for _, held := range []int{0, 200_000, 1_000_000} {
			b.Run(fmt.Sprintf("every_key=%v/held=%d", manyKeys, held), func(b *testing.B) {
				s := newStore(b, Config{})
				holdRows(b, s, held, manyKeys)
				var free []storage.Record
				for i := range 300 {
					free = append(free, rec(fmt.Sprintf("free%d", i)))
				}
				insert(b, s, free...)
				_, err := s.pool.Exec(b.Context(), "ANALYZE "+s.table)
				must(b, err)
				ctx := b.Context()
				for b.Loop() {
					tx, err := s.pool.Begin(ctx)
					must(b, err)
					_, err = tx.Exec(ctx, noJIT) // as Claim does
					must(b, err)
					rows, err := tx.Query(ctx, s.q.claim, 100, "w", time.Minute.Microseconds(), walkFactor*100)
					must(b, err)
					recs, err := scanClaimed(rows, s.table, 100)
					must(b, err)
					must(b, tx.Rollback(ctx))
					if len(recs) != 100 {
						b.Fatalf("claimed %d", len(recs))
					}
				}
			})
		}
	}
}

// BenchmarkDecode compares decoding claimed rows with decodeRaw (the wire
// bytes) against pgx's own Scan, the only client-side work of a claim that
// grows with the batch.
func BenchmarkDecode(b *testing.B) {
	s := newStore(b, Config{})
	fill(b, s, 1000, 100)
	ctx := b.Context()
	q := fmt.Sprintf(`SELECT id, uuid, topic, key, payload, metadata, attempts, created_at FROM %s ORDER BY id`, s.table)
	for _, raw := range []bool{true, false} {
		b.Run(fmt.Sprintf("raw=%v", raw), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				rows, err := s.pool.Query(ctx, q)
				must(b, err)
				var topic string
				n := 0
				for rows.Next() {
					var r storage.Record
					if raw && decodeRaw(rows.RawValues(), &r, &topic) {
						n++
						continue
					}
					var attempts int32
					var created time.Time
					must(b, rows.Scan(&r.ID, &r.UUID, &r.Topic, &r.Key, &r.Payload, &r.Metadata, &attempts, &created))
					n++
				}
				must(b, rows.Err())
				if n != 1000 {
					b.Fatalf("decoded %d", n)
				}
			}
		})
	}
}
