package middleware_test

import (
	"context"
	"database/sql"
	"maps"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// outbox is a SQLite outbox in a test's temporary directory.
type outbox struct {
	db    *sql.DB
	store *sqlite.Storage
}

func newOutbox(t *testing.T) *outbox {
	t.Helper()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "outbox.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	s, err := sqlite.New(db, sqlite.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CreateSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return &outbox{db: db, store: s}
}

// publish writes one record per payload to topic through the transactional
// publisher, in one transaction, and returns the messages' UUIDs.
func (o *outbox) publish(t *testing.T, topic, key string, payloads ...string) []string {
	t.Helper()
	tx, err := o.db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	pub, err := txoutbox.NewTxPublisher(o.store, tx, txoutbox.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var uuids []string
	for _, p := range payloads {
		msg := message.NewMessage(watermill.NewUUID(), []byte(p))
		if key != "" {
			msg.Metadata.Set(txoutbox.MetadataKey, key)
		}
		if err := pub.Publish(topic, msg); err != nil {
			t.Fatalf("Publish: %v", err)
		}
		uuids = append(uuids, msg.UUID)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return uuids
}

func (o *outbox) stats(t *testing.T) (pending, delivered, dead int64) {
	t.Helper()
	st, err := o.store.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return st.Pending, st.Delivered, st.Dead
}

// received is one message the target got.
type received struct {
	Topic    string
	UUID     string
	Attempt  int
	Metadata message.Metadata
}

// target is a Watermill publisher that records what it gets. fail, when set,
// decides the outcome of each publish; tries counts publishes per UUID.
type target struct {
	mu    sync.Mutex
	got   []received
	tries map[string]int
	fail  func(msg *message.Message, try int) error
}

func newTarget(fail func(msg *message.Message, try int) error) *target {
	return &target{tries: map[string]int{}, fail: fail}
}

func (p *target) Publish(topic string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		p.mu.Lock()
		p.tries[msg.UUID]++
		try := p.tries[msg.UUID]
		p.mu.Unlock()
		if p.fail != nil {
			if err := p.fail(msg, try); err != nil {
				return err
			}
		}
		attempt, _ := strconv.Atoi(msg.Metadata.Get(txoutbox.MetadataAttempt))
		p.mu.Lock()
		p.got = append(p.got, received{Topic: topic, UUID: msg.UUID, Attempt: attempt, Metadata: maps.Clone(msg.Metadata)})
		p.mu.Unlock()
	}
	return nil
}

func (p *target) Close() error { return nil }

func (p *target) received() []received {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]received(nil), p.got...)
}

// fastConfig is a forwarder configuration whose retries come quickly.
func fastConfig(maxAttempts int, mw ...message.HandlerMiddleware) txoutbox.ForwarderConfig {
	return txoutbox.ForwarderConfig{
		BatchSize:   50,
		Lease:       10 * time.Second,
		MaxAttempts: maxAttempts,
		PollMin:     2 * time.Millisecond,
		PollMax:     10 * time.Millisecond,
		Backoff:     txoutbox.Backoff{Base: time.Millisecond, Max: 5 * time.Millisecond, Jitter: txoutbox.NoJitter},
		Middlewares: mw,
	}
}

// runUntil runs rounds of f until cond holds, failing the test at the deadline.
func runUntil(t *testing.T, f *txoutbox.Forwarder, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		res, err := f.RunOnce(context.Background())
		if err != nil {
			t.Fatalf("RunOnce: %v", err)
		}
		if res.Claimed == 0 {
			time.Sleep(2 * time.Millisecond) // retries are due a few ms later
		}
	}
}

// sample returns the value of the metric name with exactly labels (const
// labels included): a counter's or gauge's value, a histogram's sample count.
// ok is false when there is no such series.
func sample(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) (value float64, ok bool) {
	t.Helper()
	m := find(t, g, name, labels)
	if m == nil {
		return 0, false
	}
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue(), true
	case m.Gauge != nil:
		return m.Gauge.GetValue(), true
	case m.Histogram != nil:
		return float64(m.Histogram.GetSampleCount()), true
	}
	t.Fatalf("metric %s has an unexpected type", name)
	return 0, false
}

// value is sample for a series that must exist.
func value(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	v, ok := sample(t, g, name, labels)
	if !ok {
		t.Fatalf("no series %s%v", name, labels)
	}
	return v
}

// snapshot gathers g once and returns a Gatherer that replays that result.
func snapshot(t *testing.T, g prometheus.Gatherer) prometheus.Gatherer {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("Gather: %v", err)
	}
	return prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) { return mfs, nil })
}

func find(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) *dto.Metric {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("Gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			if maps.Equal(got, labels) {
				return m
			}
		}
	}
	return nil
}
