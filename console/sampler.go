package console

import (
	"context"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/txoutbox/txoutbox/storage"
)

// sample is one Stats reading of the sampler.
type sample struct {
	at    time.Time
	stats storage.Stats
	ok    bool // false: Stats failed
}

// sampler reads Stats every interval into a bounded ring, for the
// overview's chart. It starts on a view of the overview and stops by itself
// idle after the last one, so a console nobody looks at costs no queries;
// close stops it for good. One goroutine at most, owned by the sampler.
type sampler struct {
	store    storage.StatsReader
	interval time.Duration
	idle     time.Duration
	logger   watermill.LoggerAdapter
	ctx      context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	failing  bool // the last sample failed; only the loop goroutine uses it

	mu       sync.Mutex
	ring     []sample // ring[next] is the oldest once full
	next     int
	full     bool
	running  bool
	closed   bool
	lastView time.Time
}

func newSampler(store storage.StatsReader, interval time.Duration, n int, idle time.Duration, logger watermill.LoggerAdapter) *sampler {
	ctx, cancel := context.WithCancel(context.Background())
	return &sampler{store: store, interval: interval, idle: idle, logger: logger,
		ctx: ctx, cancel: cancel, ring: make([]sample, n)}
}

// viewed records a view of the overview and starts the sampling if it is
// not running.
func (s *sampler) viewed() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lastView = time.Now()
	if s.running || s.closed {
		return
	}
	s.running = true
	s.wg.Add(1)
	go s.loop()
}

func (s *sampler) loop() {
	defer s.wg.Done()
	t := time.NewTicker(s.interval)
	defer t.Stop()
	for {
		s.take()
		select {
		case <-s.ctx.Done():
			s.stopped()
			return
		case <-t.C:
		}
		s.mu.Lock()
		if time.Since(s.lastView) > s.idle {
			s.running = false
			s.mu.Unlock()
			return
		}
		s.mu.Unlock()
	}
}

func (s *sampler) stopped() {
	s.mu.Lock()
	s.running = false
	s.mu.Unlock()
}

func (s *sampler) take() {
	ctx, cancel := context.WithTimeout(s.ctx, max(s.interval, time.Second))
	st, err := s.store.Stats(ctx)
	cancel()
	if err != nil && s.ctx.Err() != nil {
		return // closing
	}
	if err != nil && !s.failing { // once per run of failures, not every interval
		s.logger.Error("txoutbox console: sample stats", err, nil)
	}
	s.failing = err != nil
	s.add(sample{at: time.Now(), stats: st, ok: err == nil})
}

func (s *sampler) add(x sample) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ring[s.next] = x
	s.next = (s.next + 1) % len(s.ring)
	if s.next == 0 {
		s.full = true
	}
}

// samples returns the ring's samples, oldest first.
func (s *sampler) samples() []sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.full {
		return append([]sample(nil), s.ring[:s.next]...)
	}
	return append(append([]sample(nil), s.ring[s.next:]...), s.ring[:s.next]...)
}

// latest returns the newest successful sample taken within maxAge.
func (s *sampler) latest(maxAge time.Duration) (sample, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	i := (s.next - 1 + len(s.ring)) % len(s.ring)
	x := s.ring[i]
	if x.at.IsZero() || !x.ok || time.Since(x.at) > maxAge {
		return sample{}, false
	}
	return x, true
}

func (s *sampler) close() {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
}

// isRunning reports whether the sampling goroutine runs (for tests).
func (s *sampler) isRunning() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.running
}
