package txoutbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
)

// dueRecorder records, per message UUID, when the target received it.
type dueRecorder struct {
	mu   sync.Mutex
	at   map[string]time.Time
	uuid []string // in delivery order
}

func (r *dueRecorder) Publish(_ string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range msgs {
		if _, ok := r.at[m.UUID]; !ok {
			r.at[m.UUID] = time.Now()
			r.uuid = append(r.uuid, m.UUID)
		}
	}
	return nil
}

func (r *dueRecorder) Close() error { return nil }

func (r *dueRecorder) got(uuid string) (time.Time, int, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, u := range r.uuid {
		if u == uuid {
			return r.at[uuid], i, true
		}
	}
	return time.Time{}, 0, false
}

// TestForwarderDelayedDelivery: on every storage, through the transactional
// publisher (memory: its Add), a delayed record reaches the target no
// earlier than its time, and under strict ordering the later records of
// its key follow it, in order (that other keys are not held back is the
// contract suite's DelayedDelivery cases).
func TestForwarderDelayedDelivery(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			due := time.Now().Add(time.Second)
			rec := func(key string, delayed bool) storage.Record {
				r := record("orders", key, "x")
				if delayed {
					r.DueAt = due
				}
				return r
			}
			recs := []storage.Record{rec("a", true), rec("a", false), rec("b", false), rec("", true), rec("", false)}
			b.insert(t, s, recs...)
			target := &dueRecorder{at: map[string]time.Time{}}
			stop := runForwarder(t, newForwarder(t, s, target, fastConfig()))
			waitFor(t, 20*time.Second, "all five records delivered", func() bool {
				_, _, ok := target.got(recs[0].UUID)
				_, _, ok1 := target.got(recs[1].UUID)
				_, _, ok3 := target.got(recs[3].UUID)
				return ok && ok1 && ok3
			})
			stop()
			const tolerance = 25 * time.Millisecond // the database's clock against the test's
			for i, r := range recs {
				at, _, ok := target.got(r.UUID)
				if !ok {
					t.Fatalf("record %d (key %q) never delivered", i, r.Key)
				}
				if (i == 0 || i == 1 || i == 3) && at.Before(due.Add(-tolerance)) {
					t.Errorf("record %d (key %q) delivered %v before the delayed time of its key's head", i, r.Key, due.Sub(at))
				}
			}
			_, head, _ := target.got(recs[0].UUID)
			_, next, _ := target.got(recs[1].UUID)
			if next < head {
				t.Errorf("record 1 of key a delivered before its delayed head: per-key order broken")
			}
		})
	}
}

// TestPublisherDeliverAt: DeliverAt, Delay and Watermill's delay metadata
// set the record's due time; MetadataDeliverAt wins over Watermill's; a
// value that is not an RFC 3339 time is refused and nothing is written.
func TestPublisherDeliverAt(t *testing.T) {
	ins := &dueInserter{}
	pub, err := txoutbox.NewTxPublisher(ins, new(int), txoutbox.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	at := time.Date(2030, 1, 2, 3, 4, 5, 600_000_000, time.UTC)
	newMsg := func() *message.Message { return message.NewMessage(watermill.NewUUID(), nil) }

	plain, own, delayed, wm, both := newMsg(), newMsg(), newMsg(), newMsg(), newMsg()
	txoutbox.DeliverAt(own, at)
	before := time.Now()
	txoutbox.Delay(delayed, time.Hour)
	delay.Message(wm, delay.Until(at))
	delay.Message(both, delay.Until(at.Add(time.Hour)))
	txoutbox.DeliverAt(both, at)
	if err := pub.Publish("t", plain, own, delayed, wm, both); err != nil {
		t.Fatal(err)
	}
	got := ins.records
	if !got[0].DueAt.IsZero() {
		t.Errorf("a message without delay metadata got DueAt %v, want zero", got[0].DueAt)
	}
	if !got[1].DueAt.Equal(at) {
		t.Errorf("DeliverAt: DueAt %v, want %v", got[1].DueAt, at)
	}
	if d := got[2].DueAt.Sub(before); d < time.Hour || d > time.Hour+time.Minute {
		t.Errorf("Delay(1h): DueAt %v after the call, want an hour", d)
	}
	if !got[3].DueAt.Equal(at.Truncate(time.Second)) {
		t.Errorf("Watermill's delay.Message: DueAt %v, want %v", got[3].DueAt, at.Truncate(time.Second))
	}
	if !got[4].DueAt.Equal(at) {
		t.Errorf("both metadata: DueAt %v, want txoutbox's %v", got[4].DueAt, at)
	}
	if got[1].Metadata[txoutbox.MetadataDeliverAt] == "" {
		t.Error("MetadataDeliverAt was removed from the stored metadata, want it kept for the consumer")
	}

	for name, v := range map[string]message.Metadata{
		"txoutbox":  {txoutbox.MetadataDeliverAt: "tomorrow"},
		"watermill": {delay.DelayedUntilKey: "2030-01-02 03:04:05"},
	} {
		ins.records = nil
		bad := newMsg()
		bad.Metadata = v
		err := pub.Publish("t", newMsg(), bad)
		if !errors.Is(err, txoutbox.ErrInvalidMessage) || ins.records != nil {
			t.Errorf("%s metadata that is not a time: err %v, %d records written; want ErrInvalidMessage and nothing", name, err, len(ins.records))
		}
	}
}

type dueInserter struct{ records []storage.Record }

func (d *dueInserter) Insert(_ context.Context, _ any, recs []storage.Record) error {
	d.records = append(d.records, recs...)
	return nil
}

// TestForwarderRetention: four forwarders relaying one table on every
// storage, with retention on: each delivered record is deleted exactly once
// (their Pruned counts add up to the delivered records), dead and delayed
// (pending) records are never touched.
func TestForwarderRetention(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			s := b.new(t)
			var recs []storage.Record
			poison := map[string]bool{}
			for i := range 120 {
				r := record("orders", fmt.Sprintf("k%d", i%6), fmt.Sprint(i))
				if i%20 == 7 {
					poison[r.UUID] = true
				}
				recs = append(recs, r)
			}
			later := record("orders", "", "later")
			later.DueAt = time.Now().Add(time.Hour)
			recs = append(recs, later)
			ids := b.insert(t, s, recs...)
			target := newRecorder()
			target.fail = func(d delivery) error {
				if poison[d.UUID] {
					return errors.New("poison")
				}
				return nil
			}
			cfg := fastConfig()
			cfg.MaxAttempts = 1 // a failure dead-letters at once
			cfg.Retention = time.Nanosecond
			cfg.RetentionInterval = 10 * time.Millisecond
			var fwds []*txoutbox.Forwarder
			for i := range 4 {
				cfg.WorkerID = fmt.Sprintf("w%d", i)
				f := newForwarder(t, s, target, cfg)
				fwds = append(fwds, f)
				runForwarder(t, f)
			}
			delivered := int64(len(recs) - 1 - len(poison))
			pruned := func() (n int64) {
				for _, f := range fwds {
					n += f.Pruned()
				}
				return n
			}
			waitFor(t, 30*time.Second, "every delivered record pruned, every poison one dead", func() bool {
				st, err := s.(storage.StatsReader).Stats(t.Context())
				return err == nil && pruned() >= delivered && st.Dead == int64(len(poison))
			})
			st, err := s.(storage.StatsReader).Stats(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if n := pruned(); n != delivered || st.Delivered != 0 {
				t.Fatalf("the forwarders pruned %d records, Stats.Delivered %d; want %d pruned (each delivered record once) and none left", n, st.Delivered, delivered)
			}
			if st.Dead != int64(len(poison)) || st.Pending != 1 {
				t.Fatalf("Stats %+v after retention: want the %d dead records and the delayed one pending untouched", st, len(poison))
			}
			for i, r := range recs {
				if poison[r.UUID] {
					if got := b.inspect(t, s, ids[i]); got.Status != storage.StatusDead {
						t.Errorf("dead record %d is %q after retention, want dead", ids[i], got.Status)
					}
				}
			}
			if got := b.inspect(t, s, ids[len(ids)-1]); got.Status != storage.StatusPending {
				t.Errorf("delayed record is %q after retention, want pending", got.Status)
			}
		})
	}
}
