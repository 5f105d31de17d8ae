package txoutbox_test

import (
	"context"
	"errors"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

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

// TestForwarderStopWhileAwaitingRenewalIsNoLostLease: a lane waits for a
// lease renewal that is slow (healthy, just slow) when the forwarder is
// stopped. It releases the rest of its group as stopping; that is not a lost
// lease, and nothing logs ErrLeaseLost.
func TestForwarderStopWhileAwaitingRenewalIsNoLostLease(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			recs := make([]storage.Record, 20)
			for i := range recs {
				recs[i] = record("t", "k", "r")
			}
			ids := b.insert(t, s, recs...)
			slow := make(chan struct{})
			var extending atomic.Bool
			faulty := &faultStore{Storage: s, delay: func(op string) (time.Duration, error) {
				if op == "extend" {
					extending.Store(true)
					<-slow // the renewal is in flight until the test lets it land
				}
				return 0, nil
			}}
			// Each publish takes 200 ms: from the fifth on, the lane cannot
			// finish one (PublishTimeout 1 s) within the lease it knows of
			// (2 s from the claim), and waits for the renewal, which started
			// at the first tick (400 ms) and has not returned.
			var returned atomic.Int64
			target := publisherFunc(func(topic string, msgs ...*message.Message) error {
				time.Sleep(200 * time.Millisecond) // the broker's latency, not synchronisation
				returned.Add(1)
				return nil
			})
			cfg := fastConfig()
			cfg.Concurrency = 1
			cfg.Lease = 2 * time.Second
			cfg.PublishTimeout = time.Second
			log := &captureLogger{}
			f, err := txoutbox.NewForwarder(faulty, target, cfg, log)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- f.Run(ctx) }()
			waitFor(t, 20*time.Second, "five publishes and a renewal in flight", func() bool {
				return returned.Load() >= 5 && extending.Load()
			})
			cancel()
			close(slow)
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
			for _, id := range ids[returned.Load():] {
				if st := b.inspect(t, s, id); st.LeasedBy != "" || st.Status != storage.StatusPending {
					t.Errorf("record %d: %+v, want released", id, st)
				}
			}
		})
	}
}
