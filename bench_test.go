package txoutbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
)

// staticStorage hands out the same prepared batch on every claim and accepts
// every write-back: it isolates the forwarder's own hot path (group, build the
// message, run the chain, publish, ack bookkeeping) from any database.
type staticStorage struct {
	batch []storage.Record
	acked int
}

func (s *staticStorage) Claim(context.Context, storage.ClaimParams) ([]storage.Record, error) {
	return append([]storage.Record(nil), s.batch...), nil
}
func (s *staticStorage) Ack(_ context.Context, p storage.AckParams) error {
	s.acked += len(p.IDs)
	return nil
}
func (s *staticStorage) Nack(context.Context, storage.NackParams) error             { return nil }
func (s *staticStorage) Release(context.Context, storage.ReleaseParams) error       { return nil }
func (s *staticStorage) DeadLetter(context.Context, storage.DeadLetterParams) error { return nil }

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// BenchmarkForwarderRound measures one round over a claimed batch with a no-op
// target; allocations are reported per message (allocs/msg).
func BenchmarkForwarderRound(b *testing.B) {
	for _, tc := range []struct {
		batch, keys int
		timeout     bool
	}{
		{100, 1000, true}, {100, 1000, false}, {1000, 1000, true}, {1000, 10, true}, {1000, 0, true},
	} {
		name := fmt.Sprintf("batch=%d/keys=%d/timeout=%v", tc.batch, tc.keys, tc.timeout)
		b.Run(name, func(b *testing.B) {
			s := &staticStorage{}
			for i := range tc.batch {
				key := ""
				if tc.keys > 0 {
					key = fmt.Sprintf("key-%d", i%tc.keys)
				}
				s.batch = append(s.batch, storage.Record{
					ID: int64(i + 1), UUID: fmt.Sprintf("uuid-%d", i), Topic: "orders", Key: key,
					Payload: make([]byte, 256), Metadata: map[string]string{"a": "b"}, Attempts: 1, CreatedAt: time.Now(),
				})
			}
			cfg := txoutbox.ForwarderConfig{BatchSize: tc.batch}
			if !tc.timeout {
				cfg.PublishTimeout = txoutbox.NoPublishTimeout
			}
			f, err := txoutbox.NewForwarder(s, nopPublisher{}, cfg, nil)
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, err := f.RunOnce(ctx); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			msgs := float64(b.N * tc.batch)
			b.ReportMetric(msgs/b.Elapsed().Seconds(), "msgs/s")
			b.ReportMetric(float64(testing.AllocsPerRun(10, func() { _, _ = f.RunOnce(ctx) }))/float64(tc.batch), "allocs/msg")
		})
	}
}
