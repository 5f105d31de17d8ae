package txoutbox_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
)

// outageConfig: MaxAttempts 4 with a retry schedule of 10+20+40 ms, probes
// every 10 ms doubling to 40 ms.
func outageConfig() txoutbox.ForwarderConfig {
	cfg := fastConfig()
	cfg.MaxAttempts = 4
	cfg.Backoff = txoutbox.Backoff{Base: 10 * time.Millisecond, Max: 40 * time.Millisecond, Jitter: txoutbox.NoJitter}
	cfg.ProbeInterval = 10 * time.Millisecond
	cfg.ProbeIntervalMax = 40 * time.Millisecond
	return cfg
}

// retrySchedule is the time a record takes from its first attempt to its
// last under cfg's backoff.
func retrySchedule(cfg txoutbox.ForwarderConfig) time.Duration {
	var d time.Duration
	for a := 1; a < cfg.MaxAttempts; a++ {
		d += cfg.Backoff.Delay(a)
	}
	return d
}

// switchTarget is a recorder whose topics can be taken down: a publish to a
// topic that is down fails with err, and is counted.
type switchTarget struct {
	*recorder
	mu      sync.Mutex
	down    map[string]error
	refused atomic.Int64 // publishes refused while down
	// firstRefusal: when the first publish was refused.
	firstRefusal atomic.Pointer[time.Time]
}

func newSwitchTarget() *switchTarget {
	t := &switchTarget{recorder: newRecorder(), down: map[string]error{}}
	t.setFail(func(d delivery) error {
		t.mu.Lock()
		err := t.down[d.Topic]
		t.mu.Unlock()
		if err != nil {
			now := time.Now()
			t.firstRefusal.CompareAndSwap(nil, &now)
			t.refused.Add(1)
		}
		return err
	})
	return t
}

func (t *switchTarget) set(topic string, err error) {
	t.mu.Lock()
	t.down[topic] = err
	t.mu.Unlock()
}

// driver runs a forwarder either through Run or through RunOnce called in a
// loop (a cron job made fast), until stopped.
func drive(t *testing.T, f *txoutbox.Forwarder, once bool) (stop func()) {
	t.Helper()
	if !once {
		return runForwarder(t, f)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			if _, err := f.RunOnce(ctx); err != nil {
				t.Errorf("RunOnce: %v", err)
				return
			}
			select {
			case <-ctx.Done():
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()
	var o sync.Once
	stop = func() { o.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

func modes() []struct {
	name string
	once bool
} {
	return []struct {
		name string
		once bool
	}{{"Run", false}, {"RunOnce", true}}
}

// A broker outage twenty times the whole retry schedule, several keys with
// backlogs on two topics: nothing is dead-lettered, the publishes during the
// outage follow the probe schedule (not one per record and retry), the next
// probe after recovery is at most ProbeIntervalMax away, and after it every
// record is delivered once, in order per key.
func TestForwarderOutageCostsOnlyTime(t *testing.T) {
	for _, b := range backends(t) {
		for _, m := range modes() {
			for _, class := range []string{"plain", "unavailable"} {
				t.Run(b.name+"/"+m.name+"/"+class, func(t *testing.T) {
					t.Parallel()
					s := b.new(t)
					const keys, perKey = 5, 6
					var recs []storage.Record
					for i := range keys * perKey {
						k := i % keys
						recs = append(recs, record(fmt.Sprintf("t%d", k%2), fmt.Sprintf("k%d", k), fmt.Sprint(i)))
					}
					ids := b.insert(t, s, recs...)

					cfg := outageConfig()
					outage := 20 * retrySchedule(cfg)
					target := newSwitchTarget()
					down := error(errors.New("broker down"))
					if class == "unavailable" {
						down = txoutbox.Unavailable(down)
					}
					target.set("t0", down)
					target.set("t1", down)
					logs := &outageLogger{}
					f, err := txoutbox.NewForwarder(s, target, cfg, logs)
					if err != nil {
						t.Fatal(err)
					}
					stop := drive(t, f, m.once)

					waitFor(t, 10*time.Second, "the outage to be seen", func() bool { return len(f.Outages()) > 0 })
					start := *target.firstRefusal.Load()
					waitFor(t, 10*time.Second, "twenty retry schedules to pass", func() bool { return time.Since(start) >= outage })
					refused := target.refused.Load()
					outs := f.Outages()
					if len(outs) == 0 {
						t.Fatal("Outages() is empty while the target is down")
					}
					if err := f.Healthy(); !errors.Is(err, txoutbox.ErrOutage) {
						t.Fatalf("Healthy() = %v, want ErrOutage", err)
					}
					recovered := time.Now()
					for _, o := range outs {
						if next := o.NextProbe.Sub(recovered); next > cfg.ProbeIntervalMax {
							t.Errorf("outage %+v: next probe %s away, more than ProbeIntervalMax", o, next)
						}
					}
					target.set("t0", nil)
					target.set("t1", nil)
					elapsed := time.Since(start)

					// Before the outage is seen, at most the first failure of
					// each key and whatever was in flight; then one probe per
					// interval per topic, the intervals doubling to the max.
					doublings := int(math.Log2(float64(cfg.ProbeIntervalMax/cfg.ProbeInterval))) + 1
					bound := int64(2*keys + 3*(doublings+int(elapsed/cfg.ProbeIntervalMax)+1))
					if refused > bound {
						t.Errorf("%d publishes refused during an outage of %s, want at most %d (the probe schedule)", refused, elapsed, bound)
					}
					if naive := int64(keys * cfg.MaxAttempts); refused >= naive*4 {
						t.Errorf("%d publishes refused: no better than retrying every record", refused)
					}

					waitFor(t, 20*time.Second, "every record delivered", func() bool { return len(target.deliveries()) >= len(ids) })
					stop()
					got := target.deliveries()
					checkOrder(t, got)
					seen := map[int64]int{}
					for _, d := range got {
						seen[d.ID]++
					}
					for _, id := range ids {
						if seen[id] != 1 {
							t.Errorf("record %d delivered %d times, want once", id, seen[id])
						}
						if st := b.inspect(t, s, id); st.Status != storage.StatusDelivered {
							t.Errorf("record %d: %+v, want delivered", id, st)
						}
					}
					if outs := f.Outages(); len(outs) != 0 {
						t.Errorf("Outages() = %+v after recovery, want none", outs)
					}
					if err := f.Healthy(); err != nil {
						t.Errorf("Healthy() = %v after recovery", err)
					}
					// Each circuit that tripped (the target's, and a topic's
					// that tripped before it) logs its start and its end once.
					starts, ends := logs.starts.Load(), logs.ends.Load()
					if starts < 1 || starts > 3 || ends != starts {
						t.Errorf("%d outage starts and %d ends logged, want each outage logged once at its start and once at its end", starts, ends)
					}
				})
			}
		}
	}
}

// One topic down and another healthy: the healthy one is delivered during
// the outage with one attempt per record, and only the topic that is down
// is reported; after recovery it is delivered in order, nothing dead.
func TestForwarderOutageOfOneTopic(t *testing.T) {
	for _, b := range backends(t) {
		for _, m := range modes() {
			t.Run(b.name+"/"+m.name, func(t *testing.T) {
				t.Parallel()
				s := b.new(t)
				var recs []storage.Record
				for i := range 40 {
					topic := "up"
					if i%2 == 0 {
						topic = "down"
					}
					recs = append(recs, record(topic, fmt.Sprintf("%s%d", topic, i%8), fmt.Sprint(i)))
				}
				ids := b.insert(t, s, recs...)
				cfg := outageConfig()
				target := newSwitchTarget()
				target.set("down", errors.New("topic missing"))
				f := newForwarder(t, s, target, cfg)
				stop := drive(t, f, m.once)

				waitFor(t, 10*time.Second, "the healthy topic delivered and acked", func() bool {
					for i, id := range ids {
						if recs[i].Topic == "up" && b.inspect(t, s, id).Status != storage.StatusDelivered {
							return false
						}
					}
					return true
				})
				outs := f.Outages()
				if len(outs) != 1 || outs[0].Topic != "down" {
					t.Fatalf("Outages() = %+v, want the topic \"down\" only", outs)
				}
				start := *target.firstRefusal.Load()
				waitFor(t, 10*time.Second, "twenty retry schedules to pass", func() bool { return time.Since(start) >= 20*retrySchedule(cfg) })
				for i, id := range ids {
					if st := b.inspect(t, s, id); recs[i].Topic == "up" && (st.Status != storage.StatusDelivered || st.Attempts != 1) {
						t.Errorf("healthy record %d: %+v, want delivered at its first attempt", id, st)
					}
				}
				target.set("down", nil)
				waitFor(t, 20*time.Second, "every record delivered", func() bool { return len(target.deliveries()) >= len(ids) })
				stop()
				checkOrder(t, target.deliveries())
				for _, id := range ids {
					if st := b.inspect(t, s, id); st.Status != storage.StatusDelivered {
						t.Errorf("record %d: %+v, want delivered", id, st)
					}
				}
			})
		}
	}
}

// A poison record among healthy keys is no outage: it is retried and
// dead-lettered after MaxAttempts, its key's later records wait for it, and
// every other key is delivered meanwhile.
func TestForwarderPoisonRecordAmongHealthyKeys(t *testing.T) {
	for _, b := range backends(t) {
		for _, m := range modes() {
			t.Run(b.name+"/"+m.name, func(t *testing.T) {
				t.Parallel()
				s := b.new(t)
				var recs []storage.Record
				for i := range 30 {
					recs = append(recs, record("t", fmt.Sprintf("k%d", i%5), fmt.Sprint(i)))
				}
				ids := b.insert(t, s, recs...)
				poison := ids[0] // the head of k0
				target := newRecorder()
				var tries atomic.Int64
				target.setFail(func(d delivery) error {
					if d.ID == poison {
						tries.Add(1)
						return errors.New("schema mismatch")
					}
					return nil
				})
				cfg := outageConfig()
				f := newForwarder(t, s, target, cfg)
				stop := drive(t, f, m.once)
				waitFor(t, 20*time.Second, "the other records delivered", func() bool { return len(target.deliveries()) == len(ids)-1 })
				stop()
				if st := b.inspect(t, s, poison); st.Status != storage.StatusDead || st.Attempts != cfg.MaxAttempts {
					t.Errorf("poison record: %+v, want dead after %d attempts", st, cfg.MaxAttempts)
				}
				if n := tries.Load(); n != int64(cfg.MaxAttempts) {
					t.Errorf("poison record tried %d times, want %d", n, cfg.MaxAttempts)
				}
				if outs := f.Outages(); len(outs) != 0 {
					t.Errorf("Outages() = %+v, want none for a poison record", outs)
				}
				checkOrder(t, target.deliveries())
			})
		}
	}
}

// An error marked permanent dead-letters its record at its first attempt;
// the rest of the key goes on.
func TestForwarderPermanentErrorDeadLettersAtOnce(t *testing.T) {
	for _, b := range backends(t) {
		for _, m := range modes() {
			t.Run(b.name+"/"+m.name, func(t *testing.T) {
				t.Parallel()
				s := b.new(t)
				ids := b.insert(t, s, record("t", "k", "too large"), record("t", "k", "next"), record("t", "j", "other"))
				target := newRecorder()
				target.setFail(func(d delivery) error {
					if d.ID == ids[0] {
						return fmt.Errorf("encode: %w", txoutbox.Permanent(errors.New("message too large")))
					}
					return nil
				})
				f := newForwarder(t, s, target, outageConfig())
				stop := drive(t, f, m.once)
				waitFor(t, 10*time.Second, "the other records delivered", func() bool { return len(target.deliveries()) == 2 })
				stop()
				if st := b.inspect(t, s, ids[0]); st.Status != storage.StatusDead || st.Attempts != 1 {
					t.Errorf("record with a permanent error: %+v, want dead at its first attempt", st)
				}
			})
		}
	}
}

// outageLogger counts the outage start and end lines.
type outageLogger struct {
	watermill.NopLogger
	starts, ends atomic.Int64
}

func (l *outageLogger) Error(msg string, _ error, _ watermill.LogFields) {
	if strings.HasPrefix(msg, "Publish target down") {
		l.starts.Add(1)
	}
}

func (l *outageLogger) Info(msg string, _ watermill.LogFields) {
	if strings.HasPrefix(msg, "Publish target up again") {
		l.ends.Add(1)
	}
}

func (l *outageLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }
