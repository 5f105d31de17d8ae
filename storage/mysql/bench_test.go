package mysql

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// BenchmarkClaimAck drains a backlog of 1000 keys with one worker, claim
// then ack, and reports the time of each per batch.
func BenchmarkClaimAck(b *testing.B) {
	for _, strict := range []bool{true, false} {
		for _, batch := range []int{100, 1000} {
			b.Run(fmt.Sprintf("strict=%v/batch=%d", strict, batch), func(b *testing.B) {
				s := newStore(b, Config{DisableStrictOrdering: !strict})
				ctx := b.Context()
				var claimT, ackT time.Duration
				var n, batches int
				fill := func() {
					keys := make([]string, 10*batch)
					for i := range keys {
						keys[i] = fmt.Sprint("k", i%1000)
					}
					for start := 0; start < len(keys); start += 1000 {
						insert(b, s, recs(keys[start:min(start+1000, len(keys))]...)...)
					}
				}
				b.ResetTimer()
				for b.Loop() {
					t0 := time.Now()
					got, err := s.Claim(ctx, storage.ClaimParams{BatchSize: batch, Lease: time.Minute, WorkerID: "w"})
					if err != nil {
						b.Fatal(err)
					}
					if len(got) == 0 {
						b.StopTimer()
						fill()
						b.StartTimer()
						continue
					}
					t1 := time.Now()
					if err := s.Ack(ctx, storage.AckParams{Records: storage.Refs(got), WorkerID: "w"}); err != nil {
						b.Fatal(err)
					}
					claimT += t1.Sub(t0)
					ackT += time.Since(t1)
					n += len(got)
					batches++
				}
				if batches > 0 {
					b.ReportMetric(float64(claimT.Microseconds())/float64(batches)/1000, "claim-ms")
					b.ReportMetric(float64(ackT.Microseconds())/float64(batches)/1000, "ack-ms")
					b.ReportMetric(float64(n)/float64(batches), "rows/claim")
				}
			})
		}
	}
}

// BenchmarkProducer measures a producer's transaction (begin, Insert of one
// record, commit) with and without the key locks, from 8 goroutines at once,
// their records on 1000 keys (spread out) or on one key (every producer
// waits for the one before it).
func BenchmarkProducer(b *testing.B) {
	for _, locks := range []bool{true, false} {
		for _, keys := range []int{1000, 1} {
			b.Run(fmt.Sprintf("locks=%v/keys=%d", locks, keys), func(b *testing.B) {
				s := newStore(b, Config{DisableKeyLocks: !locks})
				ctx := b.Context()
				var next atomic.Int64
				b.SetParallelism(8 / max(runtime.GOMAXPROCS(0), 1))
				b.ResetTimer()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						tx, err := s.db.BeginTx(ctx, nil)
						if err != nil {
							b.Error(err)
							return
						}
						r := rec(fmt.Sprint("k", next.Add(1)%int64(keys)))
						if err := s.Insert(ctx, tx, []storage.Record{r}); err != nil {
							_ = tx.Rollback()
							b.Error(err)
							return
						}
						if err := tx.Commit(); err != nil {
							b.Error(err)
							return
						}
					}
				})
			})
		}
	}
}
