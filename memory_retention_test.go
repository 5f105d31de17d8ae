package txoutbox_test

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"
	"weak"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
)

// batchesStorage hands out batches of up to size records, one per claim,
// until left runs out; each record's payload is watched through a weak
// pointer, per batch, and the storage keeps no reference to what it handed
// out. settled counts acks and dead-letters.
type batchesStorage struct {
	mu       sync.Mutex
	left     int
	size     int
	key      func(i int) string // key of the i-th record of a batch
	attempts int
	next     int64
	handed   int // records handed out
	settled  int
	watched  [][]weak.Pointer[byte] // per batch
}

func (s *batchesStorage) Claim(_ context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.left == 0 {
		return nil, nil
	}
	s.left--
	recs := make([]storage.Record, min(s.size, p.BatchSize))
	var watched []weak.Pointer[byte]
	for i := range recs {
		s.next++
		payload := make([]byte, 4096)
		watched = append(watched, weak.Make(&payload[0]))
		recs[i] = storage.Record{ID: s.next, UUID: fmt.Sprint("uuid-", s.next), Topic: "t", Key: s.key(i), Payload: payload, Attempts: max(s.attempts, 1), CreatedAt: time.Now()}
	}
	s.watched = append(s.watched, watched)
	s.handed += len(recs)
	return recs, nil
}

func (s *batchesStorage) Ack(_ context.Context, p storage.AckParams) error {
	s.mu.Lock()
	s.settled += len(p.Records)
	s.mu.Unlock()
	return nil
}
func (s *batchesStorage) DeadLetter(context.Context, storage.DeadLetterParams) error {
	s.mu.Lock()
	s.settled++
	s.mu.Unlock()
	return nil
}
func (s *batchesStorage) Nack(context.Context, storage.NackParams) error       { return nil }
func (s *batchesStorage) Release(context.Context, storage.ReleaseParams) error { return nil }
func (s *batchesStorage) Extend(_ context.Context, p storage.ExtendParams) ([]int64, error) {
	return refIDs(p.Records), nil
}

// settledBut reports whether every batch was handed out and every record
// but n settled.
func (s *batchesStorage) settledBut(n int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.left == 0 && s.settled == s.handed-n
}

func (s *batchesStorage) allSettled() bool { return s.settledBut(0) }

// alive counts the watched payloads of the given batches (all when none is
// given) that the garbage collector has not freed.
func (s *batchesStorage) alive(batches ...int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(batches) == 0 {
		for i := range s.watched {
			batches = append(batches, i)
		}
	}
	n := 0
	for _, b := range batches {
		for _, w := range s.watched[b] {
			if w.Value() != nil {
				n++
			}
		}
	}
	return n
}

// awaitFreed runs the garbage collector until the watched payloads of the
// given batches are freed, and fails if they are not within 10 s.
func awaitFreed(t *testing.T, s *batchesStorage, what string, batches ...int) {
	t.Helper()
	waitFor(t, 10*time.Second, what, func() bool {
		runtime.GC()
		return s.alive(batches...) == 0
	})
}

// retentionConfig has no lease renewal tick while a test runs.
func retentionConfig(batch int) txoutbox.ForwarderConfig {
	cfg := fastConfig()
	cfg.BatchSize = batch
	cfg.Lease = time.Hour
	cfg.PublishTimeout = time.Second
	return cfg
}

// TestForwarderKeepsNoSettledRecord: once a batch is published and acked,
// the running forwarder holds none of its records. It used to keep every
// settled batch until the next lease renewal (Lease/5): a drain at 40k
// msgs/s with the default 30 s lease kept about 240k records, payloads
// included, alive. The completer's items and a lane's last group held the
// last records too.
func TestForwarderKeepsNoSettledRecord(t *testing.T) {
	s := &batchesStorage{left: 20, size: 50, key: func(i int) string { return fmt.Sprint("k", i%7) }}
	f := newForwarder(t, s, nopPublisher{}, retentionConfig(50))
	stop := runForwarder(t, f)
	defer stop()
	waitFor(t, 10*time.Second, "every record acked", s.allSettled)
	awaitFreed(t, s, "the settled records to be freed while the forwarder runs")
}

// TestForwarderReplacementLaneKeepsNoSettledRecord: after a publish on its
// last attempt outran PublishTimeout and was dead-lettered, the lane that
// took over the rest of its group keeps publishing other groups, but not
// that group (and through it, its whole batch) once it is done. Found by a
// review.
func TestForwarderReplacementLaneKeepsNoSettledRecord(t *testing.T) {
	s := &batchesStorage{left: 5, size: 50, key: func(i int) string { return fmt.Sprint("k", i%7) }}
	hang := make(chan struct{})
	var once sync.Once
	unhang := func() { once.Do(func() { close(hang) }) }
	defer unhang()
	target := publisherFunc(func(_ string, msgs ...*message.Message) error {
		if msgs[0].UUID == "uuid-1" {
			<-hang // ignores its context: the lane is abandoned
		}
		return nil
	})
	cfg := retentionConfig(50)
	cfg.MaxAttempts = 1 // the timeout dead-letters the record; its group goes on in a fresh lane
	cfg.PublishTimeout = 100 * time.Millisecond
	f := newForwarder(t, s, target, cfg)
	stop := runForwarder(t, f)
	defer stop()
	waitFor(t, 10*time.Second, "every record settled", s.allSettled)
	unhang() // the abandoned publish returns
	awaitFreed(t, s, "the settled records to be freed while the forwarder runs")
}

// TestForwarderHotKeyQueueKeepsNoSettledGroup: the groups of a hot key queue
// behind the one in a lane; one that has been handed to a lane and settled is
// no longer held by the queue, while later groups of the key still wait.
func TestForwarderHotKeyQueueKeepsNoSettledGroup(t *testing.T) {
	// Batches of up to 4 records: the first of each on key "hot", the
	// others on keys of their own. With BatchSize (and MaxInFlight) 4, the
	// three claims are made while the first hot record is held: with three
	// in flight there would be no room for a fourth.
	s := &batchesStorage{left: 3, size: 4, key: func(i int) string {
		if i == 0 {
			return "hot"
		}
		return fmt.Sprint("cold-", time.Now().UnixNano(), "-", i)
	}}
	release := make(chan struct{})
	done := make(chan struct{})
	target := publisherFunc(func(_ string, msgs ...*message.Message) error {
		if msgs[0].Metadata.Get(txoutbox.MetadataKey) == "hot" {
			select {
			case <-release:
			case <-done:
			}
		}
		return nil
	})
	cfg := retentionConfig(4)
	cfg.PublishTimeout = 30 * time.Minute // no publish is abandoned
	f := newForwarder(t, s, target, cfg)
	stop := runForwarder(t, f)
	defer stop()
	defer close(done) // before stop: the held publish returns
	// Three hot records: the first in a lane, the others queued.
	waitFor(t, 10*time.Second, "the cold records acked", func() bool { return s.settledBut(3) })
	release <- struct{}{} // the first hot record is published; the second goes to a lane
	release <- struct{}{} // the second is published; the third goes to a lane and is held
	waitFor(t, 10*time.Second, "the first two hot records acked", func() bool { return s.settledBut(1) })
	awaitFreed(t, s, "the records of the first two batches to be freed while the third hot record is in flight", 0, 1)
}
