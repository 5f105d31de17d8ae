package txoutbox

import (
	"context"
	"errors"
	"slices"
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
	a.sizes = append(a.sizes, len(p.Records))
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
	// Publishes that waited on the target: the rest of the batch is worth
	// claiming for meanwhile.
	item := func(id int64) ackItem { return ackItem{rec: &storage.Record{ID: id}, g: g, took: time.Millisecond} }

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

// TestCompleterSplitsOnlyForPublishesThatWait: half a batch is acked at once
// only when the publishes of the records gathered waited on the target;
// publishes that return at once (CPU-bound, as a no-op or in-process target)
// keep the batch whole, and the next claim is then a whole batch too.
func TestCompleterSplitsOnlyForPublishesThatWait(t *testing.T) {
	f, err := NewForwarder(&ackSizes{}, nopPublisher{}, ForwarderConfig{BatchSize: 1000, MaxInFlight: 1000}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, cancel := f.newSession(t.Context(), false)
	defer cancel()
	const ms = time.Millisecond
	for _, c := range []struct {
		n                         int
		gathered, ackTook, waited time.Duration
		want                      bool
	}{
		{499, time.Second, 0, time.Second, false},       // less than half
		{500, ackSplit / 2, 0, time.Second, false},      // not ackSplit yet
		{500, 2 * ackSplit, 0, 500 * ms, true},          // publishes of 1 ms
		{500, 4 * ms, 5 * ms, 500 * ms, false},          // an ack takes longer
		{500, 6 * ms, 5 * ms, 500 * ms, true},           // the rest comes after the ack
		{500, 6 * ms, 5 * ms, 500 * publishWaits, true}, // publishes of publishWaits
		{500, 6 * ms, 5 * ms, 499 * publishWaits, false},
		{500, time.Second, 0, 5 * ms, false}, // publishes of 10 µs: no split, however long
	} {
		if got := s.splitAck(c.n, c.gathered, c.ackTook, c.waited); got != c.want {
			t.Errorf("splitAck(%d records gathered in %s, ack took %s, publishes took %s) = %t, want %t", c.n, c.gathered, c.ackTook, c.waited, got, c.want)
		}
	}
}

// TestSettledKeyBringsClaimForwardWhateverTheOrder: a group whose records are
// all acked frees its key, which brings the next claim forward (records held
// behind the key may be claimable). The completer's ack may be handled
// before the lane's "finished": the claim must come forward then too.
func TestSettledKeyBringsClaimForwardWhateverTheOrder(t *testing.T) {
	f, err := NewForwarder(&ackSizes{}, nopPublisher{}, ForwarderConfig{BatchSize: 10}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, ackFirst := range []bool{false, true} {
		s, cancel := f.newSession(t.Context(), false)
		s.handle(event{kind: evClaimed, records: []storage.Record{{ID: 1, Key: "k"}}, started: time.Now()})
		g := s.ready[0]
		s.ready, s.running = nil, 1 // a lane took it
		// As after an empty claim: the next one is far off, but a settled
		// key may bring it forward to settleFloor.
		floor := time.Now()
		s.settleFloor, s.claimAt = floor, floor.Add(time.Hour)
		finished := event{kind: evFinished, g: g}
		acked := event{kind: evAcked, acked: []*group{g}}
		if ackFirst {
			s.handle(acked)
			s.handle(finished)
		} else {
			s.handle(finished)
			s.handle(acked)
		}
		if !s.claimAt.Equal(floor) {
			t.Errorf("ack handled first: %t: the next claim is at %s from now, want it brought forward to the settle floor", ackFirst, time.Until(s.claimAt).Round(time.Second))
		}
		if s.inFlight != 0 || len(s.batches) != 0 {
			t.Errorf("ack handled first: %t: %d records in flight and %d batches kept, want none", ackFirst, s.inFlight, len(s.batches))
		}
		cancel()
	}
}

// TestSettledKeyKeepsTheStorageErrorDelay: after a failed claim the next one
// waits StorageErrorDelay; a group settling meanwhile does not bring it
// forward (with the database down, that would be one failed claim, and one
// error logged, per group in flight). Found by a review.
func TestSettledKeyKeepsTheStorageErrorDelay(t *testing.T) {
	f, err := NewForwarder(&ackSizes{}, nopPublisher{}, ForwarderConfig{BatchSize: 10, StorageErrorDelay: time.Minute}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, cancel := f.newSession(t.Context(), false)
	defer cancel()
	s.handle(event{kind: evClaimed, records: []storage.Record{{ID: 1, Key: "k"}}, started: time.Now()})
	g := s.ready[0]
	s.ready, s.running = nil, 1 // a lane took it
	s.claiming = true
	s.handle(event{kind: evClaimed, err: errors.New("connection refused"), started: time.Now()})
	s.handle(event{kind: evFinished, g: g})
	s.handle(event{kind: evAcked, acked: []*group{g}})
	if wait := time.Until(s.claimAt); wait < 50*time.Second {
		t.Errorf("the next claim is in %s after a failed claim, want the StorageErrorDelay of 1m", wait.Round(time.Second))
	}
}

// TestSettledKeyBringsClaimForwardAfterTheFirstEmptyClaim: the first claim
// that finds nothing after one that found records does not hold the next
// claim PollMin away from a group settling (records are most likely still
// coming); from the second empty claim in a row on it does (the table is
// idle, and settling groups must not become a stream of claims).
func TestSettledKeyBringsClaimForwardAfterTheFirstEmptyClaim(t *testing.T) {
	f, err := NewForwarder(&ackSizes{}, nopPublisher{}, ForwarderConfig{BatchSize: 10, PollMin: time.Hour, PollMax: 4 * time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, cancel := f.newSession(t.Context(), false)
	defer cancel()
	s.handle(event{kind: evClaimed, records: []storage.Record{{ID: 1, Key: "a"}, {ID: 2, Key: "b"}}, started: time.Now()})
	a, b := s.ready[0], s.ready[1]
	s.ready, s.running = nil, 2 // lanes took them
	settle := func(g *group) {
		s.handle(event{kind: evFinished, g: g})
		s.handle(event{kind: evAcked, acked: []*group{g}})
	}

	s.handle(event{kind: evClaimed, started: time.Now()}) // the first empty claim
	if wait := time.Until(s.claimAt); wait < 30*time.Minute {
		t.Fatalf("after an empty claim the next one is in %s, want PollMin (1h) while nothing settles", wait.Round(time.Second))
	}
	settle(a)
	if wait := time.Until(s.claimAt); wait > 0 {
		t.Errorf("a group settled after the first empty claim: the next claim is in %s, want it at once", wait.Round(time.Second))
	}

	s.handle(event{kind: evClaimed, started: time.Now()}) // the second in a row
	settle(b)
	if wait := time.Until(s.claimAt); wait < 30*time.Minute {
		t.Errorf("a group settled after two empty claims in a row: the next claim is in %s, want PollMin (1h)", wait.Round(time.Second))
	}
}

// TestIdleSleepGrowsOnlyOnceTheTableIsQuiet: claims that find nothing
// sleep PollMin, not longer, however many of them in a row, until claims
// have found nothing for quietPolls PollMin (from the start of the first
// empty claim in a row); then the sleep grows by PollFactor. Time is what
// counts, not the number of empty claims. A claim that finds records starts
// over.
func TestIdleSleepGrowsOnlyOnceTheTableIsQuiet(t *testing.T) {
	f, err := NewForwarder(&ackSizes{}, nopPublisher{}, ForwarderConfig{BatchSize: 10, PollMin: time.Hour, PollMax: 100 * time.Hour, PollFactor: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, cancel := f.newSession(t.Context(), false)
	defer cancel()
	// claim runs a claim that started at started and returns how long the
	// session then sleeps before the next one, to the hour.
	claim := func(started time.Time, records ...storage.Record) time.Duration {
		s.claiming = true
		s.handle(event{kind: evClaimed, records: records, started: started})
		return time.Until(s.claimAt).Round(time.Hour)
	}
	// quiet runs empty claims, all started now, and checks each one's sleep.
	quiet := func(what string, want ...time.Duration) {
		t.Helper()
		for i, w := range want {
			if got := claim(time.Now()); got != w {
				t.Fatalf("%s: empty claim %d sleeps %s, want %s", what, i+1, got, w)
			}
		}
	}

	// A claim that started long before (a forwarder held at MaxInFlight
	// claims nothing for a while): the quiet time starts with the first
	// empty claim, not with it.
	claim(time.Now().Add(-10*time.Hour), storage.Record{ID: 1, Key: "a"})
	s.ready, s.running = nil, 1 // a lane took it
	quiet("a lull after records were found", time.Hour, time.Hour, time.Hour, time.Hour, time.Hour, time.Hour)
	s.emptySince = time.Now().Add(-quietPolls * time.Hour) // quiet for quietPolls PollMin
	quiet("a quiet table", time.Hour, 2*time.Hour, 4*time.Hour)

	if got := claim(time.Now(), storage.Record{ID: 2, Key: "b"}); got > 0 {
		t.Fatalf("a claim that found records: the next one is in %s, want it at once", got)
	}
	quiet("a lull after records were found again", time.Hour, time.Hour, time.Hour)
}

// TestDrainedClaimsComePollMinHalfApart: after a claim that the storage
// reports drained the next one comes PollMin/2 after it started; a group of
// one record settling meanwhile does not bring it forward, a group of more
// than one does (its key is busy). A claim not reported drained is
// followed at once, and so is a drained one during which the forwarder was
// woken.
func TestDrainedClaimsComePollMinHalfApart(t *testing.T) {
	f, err := NewForwarder(&ackSizes{}, nopPublisher{}, ForwarderConfig{BatchSize: 10, PollMin: 2 * time.Hour, PollMax: 4 * time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, cancel := f.newSession(t.Context(), false)
	defer cancel()
	// claim hands the session a claim of records that started at started,
	// and returns the groups it made.
	claim := func(started time.Time, drained bool, records ...storage.Record) []*group {
		t.Helper()
		s.claiming = true
		s.handle(event{kind: evClaimed, records: records, drained: drained, started: started})
		groups := s.ready
		s.ready, s.running = nil, s.running+len(groups) // lanes took them
		return groups
	}
	settle := func(g *group) {
		s.handle(event{kind: evFinished, g: g})
		s.handle(event{kind: evAcked, acked: slices.Repeat([]*group{g}, len(g.records))})
	}
	started := time.Now()
	groups := claim(started, true, storage.Record{ID: 1, Key: "a"}, storage.Record{ID: 2, Key: "b"}, storage.Record{ID: 3, Key: "b"})
	if !s.claimAt.Equal(started.Add(time.Hour)) {
		t.Fatalf("after a drained claim the next one is in %s, want PollMin/2 (1h) after it started", time.Until(s.claimAt).Round(time.Minute))
	}
	one, two := groups[1], groups[0] // longest first
	if len(one.records) != 1 || len(two.records) != 2 {
		t.Fatalf("groups of %d and %d records, want 1 and 2", len(one.records), len(two.records))
	}
	settle(one)
	if !s.claimAt.Equal(started.Add(time.Hour)) {
		t.Fatalf("a group of one record settled: the next claim is in %s, want it left PollMin/2 after the last one started", time.Until(s.claimAt).Round(time.Minute))
	}
	settle(two)
	if !s.claimAt.IsZero() {
		t.Fatalf("a group of two records settled: the next claim is in %s, want it at once", time.Until(s.claimAt).Round(time.Minute))
	}

	claim(time.Now(), false, storage.Record{ID: 4, Key: "c"})
	if !s.claimAt.IsZero() {
		t.Fatalf("after a claim not reported drained the next one is in %s, want it at once", time.Until(s.claimAt).Round(time.Minute))
	}

	// Woken during the claim (as run does on Wake): what woke it may have
	// committed after the claim's snapshot, and must not wait PollMin/2.
	s.wokenDuringClaim = true
	claim(time.Now(), true, storage.Record{ID: 5, Key: "d"})
	if !s.claimAt.IsZero() {
		t.Fatalf("woken during a drained claim: the next claim is in %s, want it at once", time.Until(s.claimAt).Round(time.Minute))
	}

	// A group of two records settles while a claim is in flight: the
	// claim may have read the table before the group's ack set its key
	// free, and its drained answer must not pace the next one.
	busy := claim(time.Now(), false, storage.Record{ID: 6, Key: "e"}, storage.Record{ID: 7, Key: "e"})[0]
	s.claiming = true
	started = time.Now()
	settle(busy)
	s.handle(event{kind: evClaimed, records: []storage.Record{{ID: 9, Key: "f"}}, drained: true, started: started})
	if !s.claimAt.IsZero() {
		t.Fatalf("a group of two records settled during a drained claim: the next claim is in %s, want it at once", time.Until(s.claimAt).Round(time.Minute))
	}
}
