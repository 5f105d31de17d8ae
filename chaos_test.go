package txoutbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
)

// chaosStore wraps a real storage and makes its calls fail and stall at
// random, the way a flaky database and network would: a call can fail
// before it runs, or run and lose its reply; it can be slow before it runs
// and after (its reply slow to come back).
type chaosStore struct {
	storage.Storage
	lease     time.Duration
	timeout   time.Duration // the forwarders' PublishTimeout
	downUntil atomic.Int64  // unix nanoseconds: renewals fail until then
}

// renewalsDown reports whether renewals fail now: one in four starts an
// outage of up to a lease, during which every renewal fails, so that leases
// run out while their records are still held.
func (c *chaosStore) renewalsDown() bool {
	now := time.Now().UnixNano()
	if now < c.downUntil.Load() {
		return true
	}
	if rand.IntN(4) == 0 {
		c.downUntil.Store(now + int64(rand.N(c.lease)))
		return true
	}
	return false
}

// maxDelay is how long an operation may stall, before and after it runs.
func (c *chaosStore) maxDelay(op string) time.Duration {
	switch op {
	case "claim":
		return c.timeout / 4
	case "extend":
		return c.lease / 2
	}
	return c.timeout
}

func (c *chaosStore) stall(ctx context.Context, op string) error {
	if rand.IntN(2) == 0 {
		return nil
	}
	t := time.NewTimer(rand.N(c.maxDelay(op)))
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// do runs one operation through the faults; a claim's reply is never lost
// (its records would only wait for their lease to run out).
func (c *chaosStore) do(ctx context.Context, op string, run func() error) error {
	if op == "extend" && c.renewalsDown() {
		return errors.New("injected: the renewals' database is away")
	}
	if rand.IntN(10) == 0 {
		return fmt.Errorf("injected: %s failed before it ran", op)
	}
	if err := c.stall(ctx, op); err != nil {
		return err
	}
	if err := run(); err != nil {
		return err
	}
	if op != "claim" && rand.IntN(10) == 0 {
		return fmt.Errorf("injected: %s ran, its reply was lost", op)
	}
	return c.stall(ctx, op)
}

func (c *chaosStore) Claim(ctx context.Context, p storage.ClaimParams) (recs []storage.Record, err error) {
	err = c.do(ctx, "claim", func() error { recs, err = c.Storage.Claim(ctx, p); return err })
	if err != nil && len(recs) > 0 {
		return recs, nil // claimed: a stall cut short by the context loses nothing
	}
	return recs, err
}

func (c *chaosStore) Ack(ctx context.Context, p storage.AckParams) error {
	return c.do(ctx, "ack", func() error { return c.Storage.Ack(ctx, p) })
}

func (c *chaosStore) Nack(ctx context.Context, p storage.NackParams) error {
	return c.do(ctx, "nack", func() error { return c.Storage.Nack(ctx, p) })
}

func (c *chaosStore) Release(ctx context.Context, p storage.ReleaseParams) error {
	return c.do(ctx, "release", func() error { return c.Storage.Release(ctx, p) })
}

func (c *chaosStore) DeadLetter(ctx context.Context, p storage.DeadLetterParams) error {
	return c.do(ctx, "dead-letter", func() error { return c.Storage.DeadLetter(ctx, p) })
}

func (c *chaosStore) Extend(ctx context.Context, p storage.ExtendParams) (ids []int64, err error) {
	err = c.do(ctx, "extend", func() error { ids, err = c.Storage.Extend(ctx, p); return err })
	if err != nil {
		return nil, err
	}
	return ids, nil
}

// TestForwardersUnderRandomStorageFaults: three forwarders drain one table
// through storages whose write-backs, renewals and claims fail and stall at
// random (before they run, or after, their reply lost), with publishes that
// fail, and now and then outrun PublishTimeout ignoring their context. Every
// publish is checked when it starts against the storage's own state: the
// record leased to the publishing forwarder by the claim it came from, the
// lease live; and against the other publishes: never two records of a key
// in flight at once. Every record is delivered in the end, in key order.
func TestForwardersUnderRandomStorageFaults(t *testing.T) {
	for _, b := range backends(t) {
		// One storage at a time: nine forwarders under -race on a loaded
		// machine starved SQLite's claims past the lease.
		t.Run(b.name, func(t *testing.T) {
			// The SQL storages get a longer lease: a claim that takes more
			// than Lease-PublishTimeout leaves nothing it may publish, and
			// SQLite claims of three forwarders under -race on a loaded
			// machine took more than 600 ms.
			lease, timeout := 300*time.Millisecond, 100*time.Millisecond
			switch b.name {
			case "sqlite":
				lease, timeout = 2*time.Second, 250*time.Millisecond
			case "postgres", "mysql":
				lease, timeout = 800*time.Millisecond, 200*time.Millisecond
			}
			s := b.new(t)
			var recs []storage.Record
			// Keys in runs: a claim takes long groups, which outlive a lease
			// unless it is renewed.
			for i := range 16 {
				recs = append(recs, record("t", fmt.Sprintf("k%d", i/8), fmt.Sprint(i)))
			}
			for i := range 4 {
				recs = append(recs, record("t", "", fmt.Sprint("keyless", i)))
			}
			ids := b.insert(t, s, recs...)

			rec := newRecorder()
			rec.setFail(func(d delivery) error {
				switch n := rand.IntN(100); {
				case n < 3:
					time.Sleep(timeout * 3 / 2) // a target that ignores its context
				case n < 13:
					return errors.New("injected: the broker refused")
				default:
					time.Sleep(rand.N(timeout * 3 / 4)) // the broker's latency
				}
				return nil
			})
			check := &leaseCheck{s: s}
			var stops []func()
			logs := &captureLogger{}
			for w := range 3 {
				id := fmt.Sprintf("w%d", w+1)
				cfg := txoutbox.ForwarderConfig{
					WorkerID:          id,
					BatchSize:         8,
					Concurrency:       2,
					Lease:             lease,
					PublishTimeout:    timeout,
					ShutdownTimeout:   timeout,
					MaxAttempts:       1000,
					PollMin:           5 * time.Millisecond,
					PollMax:           20 * time.Millisecond,
					StorageErrorDelay: 10 * time.Millisecond,
					Backoff:           txoutbox.Backoff{Base: 5 * time.Millisecond, Max: 20 * time.Millisecond, Jitter: txoutbox.NoJitter},
				}
				target := check.target(id, rec)
				f, err := txoutbox.NewForwarder(&chaosStore{Storage: s, lease: lease, timeout: timeout}, target, cfg, logs)
				if err != nil {
					t.Fatal(err)
				}
				stops = append(stops, runForwarder(t, f))
			}
			undelivered := func() []int64 {
				var out []int64
				for _, id := range ids {
					if b.inspect(t, s, id).Status != storage.StatusDelivered {
						out = append(out, id)
					}
				}
				return out
			}
			for deadline := time.Now().Add(60 * time.Second); len(undelivered()) > 0; time.Sleep(5 * time.Millisecond) {
				if time.Now().After(deadline) {
					for _, id := range undelivered() {
						st, err := leaseOf(context.Background(), s, id)
						t.Logf("record %d: %+v %v", id, st, err)
					}
					logs.mu.Lock()
					seen := map[string]int{}
					for _, m := range logs.msgs {
						seen[m]++
					}
					logs.mu.Unlock()
					t.Fatalf("not every record delivered within 60s; errors logged: %v", seen)
				}
			}
			for _, stop := range stops {
				stop()
			}
			for _, v := range check.failures() {
				t.Error(v)
			}
			got := rec.deliveries()
			checkOrder(t, got)
			t.Logf("%d records, %d publishes", len(ids), len(got))
		})
	}
}
