package sqlite

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// BenchmarkClaimAck drains b.N pre-inserted records (1,000 or 10 keys,
// 256-byte payloads) with one worker: claim a batch, ack it. It reports msgs/s.
func BenchmarkClaimAck(b *testing.B) {
	for _, strict := range []bool{true, false} {
		for _, bk := range [][2]int{{100, 1000}, {1000, 1000}, {1000, 10}} {
			batch, keys := bk[0], bk[1]
			b.Run(fmt.Sprintf("strict=%v/batch=%d/keys=%d", strict, batch, keys), func(b *testing.B) {
				s := newTestStorage(b, Config{DisableStrictOrdering: !strict})
				payload := make([]byte, 256)
				records := make([]storage.Record, b.N)
				for i := range records {
					records[i] = storage.Record{UUID: fmt.Sprint(i), Topic: "t", Key: fmt.Sprintf("k%d", i%keys), Payload: payload,
						Metadata: map[string]string{"a": "b"}}
				}
				insert(b, s, records...)
				ctx := context.Background()
				b.ResetTimer()
				start := time.Now()
				done := 0
				for done < b.N {
					recs, err := s.Claim(ctx, storage.ClaimParams{BatchSize: batch, Lease: time.Minute, WorkerID: "w"})
					if err != nil {
						b.Fatal(err)
					}
					if len(recs) == 0 {
						b.Fatalf("claimed nothing after %d of %d", done, b.N)
					}
					if err := s.Ack(ctx, storage.AckParams{Records: storage.Refs(recs), WorkerID: "w"}); err != nil {
						b.Fatal(err)
					}
					done += len(recs)
				}
				b.ReportMetric(float64(done)/time.Since(start).Seconds(), "msgs/s")
			})
		}
	}
}
