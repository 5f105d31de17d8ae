package storagetest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

func concurrencyCases() []testCase {
	return []testCase{
		{name: "DrainDeliversEachRecordOnce", run: testDrainDeliversEachRecordOnce},
		{name: "OrderPerKeyUnderRace", strict: true, run: testOrderPerKeyUnderRace},
		{name: "OrderPerKeyWhileProducing", strict: true, run: testOrderPerKeyWhileProducing},
	}
}

// drainConfig shapes a drain: workers claiming and writing back in a loop, as
// forwarders would, until every record has been published once.
type drainConfig struct {
	workers int
	batch   int
	// fail says whether the publish of a claimed record fails; nil: never.
	fail func(r storage.Record) bool
	// retryDelay is the RetryAt of a failed publish, from now.
	retryDelay time.Duration
}

// delivery is one publish a worker made.
type delivery struct {
	id int64
	ok bool
}

// drainResult is what the workers saw.
type drainResult struct {
	// byKey lists the publishes of each key in the order they happened.
	byKey map[string][]delivery
	// published counts the successful publishes of each record.
	published map[int64]int
}

// drain runs cfg.workers workers against the n records in the storage until
// each is published once. Each worker handles its batch like the forwarder
// does: in id order; after a failed publish it nacks the record and releases
// the rest of that key's records in the batch untried. A worker that is
// handed a record another worker still holds fails the test.
func (e *env) drain(t *testing.T, n int, cfg drainConfig) drainResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(e.ctx, drainTimeout)
	defer cancel()

	var (
		mu     sync.Mutex
		held   = make(map[int64]string) // record id -> worker holding it
		done   int                      // records published at least once
		result = drainResult{byKey: make(map[string][]delivery), published: make(map[int64]int)}
	)
	fail := func(format string, args ...any) {
		t.Errorf(format, args...)
		cancel()
	}
	finished := func() bool {
		mu.Lock()
		defer mu.Unlock()
		return done == n
	}
	worker := func(worker string) {
		for ctx.Err() == nil && !finished() {
			batch, err := e.s.Claim(ctx, storage.ClaimParams{BatchSize: cfg.batch, Lease: longLease, WorkerID: worker})
			if err != nil {
				if ctx.Err() == nil {
					fail("Claim by %s returned error %v: claiming must not fail under concurrency", worker, err)
				}
				return
			}
			if err := checkClaim(batch, cfg.batch); err != nil {
				fail("%v (claim by %s)", err, worker)
				return
			}
			mu.Lock()
			for _, r := range batch {
				if other, ok := held[r.ID]; ok {
					fail("Claim gave record %d to %s while %s held its lease: concurrent claims must never hand out a leased record",
						r.ID, worker, other)
				}
				held[r.ID] = worker
			}
			mu.Unlock()
			if len(batch) == 0 {
				select {
				case <-ctx.Done():
				case <-time.After(pollInterval):
				}
				continue
			}
			failedKeys := make(map[string]time.Time) // key -> RetryAt of its failed record
			for _, r := range batch {
				var err error
				if retryAt, ok := failedKeys[r.Key]; ok {
					mu.Lock()
					delete(held, r.ID)
					mu.Unlock()
					err = e.s.Release(ctx, storage.ReleaseParams{Records: []storage.ClaimRef{r.Ref()}, WorkerID: worker, RetryAt: retryAt})
				} else {
					failed := cfg.fail != nil && cfg.fail(r)
					mu.Lock()
					result.byKey[r.Key] = append(result.byKey[r.Key], delivery{id: r.ID, ok: !failed})
					if !failed {
						result.published[r.ID]++
						if result.published[r.ID] == 1 {
							done++
						}
					}
					// Before the write-back: once it is done, another worker may
					// rightly claim the record.
					delete(held, r.ID)
					mu.Unlock()
					if failed {
						retryAt := time.Now().Add(cfg.retryDelay)
						if r.Key != "" {
							failedKeys[r.Key] = retryAt
						}
						err = e.s.Nack(ctx, storage.NackParams{Record: r.Ref(), WorkerID: worker, Error: "publish failed", RetryAt: retryAt})
					} else {
						err = e.s.Ack(ctx, storage.AckParams{Records: []storage.ClaimRef{r.Ref()}, WorkerID: worker})
					}
				}
				if err != nil {
					if ctx.Err() == nil {
						fail("write-back of record %d by %s returned error %v: write-backs must not fail under concurrency", r.ID, worker, err)
					}
					return
				}
			}
		}
	}

	var wg sync.WaitGroup
	for i := range cfg.workers {
		wg.Go(func() { worker(fmt.Sprintf("worker-%d", i+1)) })
	}
	// Watch for a stall, so a stuck storage fails in seconds, not at the timeout.
	stalled := false
	wg.Go(func() {
		last, lastChange := -1, time.Now()
		for ctx.Err() == nil {
			mu.Lock()
			d := done
			mu.Unlock()
			switch {
			case d == n:
				return
			case d != last:
				last, lastChange = d, time.Now()
			case time.Since(lastChange) > stallTimeout:
				stalled = true
				cancel()
				return
			}
			select {
			case <-ctx.Done():
			case <-time.After(pollInterval):
			}
		}
	})
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	if !finished() {
		mu.Lock()
		defer mu.Unlock()
		why := fmt.Sprintf("within %v", drainTimeout)
		if stalled {
			why = fmt.Sprintf("and then none for %v", stallTimeout)
		}
		t.Fatalf("%d workers published %d of %d records %s: the rest never became claimable (does an acked or dead-lettered record still hold back its key? does a nacked or released record never fall due?)",
			cfg.workers, done, n, why)
	}
	return result
}

// stallTimeout is how long a drain may go without a single publish: a stuck
// storage fails in seconds. drainTimeout bounds the whole drain; it is
// generous because a drain that keeps making progress is slow, not stuck (a
// SQLite drain of eight workers under -race on a loaded two-core machine
// took over 30 s).
const (
	stallTimeout = 10 * time.Second
	drainTimeout = 3 * time.Minute
)

// checkPublishedOnce fails the test unless each id was published exactly once.
func checkPublishedOnce(t *testing.T, all []int64, published map[int64]int) {
	t.Helper()
	for _, id := range all {
		if c := published[id]; c != 1 {
			t.Errorf("record %d was published %d times in a run without lease expiry: a record must be delivered once, never to two workers at a time", id, c)
		}
	}
}

// checkKeyOrder fails the test unless, for each key, records were first
// delivered and successfully published in id order.
func checkKeyOrder(t *testing.T, byKey map[string][]delivery) {
	t.Helper()
	for key, ds := range byKey {
		if key == "" {
			continue
		}
		seen := make(map[int64]bool)
		var lastFirst, lastOK int64
		for _, d := range ds {
			if !seen[d.id] {
				seen[d.id] = true
				if d.id < lastFirst {
					t.Errorf("key %q: record %d was first delivered after record %d: with strict ordering a key's records are delivered in id order, across retries and workers",
						key, d.id, lastFirst)
					return
				}
				lastFirst = d.id
			}
			if d.ok {
				if d.id < lastOK {
					t.Errorf("key %q: record %d was published after record %d: with strict ordering a later record waits until the earlier one is delivered",
						key, d.id, lastOK)
					return
				}
				lastOK = d.id
			}
		}
	}
}

func testDrainDeliversEachRecordOnce(t *testing.T, e *env) {
	const n = 300
	keys := make([]string, n)
	for i := range keys {
		if i%3 != 0 {
			keys[i] = fmt.Sprintf("key-%d", i%10)
		}
	}
	all := e.insert(keys...)
	res := e.drain(t, n, drainConfig{workers: 8, batch: 7})
	checkPublishedOnce(t, all, res.published)
	if e.h.StrictOrdering {
		checkKeyOrder(t, res.byKey)
	}
}

func testOrderPerKeyUnderRace(t *testing.T, e *env) {
	const n = 240
	keys := make([]string, n)
	for i := range keys {
		if i%8 != 7 {
			keys[i] = fmt.Sprintf("key-%d", i%6)
		}
	}
	all := e.insert(keys...)
	res := e.drain(t, n, drainConfig{
		workers: 8,
		batch:   5,
		// Every fourth record fails on its first try; Release gives the attempt
		// back, so a record released untried still fails once when tried.
		fail:       func(r storage.Record) bool { return r.ID%4 == 0 && r.Attempts == 1 },
		retryDelay: 20 * time.Millisecond,
	})
	checkPublishedOnce(t, all, res.published)
	checkKeyOrder(t, res.byKey)
}

// testOrderPerKeyWhileProducing: records keep arriving while the workers
// drain, fail and retry, so that later records of a key arrive while an
// earlier one waits for its retry (a storage that sets such records aside
// must give each back in order, and never leave one behind).
func testOrderPerKeyWhileProducing(t *testing.T, e *env) {
	const chunks, per = 30, 20
	var (
		mu  sync.Mutex
		all []int64
		wg  sync.WaitGroup
	)
	// A drain that fails ends the test at once: stop producing, and let the
	// insert under way finish before the storage is closed.
	stop := make(chan struct{})
	defer wg.Wait()
	defer close(stop)
	wg.Go(func() {
		for c := range chunks {
			select {
			case <-stop:
				return
			default:
			}
			keys := make([]string, per)
			for i := range keys {
				if i%8 != 7 {
					keys[i] = fmt.Sprintf("key-%d", (c*per+i)%5)
				}
			}
			ids := e.insert(keys...)
			mu.Lock()
			all = append(all, ids...)
			mu.Unlock()
			time.Sleep(5 * time.Millisecond)
		}
	})
	res := e.drain(t, chunks*per, drainConfig{
		workers:    4,
		batch:      7,
		fail:       func(r storage.Record) bool { return r.ID%5 == 0 && r.Attempts == 1 },
		retryDelay: 30 * time.Millisecond,
	})
	wg.Wait()
	checkPublishedOnce(t, all, res.published)
	checkKeyOrder(t, res.byKey)
}
