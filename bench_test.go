package txoutbox_test

import (
	"cmp"
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
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
	s.acked += len(p.Records)
	return nil
}
func (s *staticStorage) Nack(context.Context, storage.NackParams) error             { return nil }
func (s *staticStorage) Release(context.Context, storage.ReleaseParams) error       { return nil }
func (s *staticStorage) DeadLetter(context.Context, storage.DeadLetterParams) error { return nil }
func (s *staticStorage) Extend(_ context.Context, p storage.ExtendParams) ([]int64, error) {
	return refIDs(p.Records), nil
}

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// BenchmarkForwarderRound measures one round over a claimed batch with a no-op
// target; allocations are reported per message (allocs/msg).
func BenchmarkForwarderRound(b *testing.B) {
	for _, tc := range []struct {
		batch, keys int
		timeout     bool
		// size is BatchSize when the claim returns fewer records (a claim
		// of what is pending under a steady load); 0: the claim fills it.
		size int
	}{
		{100, 1000, true, 0}, {100, 1000, false, 0}, {1000, 1000, true, 0}, {1000, 10, true, 0}, {1000, 0, true, 0},
		{100, 1000, true, 1000},
	} {
		name := fmt.Sprintf("batch=%d/keys=%d/timeout=%v", tc.batch, tc.keys, tc.timeout)
		if tc.size > 0 {
			name += fmt.Sprintf("/size=%d", tc.size)
		}
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
			cfg := txoutbox.ForwarderConfig{BatchSize: cmp.Or(tc.size, tc.batch)}
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

type sleepPublisher time.Duration

func (d sleepPublisher) Publish(_ string, msgs ...*message.Message) error {
	time.Sleep(time.Duration(d) * time.Duration(len(msgs)))
	return nil
}
func (sleepPublisher) Close() error { return nil }

// BenchmarkForwarderRoundHotKey measures a round of 1000 records whose last
// hot records share one key, published with 1 ms of simulated broker latency
// on the default 16 lanes: the round lasts at least as long as the hot key's
// records one after another, plus whatever the lanes did before they reached
// it (ms/round).
func BenchmarkForwarderRoundHotKey(b *testing.B) {
	for _, hot := range []int{10, 100} {
		b.Run(fmt.Sprintf("hot=%d", hot), func(b *testing.B) {
			s := &staticStorage{}
			for i := range 1000 {
				key := fmt.Sprintf("key-%d", i)
				if i >= 1000-hot {
					key = "hot"
				}
				s.batch = append(s.batch, storage.Record{
					ID: int64(i + 1), UUID: fmt.Sprintf("uuid-%d", i), Topic: "orders", Key: key,
					Payload: make([]byte, 256), Attempts: 1, CreatedAt: time.Now(),
				})
			}
			f, err := txoutbox.NewForwarder(s, sleepPublisher(time.Millisecond), txoutbox.ForwarderConfig{BatchSize: 1000}, nil)
			if err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				if _, err := f.RunOnce(context.Background()); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/round")
		})
	}
}

// streamStorage hands out fresh records on every claim, as many as asked,
// and counts acks: the forwarder's continuous flow over a bottomless table.
type streamStorage struct {
	mu    sync.Mutex
	next  int64
	keys  int
	acked atomic.Int64
	rec   storage.Record
}

func (s *streamStorage) Claim(_ context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]storage.Record, p.BatchSize)
	for i := range out {
		s.next++
		out[i] = s.rec
		out[i].ID = s.next
		if s.keys > 0 {
			out[i].Key = "key-" + strconv.Itoa(int(s.next)%s.keys)
		}
	}
	return out, nil
}
func (s *streamStorage) Ack(_ context.Context, p storage.AckParams) error {
	s.acked.Add(int64(len(p.Records)))
	return nil
}
func (s *streamStorage) Nack(context.Context, storage.NackParams) error             { return nil }
func (s *streamStorage) Release(context.Context, storage.ReleaseParams) error       { return nil }
func (s *streamStorage) DeadLetter(context.Context, storage.DeadLetterParams) error { return nil }
func (s *streamStorage) Extend(_ context.Context, p storage.ExtendParams) ([]int64, error) {
	return refIDs(p.Records), nil
}

// BenchmarkForwarderRun measures Run's continuous flow with a no-op target:
// one op is one message published and acked (ns/op is ns/msg).
func BenchmarkForwarderRun(b *testing.B) {
	for _, keys := range []int{0, 1000} {
		b.Run(fmt.Sprintf("batch=100/keys=%d", keys), func(b *testing.B) {
			s := &streamStorage{keys: keys, rec: storage.Record{
				UUID: "uuid", Topic: "orders", Payload: make([]byte, 256), Metadata: map[string]string{"a": "b"}, Attempts: 1, CreatedAt: time.Now(),
			}}
			f, err := txoutbox.NewForwarder(s, nopPublisher{}, txoutbox.ForwarderConfig{}, nil)
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			b.ReportAllocs()
			b.ResetTimer()
			go func() { defer close(done); _ = f.Run(ctx) }()
			for s.acked.Load() < int64(b.N) {
				time.Sleep(100 * time.Microsecond)
			}
			b.StopTimer()
			cancel()
			<-done
		})
	}
}
