package txoutbox_test

import (
	"context"
	"errors"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
)

// TestRunOnceReturnsWhenAbandonedPublishesRefuseItsClaim: while an earlier
// run's publish still runs abandoned in the target (MaxAbandonedPublishes
// 1), RunOnce claims nothing and returns at once with ErrTooManyAbandoned,
// rather than waiting as long as the target holds the publish.
func TestRunOnceReturnsWhenAbandonedPublishesRefuseItsClaim(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			ids := b.insert(t, s, record("t", "k", "hangs"), record("t", "", "other"))
			hang := make(chan struct{})
			var unblocked atomic.Bool
			unblock := func() {
				if unblocked.CompareAndSwap(false, true) {
					close(hang)
				}
			}
			defer unblock()
			target := newRecorder()
			target.setFail(func(d delivery) error {
				if d.ID == ids[0] && d.Attempt == 1 {
					<-hang // ignores its context
				}
				return nil
			})
			cfg := fastConfig()
			cfg.Concurrency = 1
			cfg.MaxAbandonedPublishes = 1
			cfg.PublishTimeout = 100 * time.Millisecond
			cfg.Lease = time.Second
			f := newForwarder(t, s, target, cfg)
			if _, err := f.RunOnce(context.Background()); err != nil {
				t.Fatalf("first RunOnce: %v", err)
			}
			if n := f.AbandonedPublishes(); n != 1 {
				t.Fatalf("%d abandoned publishes after the first RunOnce, want 1", n)
			}

			type out struct {
				res txoutbox.RunOnceResult
				err error
			}
			done := make(chan out, 1)
			go func() { r, err := f.RunOnce(context.Background()); done <- out{r, err} }()
			var o out
			select {
			case o = <-done:
			case <-time.After(20 * time.Second):
				unblock()
				<-done
				t.Fatal("RunOnce did not return while the abandoned publish held the bound; it returned once the target let go")
			}
			if !errors.Is(o.err, txoutbox.ErrTooManyAbandoned) || o.res.Claimed != 0 {
				t.Fatalf("RunOnce = %+v, %v; want Claimed 0 and ErrTooManyAbandoned", o.res, o.err)
			}
			if st := b.inspect(t, s, ids[1]); st.Status != storage.StatusPending || st.Attempts != 0 {
				t.Errorf("record %d: %+v, want untouched", ids[1], st)
			}

			// Once the target lets go, RunOnce claims again.
			unblock()
			waitFor(t, 10*time.Second, "the abandoned publish to end", func() bool { return f.AbandonedPublishes() == 0 })
			res, err := f.RunOnce(context.Background())
			if err != nil || res.Claimed == 0 {
				t.Fatalf("RunOnce after the target let go = %+v, %v; want a claim", res, err)
			}
		})
	}
}

// TestForwarderGoexitInTargetIsAFailedPublish: a target that calls
// runtime.Goexit (t.FailNow in a test double, say) ends the lane's
// goroutine with no panic to recover. The publish counts as failed, like a
// panic: the record is retried, the rest of its key follows it in order,
// and Run returns after cancel. With and without a publish timeout (the
// lane runs on its own goroutine, or on the supervisor's).
func TestForwarderGoexitInTargetIsAFailedPublish(t *testing.T) {
	for _, b := range backends(t) {
		for _, timeout := range []time.Duration{time.Second, txoutbox.NoPublishTimeout} {
			t.Run(b.name+"/timeout="+timeout.String(), func(t *testing.T) {
				t.Parallel()
				s := b.new(t)
				ids := b.insert(t, s, record("t", "k", "1"), record("t", "k", "2"), record("t", "", "3"))
				target := newRecorder()
				target.setFail(func(d delivery) error {
					if d.ID == ids[0] && d.Attempt == 1 {
						runtime.Goexit()
					}
					return nil
				})
				cfg := fastConfig()
				cfg.Concurrency = 1
				cfg.PublishTimeout = timeout
				f := newForwarder(t, s, target, cfg)
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				done := make(chan error, 1)
				go func() { done <- f.Run(ctx) }()
				waitFor(t, 20*time.Second, "every record delivered", func() bool {
					for _, id := range ids {
						if b.inspect(t, s, id).Status != storage.StatusDelivered {
							return false
						}
					}
					return true
				})
				cancel()
				select {
				case err := <-done:
					if err != nil {
						t.Fatalf("Run: %v", err)
					}
				case <-time.After(20 * time.Second):
					t.Fatal("Run did not return after cancel")
				}
				got := target.deliveries()
				checkOrder(t, got)
				if st := b.inspect(t, s, ids[0]); st.Attempts != 2 || st.LastError == "" {
					t.Errorf("record %d: %+v, want delivered at attempt 2 after a recorded failure", ids[0], st)
				}
			})
		}
	}
}

// claimCounter counts the claims made through it.
type claimCounter struct {
	storage.Storage
	n atomic.Int64
}

func (c *claimCounter) Claim(ctx context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	c.n.Add(1)
	return c.Storage.Claim(ctx, p)
}

// TestForwarderRunWithCancelledContextClaimsNothing: Run given a context
// already cancelled returns without claiming (a claim would lease records
// only to release them).
func TestForwarderRunWithCancelledContextClaimsNothing(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			ids := b.insert(t, s, record("t", "k", "1"))
			c := &claimCounter{Storage: s}
			f := newForwarder(t, c, newRecorder(), fastConfig())
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			if err := f.Run(ctx); err != nil {
				t.Fatalf("Run: %v", err)
			}
			if n := c.n.Load(); n != 0 {
				t.Errorf("Run with a cancelled context made %d claims, want none", n)
			}
			if st := b.inspect(t, s, ids[0]); st.Attempts != 0 || st.LeasedBy != "" {
				t.Errorf("record %d: %+v, want untouched", ids[0], st)
			}
		})
	}
}

// stallStore holds the first claim that returns records until
// time.Since(its start) reaches stall, and every renewal until unblock is
// closed (a healthy renewal, just slow).
type stallStore struct {
	storage.Storage
	stall   time.Duration
	unblock chan struct{}
	claimed atomic.Bool // the first claim with records returned
	extends atomic.Int64
}

func (s *stallStore) Claim(ctx context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	start := time.Now()
	recs, err := s.Storage.Claim(ctx, p)
	if len(recs) > 0 && !s.claimed.Load() {
		time.Sleep(s.stall - time.Since(start)) // a slow claim, not synchronisation
		s.claimed.Store(true)
	}
	return recs, err
}

func (s *stallStore) Extend(ctx context.Context, p storage.ExtendParams) ([]int64, error) {
	s.extends.Add(1)
	select {
	case <-s.unblock:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return s.Storage.Extend(ctx, p)
}

// TestForwarderStopWhileAwaitingRenewalIsNoLostLease: a lane waits for a
// lease renewal that is slow (healthy, just slow) when the forwarder is
// stopped. It releases its group as stopping; that is not a lost lease, and
// nothing logs ErrLeaseLost.
func TestForwarderStopWhileAwaitingRenewalIsNoLostLease(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			ids := b.insert(t, s, record("t", "k", "1"), record("t", "k", "2"))
			// The claim returns 2.1 s after it started: with a 4 s lease,
			// the lane cannot finish a publish (PublishTimeout 2 s) within
			// the lease it knows of, and waits for the renewal, which the
			// next tick starts and which does not return. The stop comes
			// then, well before the lease runs out.
			stalled := &stallStore{Storage: s, stall: 2100 * time.Millisecond, unblock: make(chan struct{})}
			target := newRecorder()
			cfg := fastConfig()
			cfg.Concurrency = 1
			cfg.Lease = 4 * time.Second
			cfg.PublishTimeout = 2 * time.Second
			log := &captureLogger{}
			f, err := txoutbox.NewForwarder(stalled, target, cfg, log)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- f.Run(ctx) }()
			waitFor(t, 20*time.Second, "the claim and a renewal in flight", func() bool {
				return stalled.claimed.Load() && stalled.extends.Load() > 0
			})
			cancel()
			close(stalled.unblock)
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("Run: %v", err)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("Run did not return after cancel")
			}
			if log.has(txoutbox.ErrLeaseLost) {
				t.Error("a graceful stop logged ErrLeaseLost")
			}
			if n := len(target.deliveries()); n != 0 {
				t.Errorf("%d publishes, want none: the lease was too short for any", n)
			}
			for _, id := range ids {
				if st := b.inspect(t, s, id); st.LeasedBy != "" || st.Status != storage.StatusPending {
					t.Errorf("record %d: %+v, want released", id, st)
				}
			}
		})
	}
}
