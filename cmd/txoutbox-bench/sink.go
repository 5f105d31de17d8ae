package main

import (
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// metaSent holds when the message was built, just before its producer's
// transaction begins (unix nanoseconds): the start of its latency.
const metaSent = "bench_sent"

// sink is the broker both relays publish to: it sleeps the simulated broker
// latency once per Publish call and counts every delivery by message index,
// so losses, duplicates and per-key reorders can be counted exactly.
type sink struct {
	latency time.Duration
	keys    int
	keyOf   func(int) int // the key of a message index

	counts   []atomic.Int32 // deliveries per message index
	lastIdx  []atomic.Int64 // highest index delivered per key
	unique   atomic.Int64
	total    atomic.Int64
	reorders atomic.Int64
	bad      atomic.Int64 // UUIDs the bench did not produce

	target   int64
	done     chan struct{}
	doneOnce sync.Once
	doneAt   atomic.Int64 // unix nanos of the delivery that completed the target
	// unix nanos when a tenth and nine tenths of the target were delivered:
	// the sustained rate leaves out the start and the tail of a drain.
	tenthAt, nineTenthsAt atomic.Int64
	// marks[i] (unix nanos): when i percent of the target had been
	// delivered, for the progress curves of the plots.
	marks [101]atomic.Int64

	recordLatency bool
	// recordFrom (unix nanos): latencies of messages sent before it are not
	// recorded (a warm-up); 0 records all.
	recordFrom atomic.Int64
	mu         sync.Mutex
	latencies  []time.Duration
	// recorded: the message index and the delivery time (unix nanos) of
	// each latency in latencies, in the same order.
	recorded []delivery
	// committed (unix nanos, by message index, when latencies are
	// recorded): when the Commit of the producer's transaction returned; 0
	// until it has. It splits a latency into the producer's part (from the
	// send stamp, taken as the message is built before its transaction
	// begins, to the commit: BEGIN, the insert and the commit) and the
	// relay's (the commit to the delivery).
	committed []atomic.Int64
}

// delivery is a message index and when it was delivered (unix nanos).
type delivery struct {
	idx int
	at  int64
}

func newSink(n, keys int, keyOf func(int) int, latency time.Duration, recordLatency bool) *sink {
	if keyOf == nil && keys > 0 {
		keyOf = func(i int) int { return i % keys }
	}
	s := &sink{
		latency:       latency,
		keys:          keys,
		keyOf:         keyOf,
		counts:        make([]atomic.Int32, n),
		target:        int64(n),
		done:          make(chan struct{}),
		recordLatency: recordLatency,
	}
	if recordLatency {
		s.committed = make([]atomic.Int64, n)
	}
	if keys > 0 {
		s.lastIdx = make([]atomic.Int64, keys)
		for i := range s.lastIdx {
			s.lastIdx[i].Store(-1)
		}
	}
	if n == 0 {
		close(s.done)
	}
	return s
}

// Publish implements message.Publisher.
func (s *sink) Publish(_ string, msgs ...*message.Message) error {
	if s.latency > 0 {
		time.Sleep(s.latency)
	}
	now := time.Now()
	for _, m := range msgs {
		idx, ok := parseUUID(m.UUID)
		if !ok || idx >= len(s.counts) {
			s.bad.Add(1)
			continue
		}
		s.total.Add(1)
		if s.keys > 0 {
			last := &s.lastIdx[s.keyOf(idx)]
			for {
				cur := last.Load()
				if int64(idx) < cur {
					s.reorders.Add(1)
					break
				}
				if last.CompareAndSwap(cur, int64(idx)) {
					break
				}
			}
		}
		if s.recordLatency {
			if sent, err := strconv.ParseInt(m.Metadata.Get(metaSent), 10, 64); err == nil && sent >= s.recordFrom.Load() {
				s.mu.Lock()
				s.latencies = append(s.latencies, now.Sub(time.Unix(0, sent)))
				s.recorded = append(s.recorded, delivery{idx, now.UnixNano()})
				s.mu.Unlock()
			}
		}
		if s.counts[idx].Add(1) != 1 {
			continue
		}
		u := s.unique.Add(1)
		if step := max(s.target/100, 1); u%step == 0 && u/step <= 100 {
			s.marks[u/step].Store(now.UnixNano())
		}
		switch u {
		case s.target / 10:
			s.tenthAt.Store(time.Now().UnixNano())
		case s.target * 9 / 10:
			s.nineTenthsAt.Store(time.Now().UnixNano())
		}
		if u == s.target {
			s.doneOnce.Do(func() {
				s.doneAt.Store(time.Now().UnixNano())
				close(s.done)
			})
		}
	}
	return nil
}

// Close implements message.Publisher.
func (s *sink) Close() error { return nil }

// point is one point of a plotted curve.
type point struct{ x, y float64 }

// curve returns the fraction of the target delivered against the seconds
// since start, at each percent reached.
func (s *sink) curve(start time.Time) []point {
	pts := []point{{0, 0}}
	step := max(s.target/100, 1)
	for i := range s.marks {
		if at := s.marks[i].Load(); at > 0 {
			pts = append(pts, point{time.Unix(0, at).Sub(start).Seconds(), float64(int64(i)*step) / float64(s.target)})
		}
	}
	return pts
}

// missing returns the UUIDs of up to n messages not delivered yet.
func (s *sink) missing(n int) []string {
	var out []string
	for i := range s.counts {
		if len(out) == n {
			break
		}
		if s.counts[i].Load() == 0 {
			out = append(out, makeUUID(i))
		}
	}
	return out
}

// losses counts messages never delivered.
func (s *sink) losses() int64 { return s.target - s.unique.Load() }

// duplicates counts deliveries beyond the first of each message.
func (s *sink) duplicates() int64 { return s.total.Load() - s.unique.Load() }

// makeUUID encodes a message index as a UUID-shaped string (36 bytes, so it
// fits watermill-sql's VARCHAR(36)).
func makeUUID(i int) string {
	const prefix = "00000000-0000-4000-8000-"
	b := make([]byte, 0, 36)
	b = append(b, prefix...)
	d := strconv.Itoa(i)
	for range 12 - len(d) {
		b = append(b, '0')
	}
	return string(append(b, d...))
}

func parseUUID(u string) (int, bool) {
	if len(u) != 36 || u[:24] != "00000000-0000-4000-8000-" {
		return 0, false
	}
	n, err := strconv.Atoi(u[24:])
	return n, err == nil && n >= 0
}

// commit records that the transaction of the messages ids has committed
// (its producer's Commit returned at now).
func (s *sink) commit(ids []int, now time.Time) {
	if s.committed == nil {
		return
	}
	for _, i := range ids {
		if i < len(s.committed) {
			s.committed[i].Store(now.UnixNano())
		}
	}
}

// relayLatencies returns, for each recorded latency whose commit was
// recorded, the time from the commit to the delivery: the relay's part. A
// relay can deliver a message before its producer's Commit call has
// returned (the transaction is committed in the database before the
// producer's goroutine hears of it); that counts as 0.
func (s *sink) relayLatencies() []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]time.Duration, 0, len(s.recorded))
	for _, d := range s.recorded {
		if c := s.committed[d.idx].Load(); c > 0 {
			out = append(out, time.Duration(max(d.at-c, 0)))
		}
	}
	return out
}
