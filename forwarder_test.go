package txoutbox_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/memory"
)

// delivery is one publish the recording target saw.
type delivery struct {
	Topic    string
	UUID     string
	Key      string
	ID       int64
	Attempt  int
	Payload  string
	Metadata message.Metadata
}

// recorder is a Watermill publisher that records what it receives. fail, when
// set, decides the outcome of each publish; delay is slept inside each publish.
type recorder struct {
	mu        sync.Mutex
	got       []delivery
	fail      func(d delivery) error
	delay     time.Duration
	inflight  map[string]int // per key
	cur, peak atomic.Int64
	overlap   atomic.Int64 // publishes that overlapped another of their key
	published chan struct{}
}

func newRecorder() *recorder {
	return &recorder{inflight: map[string]int{}, published: make(chan struct{}, 1<<16)}
}

func (r *recorder) Publish(topic string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		id, _ := strconv.ParseInt(msg.Metadata.Get(txoutbox.MetadataOutboxID), 10, 64)
		attempt, _ := strconv.Atoi(msg.Metadata.Get(txoutbox.MetadataAttempt))
		d := delivery{
			Topic: topic, UUID: msg.UUID, Key: msg.Metadata.Get(txoutbox.MetadataKey), ID: id,
			Attempt: attempt, Payload: string(msg.Payload), Metadata: maps.Clone(msg.Metadata),
		}
		if err := r.one(d); err != nil {
			return err
		}
	}
	return nil
}

func (r *recorder) one(d delivery) error {
	if n := r.cur.Add(1); n > r.peak.Load() {
		r.peak.Store(n)
	}
	defer r.cur.Add(-1)
	if d.Key != "" {
		r.mu.Lock()
		r.inflight[d.Key]++
		if r.inflight[d.Key] > 1 {
			r.overlap.Add(1)
		}
		r.mu.Unlock()
		defer func() {
			r.mu.Lock()
			r.inflight[d.Key]--
			r.mu.Unlock()
		}()
	}
	if r.delay > 0 {
		time.Sleep(r.delay) // simulated broker latency
	}
	r.mu.Lock()
	fail := r.fail
	r.mu.Unlock()
	if fail != nil {
		if err := fail(d); err != nil {
			return err
		}
	}
	r.mu.Lock()
	r.got = append(r.got, d)
	r.mu.Unlock()
	r.published <- struct{}{}
	return nil
}

func (r *recorder) Close() error { return nil }

func (r *recorder) deliveries() []delivery {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]delivery(nil), r.got...)
}

func (r *recorder) setFail(f func(d delivery) error) {
	r.mu.Lock()
	r.fail = f
	r.mu.Unlock()
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func record(topic, key, payload string) storage.Record {
	return storage.Record{UUID: watermill.NewUUID(), Topic: topic, Key: key, Payload: []byte(payload), Metadata: map[string]string{"producer": "test"}}
}

func newForwarder(t *testing.T, s storage.Storage, target message.Publisher, cfg txoutbox.ForwarderConfig) *txoutbox.Forwarder {
	t.Helper()
	f, err := txoutbox.NewForwarder(s, target, cfg, nil)
	if err != nil {
		t.Fatalf("NewForwarder: %v", err)
	}
	return f
}

// runForwarder runs f in the background and returns a stop function that
// cancels it and waits for Run to return.
func runForwarder(t *testing.T, f *txoutbox.Forwarder) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run returned %v, want nil after cancel", err)
				}
			case <-time.After(30 * time.Second):
				t.Errorf("Run did not return within 30s of cancel")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func fastConfig() txoutbox.ForwarderConfig {
	return txoutbox.ForwarderConfig{
		BatchSize:         20,
		Lease:             10 * time.Second,
		PollMin:           5 * time.Millisecond,
		PollMax:           20 * time.Millisecond,
		StorageErrorDelay: 10 * time.Millisecond,
		Backoff:           txoutbox.Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond, Jitter: txoutbox.NoJitter},
	}
}

// checkOrder fails when, per key, first deliveries are not in id order.
func checkOrder(t *testing.T, got []delivery) {
	t.Helper()
	last := map[string]int64{}
	seen := map[int64]bool{}
	for _, d := range got {
		if seen[d.ID] {
			continue
		}
		seen[d.ID] = true
		if d.Key == "" {
			continue
		}
		if d.ID < last[d.Key] {
			t.Errorf("key %q: record %d delivered after record %d: per-key order broken", d.Key, d.ID, last[d.Key])
		}
		last[d.Key] = d.ID
	}
}

func TestForwarderDeliversInOrderWithMetadata(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			var want []storage.Record
			for i := range 200 {
				key := fmt.Sprintf("k%d", i%7)
				if i%10 == 0 {
					key = ""
				}
				want = append(want, record("orders", key, fmt.Sprint(i)))
			}
			ids := b.insert(t, s, want...)
			target := newRecorder()
			stop := runForwarder(t, newForwarder(t, s, target, fastConfig()))
			waitFor(t, 20*time.Second, "all 200 records delivered", func() bool { return len(target.deliveries()) >= len(want) })
			stop()

			got := target.deliveries()
			if len(got) != len(want) {
				t.Fatalf("delivered %d records, want %d (no failures, so no duplicates)", len(got), len(want))
			}
			byID := map[int64]delivery{}
			for _, d := range got {
				byID[d.ID] = d
			}
			for i, id := range ids {
				d, ok := byID[id]
				if !ok {
					t.Fatalf("record %d never delivered", id)
				}
				if d.UUID != want[i].UUID || d.Payload != string(want[i].Payload) || d.Key != want[i].Key || d.Topic != "orders" {
					t.Errorf("record %d delivered as %+v, want uuid %s payload %q key %q topic orders", id, d, want[i].UUID, want[i].Payload, want[i].Key)
				}
				if d.Attempt != 1 || d.Metadata.Get("producer") != "test" || d.Metadata.Get(txoutbox.MetadataCreatedAt) == "" {
					t.Errorf("record %d metadata %v: want attempt 1, producer metadata kept, created_at set", id, d.Metadata)
				}
			}
			checkOrder(t, got)
			if target.overlap.Load() != 0 {
				t.Errorf("%d publishes overlapped another publish of the same key", target.overlap.Load())
			}
		})
	}
}

func TestForwarderFailureHoldsBackKeyOnly(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			var recs []storage.Record
			for i := range 5 {
				recs = append(recs, record("t", "bad", fmt.Sprint("bad", i)), record("t", "good", fmt.Sprint("good", i)))
			}
			ids := b.insert(t, s, recs...)
			badFirst := ids[0]

			var failures atomic.Int64
			target := newRecorder()
			target.setFail(func(d delivery) error {
				if d.ID == badFirst && failures.Load() < 2 {
					failures.Add(1)
					return errors.New("broker says no")
				}
				return nil
			})
			f := newForwarder(t, s, target, fastConfig())
			res, err := f.RunOnce(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if res.Claimed != 10 || res.Published != 5 || res.Nacked != 1 || res.Released != 4 {
				t.Fatalf("first round %+v: want 10 claimed, 5 published (key good), 1 nacked, 4 released (behind the failure)", res)
			}
			for _, d := range target.deliveries() {
				if d.Key != "good" {
					t.Fatalf("record %d of key %q published although an earlier record of its key failed", d.ID, d.Key)
				}
			}
			stop := runForwarder(t, f)
			waitFor(t, 20*time.Second, "all records delivered after recovery", func() bool { return len(target.deliveries()) >= 10 })
			stop()
			got := target.deliveries()
			checkOrder(t, got)
			attempts := map[int64]int{}
			for _, d := range got {
				attempts[d.ID] = d.Attempt
			}
			if attempts[badFirst] != 3 {
				t.Errorf("failing record delivered on attempt %d, want 3 (two failures then success)", attempts[badFirst])
			}
			for _, id := range ids[2:] {
				if attempts[id] != 1 {
					t.Errorf("record %d delivered on attempt %d, want 1: released records must not burn attempts", id, attempts[id])
				}
			}
			if b.inspect != nil {
				if st := b.inspect(t, s, badFirst); st.Status != storage.StatusDelivered {
					t.Errorf("failing record is %s after success, want delivered", st.Status)
				}
			}
		})
	}
}

func TestForwarderDeadLettersAfterMaxAttempts(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			ids := b.insert(t, s, record("t", "k", "poison"), record("t", "k", "next"), record("t", "", "other"))
			target := newRecorder()
			target.setFail(func(d delivery) error {
				if d.ID == ids[0] {
					return errors.New("always fails")
				}
				return nil
			})
			cfg := fastConfig()
			cfg.MaxAttempts = 3
			f := newForwarder(t, s, target, cfg)
			stop := runForwarder(t, f)
			waitFor(t, 20*time.Second, "the two healthy records delivered", func() bool { return len(target.deliveries()) >= 2 })
			stop()
			got := target.deliveries()
			if len(got) != 2 || got[len(got)-1].Payload != "next" && got[0].Payload != "next" {
				t.Fatalf("got %+v, want the two healthy records", got)
			}
			if b.inspect != nil {
				st := b.inspect(t, s, ids[0])
				if st.Status != storage.StatusDead || st.Attempts != 3 || st.LastError == "" {
					t.Fatalf("poison record state %+v: want dead after 3 attempts with the error recorded", st)
				}
			}
			// Parked for good: a further round claims nothing.
			res, err := f.RunOnce(context.Background())
			if err != nil || res.Claimed != 0 {
				t.Fatalf("round after dead-letter: %+v, %v; want nothing claimed", res, err)
			}
		})
	}
}

func TestForwarderPublishTimeout(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			ids := b.insert(t, s, record("t", "k", "slow"))
			release := make(chan struct{})
			defer close(release)
			var calls atomic.Int64
			target := newRecorder()
			target.setFail(func(d delivery) error {
				if calls.Add(1) == 1 {
					<-release // hang past the timeout, ignoring the context
				}
				return nil
			})
			cfg := fastConfig()
			cfg.PublishTimeout = 50 * time.Millisecond
			f := newForwarder(t, s, target, cfg)
			res, err := f.RunOnce(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if res.Nacked != 1 || res.Published != 0 {
				t.Fatalf("round %+v: want the hung publish nacked", res)
			}
			if b.inspect != nil {
				if st := b.inspect(t, s, ids[0]); st.LastError == "" || st.LeasedBy != "" {
					t.Fatalf("state %+v: want the timeout recorded and the lease ended", st)
				}
			}
		})
	}
}

func TestForwarderGracefulShutdown(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			var recs []storage.Record
			for range 10 {
				recs = append(recs, record("t", "one-key", "x"))
			}
			ids := b.insert(t, s, recs...)
			entered := make(chan struct{})
			proceed := make(chan struct{})
			target := newRecorder()
			target.setFail(func(d delivery) error {
				if d.ID == ids[2] {
					close(entered)
					<-proceed
				}
				return nil
			})
			cfg := fastConfig()
			cfg.BatchSize = 10
			f := newForwarder(t, s, target, cfg)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			var res txoutbox.RunOnceResult
			var err error
			go func() { res, err = f.RunOnce(ctx); close(done) }()
			<-entered
			cancel() // stop while record 3 is in flight
			close(proceed)
			<-done
			if err != nil {
				t.Fatal(err)
			}
			if res.Published != 3 || res.Released != 7 {
				t.Fatalf("round %+v: want the in-flight publish finished (3 published) and 7 released untried", res)
			}
			if b.inspect != nil {
				for i, id := range ids {
					st := b.inspect(t, s, id)
					if st.LeasedBy != "" {
						t.Errorf("record %d still leased to %q after shutdown", id, st.LeasedBy)
					}
					if i >= 3 && (st.Status != storage.StatusPending || st.Attempts != 0) {
						t.Errorf("untried record %d: %+v, want pending with attempts 0", id, st)
					}
				}
			}
			// The released records are claimable again at once, in order.
			f2 := newForwarder(t, s, target, cfg)
			res, err = f2.RunOnce(context.Background())
			if err != nil || res.Published != 7 {
				t.Fatalf("second forwarder: %+v, %v; want the 7 released records", res, err)
			}
			checkOrder(t, target.deliveries())
		})
	}
}

func TestForwarderMiddlewareSeesDelivery(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			s := b.new(t)
			ids := b.insert(t, s, record("orders", "k1", "a"))
			var order []string
			var seen txoutbox.Delivery
			mw := func(name string) message.HandlerMiddleware {
				return func(h message.HandlerFunc) message.HandlerFunc {
					return func(msg *message.Message) ([]*message.Message, error) {
						order = append(order, name)
						if d, ok := txoutbox.DeliveryFromContext(msg.Context()); ok {
							seen = d
						}
						return h(msg)
					}
				}
			}
			cfg := fastConfig()
			cfg.Middlewares = []message.HandlerMiddleware{mw("outer"), mw("inner")}
			target := newRecorder()
			if _, err := newForwarder(t, s, target, cfg).RunOnce(context.Background()); err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(order) != "[outer inner]" {
				t.Errorf("middleware ran as %v, want [outer inner]", order)
			}
			if seen.Record.ID != ids[0] || seen.Topic != "orders" || seen.Record.Key != "k1" || seen.Record.Attempts != 1 {
				t.Errorf("middleware saw delivery %+v", seen)
			}
			if got := target.deliveries(); len(got) != 1 || got[0].Metadata.Get(txoutbox.MetadataOutboxID) != strconv.FormatInt(ids[0], 10) {
				t.Errorf("target got %+v", got)
			}
		})
	}
}

func TestForwarderPanickingTargetIsRetried(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			s := b.new(t)
			b.insert(t, s, record("t", "", "boom"))
			var n atomic.Int64
			target := newRecorder()
			target.setFail(func(delivery) error {
				if n.Add(1) == 1 {
					panic("target bug")
				}
				return nil
			})
			f := newForwarder(t, s, target, fastConfig())
			res, err := f.RunOnce(context.Background())
			if err != nil || res.Nacked != 1 {
				t.Fatalf("round %+v, %v: want the panic turned into a nack", res, err)
			}
			stop := runForwarder(t, f)
			waitFor(t, 10*time.Second, "redelivery after the panic", func() bool { return len(target.deliveries()) == 1 })
			stop()
		})
	}
}

func TestForwarderParallelGroups(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			s := b.new(t)
			var recs []storage.Record
			for i := range 40 {
				recs = append(recs, record("t", fmt.Sprintf("k%d", i%8), "x"))
			}
			b.insert(t, s, recs...)
			target := newRecorder()
			target.delay = 5 * time.Millisecond
			cfg := fastConfig()
			cfg.BatchSize = 40
			cfg.Concurrency = 4
			res, err := newForwarder(t, s, target, cfg).RunOnce(context.Background())
			if err != nil || res.Published != 40 {
				t.Fatalf("round %+v, %v", res, err)
			}
			if p := target.peak.Load(); p < 2 || p > 4 {
				t.Errorf("peak concurrent publishes %d, want between 2 and Concurrency=4", p)
			}
			if target.overlap.Load() != 0 {
				t.Errorf("%d publishes overlapped another of their key", target.overlap.Load())
			}
			checkOrder(t, target.deliveries())
		})
	}
}

// TestForwarderLongestGroupFirst: a key with many records in a batch starts
// publishing at once, not after every shorter group: published one after
// another, its records would otherwise keep the round running long after the
// other lanes ran dry. With one lane the batch goes out in id order.
func TestForwarderLongestGroupFirst(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			s := b.new(t)
			var recs []storage.Record
			for i := range 20 {
				recs = append(recs, record("t", fmt.Sprintf("single%d", i), "x"))
			}
			for range 10 {
				recs = append(recs, record("t", "hot", "x"))
			}
			for range 3 {
				recs = append(recs, record("t", "", "x"))
			}
			b.insert(t, s, recs...)
			cfg := fastConfig()
			cfg.BatchSize = len(recs)
			cfg.Concurrency = 4
			// The first publish of each lane waits until every lane has
			// started one, so the first Concurrency publishes started are the
			// first group of each lane, whatever the scheduling.
			target := newRecorder()
			var mu sync.Mutex
			var started []string
			wave := make(chan struct{})
			target.setFail(func(d delivery) error {
				mu.Lock()
				started = append(started, d.Key)
				n := len(started)
				mu.Unlock()
				if n == cfg.Concurrency {
					close(wave)
				}
				if n <= cfg.Concurrency {
					select {
					case <-wave:
					case <-time.After(5 * time.Second):
					}
				}
				return nil
			})
			if res, err := newForwarder(t, s, target, cfg).RunOnce(context.Background()); err != nil || res.Published != len(recs) {
				t.Fatalf("round %+v, %v", res, err)
			}
			if !slices.Contains(started[:cfg.Concurrency], "hot") {
				t.Errorf("the first publishes of the %d lanes were of keys %q: want the 10-record key among them", cfg.Concurrency, started[:cfg.Concurrency])
			}
			checkOrder(t, target.deliveries())

			// One lane: id order across keys.
			s = b.new(t)
			ids := b.insert(t, s, recs...)
			cfg.Concurrency = 1
			target = newRecorder()
			if res, err := newForwarder(t, s, target, cfg).RunOnce(context.Background()); err != nil || res.Published != len(recs) {
				t.Fatalf("round %+v, %v", res, err)
			}
			var order []int64
			for _, d := range target.deliveries() {
				order = append(order, d.ID)
			}
			if !slices.Equal(order, ids) {
				t.Errorf("with Concurrency 1 published %v, want id order %v", order, ids)
			}
		})
	}
}

func TestForwarderWakeCutsIdleSleep(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			s := b.new(t)
			target := newRecorder()
			cfg := fastConfig()
			cfg.PollMin = time.Hour
			cfg.PollMax = time.Hour
			counting := &countingStorage{Storage: s}
			f := newForwarder(t, counting, target, cfg)
			stop := runForwarder(t, f)
			waitFor(t, 5*time.Second, "the first (empty) claim", func() bool { return counting.claims.Load() >= 1 })
			b.insert(t, s, record("t", "", "woken"))
			f.Wake()
			waitFor(t, 10*time.Second, "delivery after Wake (poll interval is an hour)", func() bool { return len(target.deliveries()) == 1 })
			stop()
		})
	}
}

func TestForwarderIdlePollingBacksOff(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			counting := &countingStorage{Storage: b.new(t)}
			cfg := fastConfig()
			cfg.PollMin = 5 * time.Millisecond
			cfg.PollMax = 200 * time.Millisecond
			stop := runForwarder(t, newForwarder(t, counting, newRecorder(), cfg))
			// Without backoff an empty table would be claimed every 5 ms: 100+
			// times in 600 ms. With factor 2 up to 200 ms it is about 10.
			time.Sleep(600 * time.Millisecond) // the observation window, not synchronisation
			stop()
			if n := counting.claims.Load(); n > 20 || n < 3 {
				t.Errorf("%d claims in 600ms on an empty table: want idle backoff from 5ms to 200ms (about 10)", n)
			}
		})
	}
}

func TestForwarderSurvivesStorageErrors(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			s := b.new(t)
			b.insert(t, s, record("t", "k", "a"), record("t", "k", "b"))
			flaky := &countingStorage{Storage: s}
			flaky.failClaims.Store(3)
			target := newRecorder()
			stop := runForwarder(t, newForwarder(t, flaky, target, fastConfig()))
			waitFor(t, 10*time.Second, "delivery after three failed claims", func() bool { return len(target.deliveries()) == 2 })
			stop()
			if n := flaky.claims.Load(); n < 4 {
				t.Errorf("%d claims, want at least 4 (3 failed, then success)", n)
			}
		})
	}
}

func TestForwarderDeadLettersUndecodableRecord(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			s := b.new(t)
			ids := b.insert(t, s, record("t", "k", "corrupt"), record("t", "k", "fine"))
			corrupt := &countingStorage{Storage: s, corruptID: ids[0]}
			target := newRecorder()
			res, err := newForwarder(t, corrupt, target, fastConfig()).RunOnce(context.Background())
			if err != nil || res.DeadLettered != 1 || res.Published != 1 {
				t.Fatalf("round %+v, %v: want the undecodable record dead-lettered and its key going on", res, err)
			}
			if b.inspect != nil {
				if st := b.inspect(t, s, ids[0]); st.Status != storage.StatusDead {
					t.Fatalf("undecodable record is %s, want dead", st.Status)
				}
			}
		})
	}
}

func TestForwarderConfigValidation(t *testing.T) {
	s := &countingStorage{}
	for _, tc := range []struct {
		name string
		cfg  txoutbox.ForwarderConfig
		want string
	}{
		{"negative batch", txoutbox.ForwarderConfig{BatchSize: -1}, "BatchSize must be > 0"},
		{"negative concurrency", txoutbox.ForwarderConfig{Concurrency: -2}, "Concurrency must be > 0"},
		{"poll max below min", txoutbox.ForwarderConfig{PollMin: time.Second, PollMax: time.Millisecond}, "PollMax (1ms) must be >= PollMin (1s)"},
		{"backoff factor", txoutbox.ForwarderConfig{Backoff: txoutbox.Backoff{Factor: 0.5}}, "Backoff.Factor"},
		{"jitter", txoutbox.ForwarderConfig{Backoff: txoutbox.Backoff{Jitter: 2}}, "Backoff.Jitter must be in [0, 1]"},
		{"nil middleware", txoutbox.ForwarderConfig{Middlewares: []message.HandlerMiddleware{nil}}, "Middlewares[0] is nil"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := txoutbox.NewForwarder(s, newRecorder(), tc.cfg, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("NewForwarder error %v, want one naming %q", err, tc.want)
			}
		})
	}
	if _, err := txoutbox.NewForwarder(nil, newRecorder(), txoutbox.ForwarderConfig{}, nil); err == nil {
		t.Error("nil storage accepted")
	}
	if _, err := txoutbox.NewForwarder(s, nil, txoutbox.ForwarderConfig{}, nil); err == nil {
		t.Error("nil target accepted")
	}
}

// The zero config must not warn against itself (it used to log
// ErrLeaseTooShort from every NewForwarder), and a PublishTimeout that leaves
// the lease renewal no room is refused, naming the field and the bound.
func TestForwarderZeroConfigDoesNotWarn(t *testing.T) {
	logger := &captureLogger{}
	f, err := txoutbox.NewForwarder(&countingStorage{}, newRecorder(), txoutbox.ForwarderConfig{}, logger)
	if err != nil {
		t.Fatal(err)
	}
	if n := logger.count(); n != 0 {
		t.Fatalf("zero config logged %d errors, want none", n)
	}
	cfg := f.Config()
	if cfg.MaxInFlight != txoutbox.BatchSizeDefault || cfg.MaxAbandonedPublishes != txoutbox.ConcurrencyDefault {
		t.Errorf("defaults MaxInFlight %d, MaxAbandonedPublishes %d", cfg.MaxInFlight, cfg.MaxAbandonedPublishes)
	}
	_, err = txoutbox.NewForwarder(&countingStorage{}, newRecorder(), txoutbox.ForwarderConfig{Lease: 500 * time.Millisecond, PublishTimeout: 500 * time.Millisecond}, nil)
	if err == nil || !strings.Contains(err.Error(), "PublishTimeout") || !strings.Contains(err.Error(), "Lease/2 (250ms)") {
		t.Fatalf("PublishTimeout 500ms with Lease 500ms: err %v, want one naming PublishTimeout and Lease/2 (250ms)", err)
	}
}

func TestBackoffDelay(t *testing.T) {
	b := txoutbox.Backoff{Base: time.Second, Factor: 2, Max: 10 * time.Second}
	for attempt, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 4: 8 * time.Second, 5: 10 * time.Second, 50: 10 * time.Second} {
		if got := b.Delay(attempt); got != want {
			t.Errorf("Delay(%d) = %s, want %s", attempt, got, want)
		}
	}
	b.Jitter = 0.5
	for range 1000 {
		if d := b.Delay(2); d < time.Second || d > 3*time.Second {
			t.Fatalf("Delay(2) with jitter 0.5 = %s, want within [1s, 3s]", d)
		}
	}
}

// countingStorage wraps a storage: it counts claims, can fail the next claims,
// and can mark one record as undecodable.
type countingStorage struct {
	storage.Storage
	claims     atomic.Int64
	failClaims atomic.Int64
	corruptID  int64
}

func (c *countingStorage) Claim(ctx context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	c.claims.Add(1)
	if c.failClaims.Add(-1) >= 0 {
		return nil, errors.New("injected claim failure")
	}
	recs, err := c.Storage.Claim(ctx, p)
	for i := range recs {
		if recs[i].ID == c.corruptID {
			recs[i].DecodeError = errors.New("metadata: invalid JSON")
		}
	}
	return recs, err
}

type captureLogger struct {
	mu   sync.Mutex
	errs []error
	msgs []string
}

func (l *captureLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	l.errs = append(l.errs, err)
	l.msgs = append(l.msgs, msg)
	l.mu.Unlock()
}

// countMsg counts the errors logged with a message that starts with prefix.
func (l *captureLogger) countMsg(prefix string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, m := range l.msgs {
		if strings.HasPrefix(m, prefix) {
			n++
		}
	}
	return n
}
func (l *captureLogger) Info(string, watermill.LogFields)  {}
func (l *captureLogger) Debug(string, watermill.LogFields) {}
func (l *captureLogger) Trace(string, watermill.LogFields) {}
func (l *captureLogger) With(watermill.LogFields) watermill.LoggerAdapter {
	return l
}
func (l *captureLogger) has(target error) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, err := range l.errs {
		if errors.Is(err, target) {
			return true
		}
	}
	return false
}

func (l *captureLogger) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.errs)
}

func errorsIs(err, target error) bool { return errors.Is(err, target) }

func TestForwarderTimeoutAbandonsLaneAndGoesOn(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			ids := b.insert(t, s,
				record("t", "stuck", "hang"), record("t", "stuck", "behind"),
				record("t", "other", "a"), record("t", "", "b"))
			hang := make(chan struct{})
			defer close(hang)
			target := newRecorder()
			target.setFail(func(d delivery) error {
				if d.ID == ids[0] && d.Attempt == 1 {
					<-hang // ignores the context, like Sarama's sync producer
				}
				return nil
			})
			cfg := fastConfig()
			cfg.Concurrency = 1 // the replacement lane must take over the other groups
			// One abandoned publish is below the bound: the lanes go on.
			cfg.MaxAbandonedPublishes = 2
			cfg.PublishTimeout = 100 * time.Millisecond
			res, err := newForwarder(t, s, target, cfg).RunOnce(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if res.Nacked != 1 || res.Released != 1 || res.Published != 2 {
				t.Fatalf("round %+v: want the hung record nacked, the one behind it released, the 2 others published", res)
			}
			if b.inspect != nil {
				st := b.inspect(t, s, ids[0])
				if !strings.Contains(st.LastError, txoutbox.ErrPublishTimeout.Error()) {
					t.Errorf("hung record's last error %q, want a publish timeout", st.LastError)
				}
				if st := b.inspect(t, s, ids[1]); st.Attempts != 0 || st.LeasedBy != "" {
					t.Errorf("record behind the hung one: %+v, want released with attempts 0", st)
				}
			}
		})
	}
}

func TestForwarderTimeoutOnLastAttemptDeadLettersAndKeyGoesOn(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			ids := b.insert(t, s, record("t", "k", "hang"), record("t", "k", "next"))
			hang := make(chan struct{})
			defer close(hang)
			target := newRecorder()
			target.setFail(func(d delivery) error {
				if d.ID == ids[0] {
					<-hang
				}
				return nil
			})
			cfg := fastConfig()
			cfg.MaxAttempts = 1
			cfg.PublishTimeout = 100 * time.Millisecond
			res, err := newForwarder(t, s, target, cfg).RunOnce(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if res.DeadLettered != 1 || res.Published != 1 {
				t.Fatalf("round %+v: want the hung record dead-lettered and the next of its key published", res)
			}
		})
	}
}

func TestForwarderContextHonouringTargetSeesDeadline(t *testing.T) {
	s := memory.New(memory.Config{})
	s.Add(record("t", "k", "x"))
	var sawDeadline atomic.Bool
	target := publisherFunc(func(topic string, msgs ...*message.Message) error {
		ctx := msgs[0].Context()
		if _, ok := ctx.Deadline(); ok {
			sawDeadline.Store(true)
		}
		<-ctx.Done() // an AMQP-like target waiting on its context
		return ctx.Err()
	})
	cfg := fastConfig()
	cfg.PublishTimeout = 50 * time.Millisecond
	res, err := newForwarder(t, s, target, cfg).RunOnce(context.Background())
	if err != nil || res.Nacked != 1 {
		t.Fatalf("round %+v, %v: want the publish nacked at its deadline", res, err)
	}
	if !sawDeadline.Load() {
		t.Error("the message context had no deadline")
	}
}

func TestForwarderHardStopAbandonsHungPublish(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			ids := b.insert(t, s, record("t", "k", "hang"), record("t", "k", "behind"), record("t", "", "untried"))
			hang := make(chan struct{})
			defer close(hang)
			entered := make(chan struct{})
			target := newRecorder()
			target.setFail(func(d delivery) error {
				if d.ID == ids[0] {
					close(entered)
					<-hang
				}
				return nil
			})
			cfg := fastConfig()
			cfg.Concurrency = 1
			cfg.PublishTimeout = time.Minute
			cfg.Lease = 2 * time.Minute
			cfg.ShutdownTimeout = 100 * time.Millisecond
			f := newForwarder(t, s, target, cfg)
			ctx, cancel := context.WithCancel(context.Background())
			type out struct {
				res txoutbox.RunOnceResult
				err error
			}
			done := make(chan out, 1)
			go func() { r, err := f.RunOnce(ctx); done <- out{r, err} }()
			<-entered
			cancel()
			var o out
			select {
			case o = <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("RunOnce did not return after the shutdown bound")
			}
			if o.err != nil || o.res.Nacked != 1 || o.res.Released != 2 {
				t.Fatalf("round %+v, %v: want the hung publish abandoned (nacked) and 2 released", o.res, o.err)
			}
			if b.inspect != nil {
				for _, id := range ids {
					if st := b.inspect(t, s, id); st.LeasedBy != "" {
						t.Errorf("record %d still leased after the hard stop", id)
					}
				}
			}
		})
	}
}

type publisherFunc func(topic string, msgs ...*message.Message) error

func (f publisherFunc) Publish(topic string, msgs ...*message.Message) error {
	return f(topic, msgs...)
}
func (publisherFunc) Close() error { return nil }

func TestForwarderOnOutcomeReportsEveryRecord(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			ids := b.insert(t, s, record("t", "k", "fails"), record("t", "k", "behind"), record("t", "", "ok"), record("t", "p", "poison"))
			target := newRecorder()
			target.setFail(func(d delivery) error {
				if d.ID == ids[0] || d.ID == ids[3] {
					return errors.New("no")
				}
				return nil
			})
			var mu sync.Mutex
			got := map[int64]txoutbox.OutcomeKind{}
			cfg := fastConfig()
			cfg.MaxAttempts = 1
			cfg.OnOutcome = func(o txoutbox.Outcome) {
				mu.Lock()
				defer mu.Unlock()
				if o.StorageErr != nil {
					t.Errorf("write-back of %d failed: %v", o.Record.ID, o.StorageErr)
				}
				got[o.Record.ID] = o.Kind
			}
			// Record 1 fails on its last attempt: dead-lettered, and its key goes on.
			res, err := newForwarder(t, s, target, cfg).RunOnce(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			want := map[int64]txoutbox.OutcomeKind{
				ids[0]: txoutbox.OutcomeDeadLettered, ids[1]: txoutbox.OutcomePublished,
				ids[2]: txoutbox.OutcomePublished, ids[3]: txoutbox.OutcomeDeadLettered,
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("outcomes %v, want %v", got, want)
			}
			if res.Claimed != 4 || res.Published != 2 || res.DeadLettered != 2 {
				t.Errorf("RunOnce = %+v, want 4 claimed, 2 published, 2 dead-lettered", res)
			}
		})
	}
}

// Without a publish timeout the lane runs on the round's own goroutine; its
// published records must still be acked, with one lane or several.
func TestForwarderAcksWithoutPublishTimeout(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			for _, concurrency := range []int{1, 4} {
				s := b.new(t)
				ids := b.insert(t, s, record("t", "k", "a"), record("t", "k", "b"), record("t", "", "c"))
				cfg := fastConfig()
				cfg.PublishTimeout = txoutbox.NoPublishTimeout
				cfg.Concurrency = concurrency
				f := newForwarder(t, s, newRecorder(), cfg)
				res, err := f.RunOnce(context.Background())
				if err != nil || res.Published != 3 {
					t.Fatalf("concurrency %d: round %+v, %v: want 3 published and acked", concurrency, res, err)
				}
				if b.inspect != nil {
					for _, id := range ids {
						if st := b.inspect(t, s, id); st.Status != storage.StatusDelivered {
							t.Errorf("concurrency %d: record %d is %s after the round, want delivered", concurrency, id, st.Status)
						}
					}
				}
				if res, err := f.RunOnce(context.Background()); err != nil || res.Claimed != 0 {
					t.Errorf("concurrency %d: next round %+v, %v: want nothing left to claim", concurrency, res, err)
				}
			}
		})
	}
}

