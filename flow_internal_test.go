package txoutbox

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox/storage"
)

// ackSizes is a storage whose Ack records how many ids each call carried;
// the completer calls nothing else.
type ackSizes struct {
	storage.Storage
	mu    sync.Mutex
	sizes []int
}

func (a *ackSizes) Ack(_ context.Context, p storage.AckParams) error {
	a.mu.Lock()
	a.sizes = append(a.sizes, len(p.IDs))
	a.mu.Unlock()
	return nil
}

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// TestCompleterAcksHalfWhileTheRestIsPublished: records that come at the
// speed of publishing are acked once half of MaxInFlight is gathered and
// ackSplit has passed, not after the whole batch, so that the next claim can
// run while the rest are published.
func TestCompleterAcksHalfWhileTheRestIsPublished(t *testing.T) {
	store := &ackSizes{}
	f, err := NewForwarder(store, nopPublisher{}, ForwarderConfig{BatchSize: 100, MaxInFlight: 100}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, cancel := f.newSession(t.Context(), false)
	defer cancel()
	const n = 100
	s.unreported.Store(n)
	go s.complete()
	g := &group{b: &batch{}}
	item := func(id int64) ackItem { return ackItem{rec: &storage.Record{ID: id}, g: g} }

	s.acks <- item(1)
	deadline := time.Now().Add(10 * time.Second)
	for s.unreported.Load() != n-1 { // the completer took the first record
		if time.Now().After(deadline) {
			t.Fatal("the completer did not take the first record")
		}
		time.Sleep(100 * time.Microsecond)
	}
	time.Sleep(2 * ackSplit)
	for id := int64(2); id <= n; id++ {
		s.acks <- item(id)
	}
	first := <-s.events
	if got := len(first.acked); got >= n {
		t.Fatalf("the first ack carried %d records, all of them: want it to go once half of MaxInFlight (%d) was gathered", got, n/2)
	}
	total := len(first.acked)
	for total < n {
		total += len((<-s.events).acked)
	}
	close(s.acks)
	<-s.completerDone
	if total != n {
		t.Fatalf("acked %d records, want %d", total, n)
	}
}
