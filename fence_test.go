package txoutbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/memory"
	"github.com/txoutbox/txoutbox/storage/mysql"
	"github.com/txoutbox/txoutbox/storage/postgres"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// faultStore wraps a real storage and injects storage faults the way a
// database hiccup or a slow round trip would: a write-back or renewal can be
// delayed, and can fail. The write-back itself, when it runs, is the real
// storage's.
type faultStore struct {
	storage.Storage
	// delay, if set, returns how long an operation ("claim", "ack", "nack",
	// "release", "dead-letter", "extend") waits before it runs; it may also
	// return an error, which the operation returns without running.
	delay func(op string) (time.Duration, error)

	mu     sync.Mutex
	claims [][]int64 // the ids of each claim that returned records
}

func (f *faultStore) before(ctx context.Context, op string) error {
	if f.delay == nil {
		return nil
	}
	d, err := f.delay(op)
	if d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return err
}

func (f *faultStore) Claim(ctx context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	if err := f.before(ctx, "claim"); err != nil {
		return nil, err
	}
	recs, err := f.Storage.Claim(ctx, p)
	if len(recs) > 0 {
		ids := make([]int64, len(recs))
		for i := range recs {
			ids[i] = recs[i].ID
		}
		f.mu.Lock()
		f.claims = append(f.claims, ids)
		f.mu.Unlock()
	}
	return recs, err
}

func (f *faultStore) Ack(ctx context.Context, p storage.AckParams) error {
	if err := f.before(ctx, "ack"); err != nil {
		return err
	}
	return f.Storage.Ack(ctx, p)
}

func (f *faultStore) Nack(ctx context.Context, p storage.NackParams) error {
	if err := f.before(ctx, "nack"); err != nil {
		return err
	}
	return f.Storage.Nack(ctx, p)
}

func (f *faultStore) Release(ctx context.Context, p storage.ReleaseParams) error {
	if err := f.before(ctx, "release"); err != nil {
		return err
	}
	return f.Storage.Release(ctx, p)
}

func (f *faultStore) DeadLetter(ctx context.Context, p storage.DeadLetterParams) error {
	if err := f.before(ctx, "dead-letter"); err != nil {
		return err
	}
	return f.Storage.DeadLetter(ctx, p)
}

func (f *faultStore) Extend(ctx context.Context, p storage.ExtendParams) ([]int64, error) {
	if err := f.before(ctx, "extend"); err != nil {
		return nil, err
	}
	return f.Storage.Extend(ctx, p)
}

func (f *faultStore) claimed() [][]int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.claims)
}

// leaseState is a record's lease as the storage holds it right now.
type leaseState struct {
	status   storage.Status
	worker   string // empty when not leased
	attempts int
	live     bool // the lease has not run out
}

// leaseOf reads the lease of record id from the storage behind s (memory,
// SQLite, PostgreSQL or MySQL), on the storage's own clock.
func leaseOf(ctx context.Context, s storage.Storage, id int64) (leaseState, error) {
	var st leaseState
	var status string
	var err error
	switch s := s.(type) {
	case *memory.Storage:
		r, ok := s.Get(id)
		if !ok {
			return st, fmt.Errorf("record %d not found", id)
		}
		return leaseState{status: r.Status, worker: r.LeasedBy, attempts: r.Record.Attempts, live: time.Now().Before(r.LeasedUntil)}, nil
	case *sqlite.Storage:
		sq, _ := sqlStores.Load(storage.Storage(s))
		err = sq.(*sqlStore).db.QueryRowContext(ctx, "SELECT status, coalesce(leased_by, ''), attempts, coalesce(leased_until, 0) > ? FROM "+
			sq.(*sqlStore).table+" WHERE id = ?", time.Now().UnixNano(), id).Scan(&status, &st.worker, &st.attempts, &st.live)
	case *mysql.Storage:
		sq, _ := sqlStores.Load(storage.Storage(s))
		err = sq.(*sqlStore).db.QueryRowContext(ctx, "SELECT status, coalesce(leased_by, ''), attempts, coalesce(leased_until > UTC_TIMESTAMP(6), false) FROM "+
			sq.(*sqlStore).table+" WHERE id = ?", id).Scan(&status, &st.worker, &st.attempts, &st.live)
	case *postgres.Storage:
		sq, _ := sqlStores.Load(storage.Storage(s))
		q := sq.(*sqlStore)
		err = q.pool.QueryRow(ctx, "SELECT o.status, coalesce(l.leased_by, ''), coalesce(l.attempts, o.attempts), coalesce(l.leased_until > clock_timestamp(), false) FROM "+
			q.table+" o LEFT JOIN "+q.lease+" l ON l.id = o.id WHERE o.id = $1"+
			" UNION ALL SELECT 'delivered', '', d.attempts, false FROM "+q.done+" d WHERE d.id = $1", id).Scan(&status, &st.worker, &st.attempts, &st.live)
	default:
		return st, fmt.Errorf("leaseOf: storage %T not supported", s)
	}
	st.status = storage.Status(status)
	return st, err
}

// leaseCheck records every publish that starts without the lease of the
// claim it comes from: the record pending, leased by the publishing
// forwarder, with the attempts of that claim, and the lease not run out.
//
// It also records every publish that starts while another publish of its
// key is in flight and within its PublishTimeout (the message's deadline):
// one key is published one record at a time. A publish past its deadline
// has been given up by its forwarder (a target that ignores its context
// runs on, abandoned), and does not count.
type leaseCheck struct {
	s storage.Storage

	mu         sync.Mutex
	violations []string
	inFlight   map[string][]flight // per key
}

type flight struct {
	id       int64
	worker   string
	deadline time.Time
}

// target returns a publisher for the forwarder with workerID that checks
// each message's lease, then publishes it to rec.
func (c *leaseCheck) target(workerID string, rec *recorder) message.Publisher {
	return &checkedTarget{c: c, worker: workerID, rec: rec}
}

func (c *leaseCheck) failures() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.violations)
}

type checkedTarget struct {
	c      *leaseCheck
	worker string
	rec    *recorder
}

func (t *checkedTarget) Publish(topic string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		if err := t.publish(topic, msg); err != nil {
			return err
		}
	}
	return nil
}

func (t *checkedTarget) publish(topic string, msg *message.Message) error {
	c := t.c
	d, _ := txoutbox.DeliveryFromContext(msg.Context())
	st, err := leaseOf(context.Background(), c.s, d.Record.ID)
	// A publish whose deadline passed before the check came back was given
	// up by its forwarder, which checked the lease would outlast it (on a
	// loaded machine the target can start it that late).
	deadline, timed := msg.Context().Deadline()
	late := timed && !time.Now().Before(deadline)
	if !late && (err != nil || st.status != storage.StatusPending || st.worker != t.worker || st.attempts != d.Record.Attempts || !st.live) {
		c.fail("%s published record %d (attempt %d) while the storage says %+v (err %v)",
			t.worker, d.Record.ID, d.Record.Attempts, st, err)
	}
	if key := d.Record.Key; key != "" {
		me := flight{id: d.Record.ID, worker: t.worker, deadline: deadline}
		now := time.Now()
		c.mu.Lock()
		if c.inFlight == nil {
			c.inFlight = map[string][]flight{}
		}
		for _, o := range c.inFlight[key] {
			if o.deadline.IsZero() || now.Before(o.deadline) {
				c.violations = append(c.violations, fmt.Sprintf("%s started record %d of key %q while %s's publish of record %d was in flight (until %s)",
					t.worker, me.id, key, o.worker, o.id, o.deadline.Sub(now)))
			}
		}
		c.inFlight[key] = append(c.inFlight[key], me)
		c.mu.Unlock()
		defer func() {
			c.mu.Lock()
			c.inFlight[key] = slices.DeleteFunc(c.inFlight[key], func(f flight) bool { return f == me })
			c.mu.Unlock()
		}()
	}
	return t.rec.Publish(topic, msg)
}

func (c *leaseCheck) fail(format string, args ...any) {
	c.mu.Lock()
	c.violations = append(c.violations, fmt.Sprintf(format, args...))
	c.mu.Unlock()
}

func (t *checkedTarget) Close() error { return nil }

// outcomes counts the outcomes a forwarder reports.
type outcomes struct {
	nacked, released, dead atomic.Int64
	// lateAcks counts published records whose ack came too late: their lease
	// ran out and the forwarder claimed them again before it acked them (a
	// lost ack: the record is published again, by design).
	lateAcks atomic.Int64
}

func (o *outcomes) record(out txoutbox.Outcome) {
	switch out.Kind {
	case txoutbox.OutcomePublished:
		if errors.Is(out.StorageErr, txoutbox.ErrLeaseLost) {
			o.lateAcks.Add(1)
		}
	case txoutbox.OutcomeNacked:
		o.nacked.Add(1)
	case txoutbox.OutcomeReleased:
		o.released.Add(1)
	case txoutbox.OutcomeDeadLettered:
		o.dead.Add(1)
	}
}

// TestStaleWriteBackNeverEndsANewerLease is the scenario a review found:
// one forwarder, Concurrency 1, Lease 200 ms, PublishTimeout 100 ms, three
// records of one key whose first two take 90 ms each to publish, Extend
// failing for the first 300 ms and Release taking 60 ms. The lane cannot
// publish the third record before its known lease runs out, waits for a
// renewal that fails and releases it; before that slow Release lands the
// lease has run out in the storage and the same forwarder claims the record
// again. Fenced on the worker only, the late Release ended the new lease:
// the record was published with no lease, then again (and with a second
// forwarder, two records of the key were in flight at once). Fenced on the
// claim, it matches nothing. Every publish is checked against the
// storage's state when it starts.
//
// The SQL storages run the scenario five times slower (a 1 s lease): a
// claim that takes more than the lease less PublishTimeout leaves the
// forwarder nothing it may publish, and with -race on a loaded machine an
// SQLite claim took 200 ms.
func TestStaleWriteBackNeverEndsANewerLease(t *testing.T) {
	for _, b := range backends(t) {
		for _, second := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/second=%v", b.name, second), func(t *testing.T) {
				t.Parallel()
				scale := time.Duration(5)
				if b.name == "memory" {
					scale = 1
				}
				s := b.new(t)
				ids := b.insert(t, s, record("t", "k", "1"), record("t", "k", "2"), record("t", "k", "3"))
				rec := newRecorder()
				rec.setFail(func(d delivery) error {
					if d.ID == ids[0] || d.ID == ids[1] {
						time.Sleep(90 * time.Millisecond * scale)
					}
					return nil
				})
				check := &leaseCheck{s: s}
				var outs outcomes
				cfg := txoutbox.ForwarderConfig{
					BatchSize:         10,
					Concurrency:       1,
					Lease:             200 * time.Millisecond * scale,
					PublishTimeout:    100 * time.Millisecond * scale,
					PollMin:           5 * time.Millisecond,
					PollMax:           20 * time.Millisecond,
					StorageErrorDelay: 10 * time.Millisecond,
					Backoff:           txoutbox.Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond, Jitter: txoutbox.NoJitter},
					OnOutcome:         outs.record,
				}
				var extendFailUntil atomic.Int64
				faulty := &faultStore{Storage: s, delay: func(op string) (time.Duration, error) {
					switch op {
					case "extend":
						if time.Now().UnixNano() < extendFailUntil.Load() {
							return 0, fmt.Errorf("injected: the database is away")
						}
					case "release":
						return 60 * time.Millisecond * scale, nil
					}
					return 0, nil
				}}
				cfg.WorkerID = "w1"
				f1 := newForwarder(t, faulty, check.target("w1", rec), cfg)
				extendFailUntil.Store(time.Now().Add(300 * time.Millisecond * scale).UnixNano())
				stop1 := runForwarder(t, f1)
				stop2 := func() {}
				if second {
					cfg.WorkerID = "w2"
					stop2 = runForwarder(t, newForwarder(t, s, check.target("w2", rec), cfg))
				}
				delivered := func() bool {
					for _, id := range ids {
						if b.inspect(t, s, id).Status != storage.StatusDelivered {
							return false
						}
					}
					return true
				}
				for deadline := time.Now().Add(30 * time.Second); !delivered(); time.Sleep(5 * time.Millisecond) {
					if time.Now().After(deadline) {
						for _, id := range ids {
							st, err := leaseOf(context.Background(), s, id)
							t.Logf("record %d: %+v %v", id, st, err)
						}
						t.Fatalf("not every record delivered within 30s: claims of w1 %v, publishes %v", faulty.claimed(), rec.deliveries())
					}
				}
				stop1()
				stop2()
				for _, v := range check.failures() {
					t.Error(v)
				}
				got := rec.deliveries()
				checkOrder(t, got)
				per := map[int64]int{}
				for _, d := range got {
					per[d.ID]++
				}
				// A publish that outran PublishTimeout on a loaded machine is
				// nacked and published again, by design, and so is one whose
				// ack came after its lease ran out (the publish fits in the
				// lease, its ack need not); without either, each record is
				// published once.
				if outs.nacked.Load() == 0 && outs.dead.Load() == 0 && outs.lateAcks.Load() == 0 {
					for _, id := range ids {
						if per[id] != 1 {
							t.Errorf("record %d published %d times (publishes per id %v, claims of w1 %v): without a failed publish each record is published once",
								id, per[id], per, faulty.claimed())
						}
					}
				}
				t.Logf("claims of w1 %v, publishes per id %v, nacked %d, released %d, late acks %d",
					faulty.claimed(), per, outs.nacked.Load(), outs.released.Load(), outs.lateAcks.Load())
			})
		}
	}
}
