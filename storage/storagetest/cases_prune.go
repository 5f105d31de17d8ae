package storagetest

import (
	"sync"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

func pruneCases() []testCase {
	return []testCase{
		{name: "DeletesOnlyExpiredDelivered", inspect: true, run: testPruneOnlyExpired},
		{name: "ConcurrentPrunesDeleteEachOnce", inspect: true, run: testPruneConcurrent},
	}
}

func pruner(t *testing.T, e *env) storage.Pruner {
	t.Helper()
	p, ok := e.s.(storage.Pruner)
	if !ok {
		t.Skip("skipped: the storage does not implement storage.Pruner")
	}
	return p
}

// settle makes, of n keyless records, delivered ones (the first), dead
// ones, and pending ones (leased, and untouched), and returns them.
func (e *env) settle(delivered, dead, leased, untouched int) (acked, deadIDs, pending []int64) {
	e.t.Helper()
	all := e.insert(keyless(delivered + dead + leased + untouched)...)
	acked, deadIDs = all[:delivered], all[delivered:delivered+dead]
	pending = all[delivered+dead:]
	got := e.claim("worker-1", delivered+dead+leased, longLease)
	if len(got) != delivered+dead+leased {
		e.t.Fatalf("Claim returned %d of %d keyless records", len(got), delivered+dead+leased)
	}
	e.ack("worker-1", acked...)
	for _, id := range deadIDs {
		e.deadLetter("worker-1", id, "poison message")
	}
	return acked, deadIDs, pending
}

// untouched fails the test unless the dead and pending records are as
// settle left them.
func (e *env) untouched(deadIDs, pending []int64, leased int, why string) {
	e.t.Helper()
	for _, id := range deadIDs {
		if st, _ := e.state(id); st.Status != storage.StatusDead {
			e.t.Fatalf("dead record %d is %q after %s, want dead: Prune never touches a dead record", id, st.Status, why)
		}
	}
	for i, id := range pending {
		st, _ := e.state(id)
		if st.Status != storage.StatusPending || (i < leased) != (st.LeasedBy == "worker-1") {
			e.t.Fatalf("pending record %d is %+v after %s, want pending and its lease unchanged: Prune never touches a pending record", id, st, why)
		}
	}
}

func testPruneOnlyExpired(t *testing.T, e *env) {
	p := pruner(t, e)
	_, deadIDs, pending := e.settle(5, 2, 2, 2)
	n, err := p.Prune(e.ctx, storage.PruneParams{OlderThan: time.Hour, Limit: 100})
	if err != nil || n != 0 {
		t.Fatalf("Prune(OlderThan 1h) right after the deliveries returned %d, %v: want 0 deleted, records delivered within the window are kept", n, err)
	}
	if _, err := p.Prune(e.ctx, storage.PruneParams{OlderThan: -time.Second, Limit: 100}); err == nil {
		t.Fatal("Prune(OlderThan -1s) returned no error: a negative window is invalid")
	}
	if _, err := p.Prune(e.ctx, storage.PruneParams{Limit: 0}); err == nil {
		t.Fatal("Prune(Limit 0) returned no error: Limit must be > 0")
	}
	// Delivered a moment ago is older than a zero window: a batch of 3,
	// then the 2 left.
	var batches []int64
	deadline := time.Now().Add(waitTimeout)
	for total := int64(0); total < 5; {
		n, err := p.Prune(e.ctx, storage.PruneParams{Limit: 3})
		if err != nil {
			t.Fatalf("Prune returned error %v", err)
		}
		if n > 3 {
			t.Fatalf("Prune(Limit 3) deleted %d records: a call deletes at most Limit", n)
		}
		if n > 0 {
			batches = append(batches, n)
		}
		total += n
		if total > 5 {
			t.Fatalf("Prune deleted %d records in all, of 5 delivered: it deletes delivered records only", total)
		}
		if time.Now().After(deadline) {
			t.Fatalf("Prune deleted %d of 5 delivered records within %v", total, waitTimeout)
		}
	}
	if len(batches) != 2 || batches[0] != 3 {
		t.Errorf("Prune(Limit 3) deleted %v: want 3 then 2", batches)
	}
	if n, err := p.Prune(e.ctx, storage.PruneParams{Limit: 100}); err != nil || n != 0 {
		t.Fatalf("Prune after every delivered record was deleted returned %d, %v: want 0", n, err)
	}
	e.untouched(deadIDs, pending, 2, "Prune")
	if r, ok := e.s.(storage.StatsReader); ok {
		st, err := r.Stats(e.ctx)
		if err != nil || st.Delivered != 0 || st.OldestDeliveredAge != 0 || st.Dead != 2 || st.Pending != 4 {
			t.Fatalf("Stats after every delivered record was pruned returned %+v, %v: want Delivered 0, OldestDeliveredAge 0, the 2 dead and 4 pending records", st, err)
		}
	}
}

func testPruneConcurrent(t *testing.T, e *env) {
	p := pruner(t, e)
	const delivered = 60
	_, deadIDs, pending := e.settle(delivered, 3, 3, 3)
	var mu sync.Mutex
	var total int64
	var wg sync.WaitGroup
	deadline := time.Now().Add(waitTimeout)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				done := total >= delivered
				mu.Unlock()
				if done || time.Now().After(deadline) {
					return
				}
				n, err := p.Prune(e.ctx, storage.PruneParams{Limit: 7})
				if err != nil {
					t.Errorf("Prune returned error %v", err)
					return
				}
				mu.Lock()
				total += n
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if total != delivered {
		t.Fatalf("four concurrent prunes reported %d deleted records, of %d delivered: each expired record is deleted once", total, delivered)
	}
	e.untouched(deadIDs, pending, 3, "four concurrent prunes")
}
