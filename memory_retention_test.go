package txoutbox_test

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"
	"weak"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
)

// batchesStorage hands out n batches of size records, one per claim, then
// nothing; each record's payload is watched through a weak pointer, and the
// storage keeps no reference to what it handed out.
type batchesStorage struct {
	mu      sync.Mutex
	left    int
	size    int
	next    int64
	acked   int
	watched []weak.Pointer[byte]
}

func (s *batchesStorage) Claim(context.Context, storage.ClaimParams) ([]storage.Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.left == 0 {
		return nil, nil
	}
	s.left--
	recs := make([]storage.Record, s.size)
	for i := range recs {
		s.next++
		payload := make([]byte, 4096)
		s.watched = append(s.watched, weak.Make(&payload[0]))
		recs[i] = storage.Record{ID: s.next, UUID: fmt.Sprint("uuid-", s.next), Topic: "t", Key: fmt.Sprint("k", i%7), Payload: payload, Attempts: 1, CreatedAt: time.Now()}
	}
	return recs, nil
}

func (s *batchesStorage) Ack(_ context.Context, p storage.AckParams) error {
	s.mu.Lock()
	s.acked += len(p.IDs)
	s.mu.Unlock()
	return nil
}
func (s *batchesStorage) Nack(context.Context, storage.NackParams) error             { return nil }
func (s *batchesStorage) Release(context.Context, storage.ReleaseParams) error       { return nil }
func (s *batchesStorage) DeadLetter(context.Context, storage.DeadLetterParams) error { return nil }
func (s *batchesStorage) Extend(_ context.Context, p storage.ExtendParams) ([]int64, error) {
	return p.IDs, nil
}

// alive counts the watched payloads the garbage collector has not freed.
func (s *batchesStorage) alive() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, w := range s.watched {
		if w.Value() != nil {
			n++
		}
	}
	return n
}

// TestForwarderKeepsNoSettledRecord: once a batch is published and acked,
// the running forwarder holds none of its records. It used to keep every
// settled batch until the next lease renewal (Lease/5): a drain at 20k
// msgs/s with the default 30 s lease kept 6 s of records, payloads
// included, alive.
func TestForwarderKeepsNoSettledRecord(t *testing.T) {
	s := &batchesStorage{left: 20, size: 50}
	var cfg txoutbox.ForwarderConfig = fastConfig()
	cfg.BatchSize = 50
	cfg.Lease = time.Hour // no renewal tick while the test runs
	cfg.PublishTimeout = time.Second
	f := newForwarder(t, s, nopPublisher{}, cfg)
	stop := runForwarder(t, f)
	defer stop()
	waitFor(t, 10*time.Second, "every record acked", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.acked == 20*50
	})
	waitFor(t, 10*time.Second, "the settled records to be freed while the forwarder runs", func() bool {
		runtime.GC()
		return s.alive() == 0
	})
}
