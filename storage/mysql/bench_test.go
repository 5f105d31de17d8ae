package mysql

import (
	"fmt"
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
