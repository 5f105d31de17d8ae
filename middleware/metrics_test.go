package middleware_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/metrics"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/middleware"
)

const (
	publishedTotal    = "txoutbox_forwarder_published_total"
	failedTotal       = "txoutbox_forwarder_failed_total"
	retriedTotal      = "txoutbox_forwarder_retried_total"
	deadLetteredTotal = "txoutbox_forwarder_dead_lettered_total"
	publishDuration   = "txoutbox_forwarder_publish_duration_seconds"
	lagSeconds        = "txoutbox_forwarder_lag_seconds"
)

var errBroker = errors.New("broker unavailable")

func newMetrics(t *testing.T, reg prometheus.Registerer, maxAttempts int) *middleware.Metrics {
	t.Helper()
	m, err := middleware.NewMetrics(reg, middleware.MetricsConfig{MaxAttempts: maxAttempts})
	if err != nil {
		t.Fatalf("NewMetrics: %v", err)
	}
	return m
}

func newForwarder(t *testing.T, o *outbox, p message.Publisher, cfg txoutbox.ForwarderConfig) *txoutbox.Forwarder {
	t.Helper()
	f, err := txoutbox.NewForwarder(o.store, p, cfg, nil)
	if err != nil {
		t.Fatalf("NewForwarder: %v", err)
	}
	return f
}

func topic(name string) map[string]string { return map[string]string{"topic": name} }

func TestMetricsCountPublishesPerTopic(t *testing.T) {
	t.Parallel()
	o := newOutbox(t)
	reg := prometheus.NewRegistry()
	m := newMetrics(t, reg, 0)
	o.publish(t, "orders", "order-1", "a", "b", "c")
	o.publish(t, "payments", "", "x", "y")

	f := newForwarder(t, o, newTarget(nil), fastConfig(0, m.Middleware))
	res, err := f.RunOnce(context.Background())
	if err != nil || res.Published != 5 {
		t.Fatalf("RunOnce = %+v, %v; want 5 published", res, err)
	}

	err = testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP txoutbox_forwarder_published_total Records the forwarder published to the target.
# TYPE txoutbox_forwarder_published_total counter
txoutbox_forwarder_published_total{topic="orders"} 3
txoutbox_forwarder_published_total{topic="payments"} 2
`), publishedTotal)
	if err != nil {
		t.Error(err)
	}
	for name, want := range map[string]float64{"orders": 3, "payments": 2} {
		if got := value(t, reg, publishDuration, map[string]string{"topic": name, "outcome": "published"}); got != want {
			t.Errorf("%s{topic=%q,outcome=published} count = %v, want %v", publishDuration, name, got, want)
		}
		if got := value(t, reg, lagSeconds, topic(name)); got != want {
			t.Errorf("%s{topic=%q} count = %v, want %v", lagSeconds, name, got, want)
		}
	}
	// The lag runs from insertion to publish: positive, and short here.
	lag := find(t, reg, lagSeconds, topic("orders")).GetHistogram()
	if s := lag.GetSampleSum(); s <= 0 || s > 3*10 {
		t.Errorf("lag sum = %vs over 3 records, want in (0, 30]", s)
	}
	if n, err := testutil.GatherAndCount(reg, failedTotal, retriedTotal, deadLetteredTotal); err != nil || n != 0 {
		t.Errorf("failure series = %d (%v), want none", n, err)
	}
	if problems, err := testutil.GatherAndLint(reg); err != nil || len(problems) > 0 {
		t.Errorf("lint: %v %v", problems, err)
	}
}

func TestMetricsCountRetries(t *testing.T) {
	t.Parallel()
	o := newOutbox(t)
	reg := prometheus.NewRegistry()
	m := newMetrics(t, reg, 5)
	o.publish(t, "orders", "", "a", "b")

	// Each message fails its first two publishes: the forwarder nacks them and
	// delivers them on attempt 3.
	p := newTarget(func(_ *message.Message, try int) error {
		if try <= 2 {
			return errBroker
		}
		return nil
	})
	cfg := fastConfig(5, m.Middleware)
	// Both failing with nothing published between them is what an outage
	// looks like; this test is about retries.
	cfg.OutageThreshold = 100
	f := newForwarder(t, o, p, cfg)
	runUntil(t, f, "2 records delivered", func() bool { _, delivered, _ := o.stats(t); return delivered == 2 })

	err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP txoutbox_forwarder_failed_total Publishes to the target that failed (each try counts).
# TYPE txoutbox_forwarder_failed_total counter
txoutbox_forwarder_failed_total{topic="orders"} 4
# HELP txoutbox_forwarder_published_total Records the forwarder published to the target.
# TYPE txoutbox_forwarder_published_total counter
txoutbox_forwarder_published_total{topic="orders"} 2
# HELP txoutbox_forwarder_retried_total Failed publishes that will be retried, by the forwarder's attempt number.
# TYPE txoutbox_forwarder_retried_total counter
txoutbox_forwarder_retried_total{attempt="1",topic="orders"} 2
txoutbox_forwarder_retried_total{attempt="2",topic="orders"} 2
`), publishedTotal, failedTotal, retriedTotal, deadLetteredTotal)
	if err != nil {
		t.Error(err)
	}
	if got := value(t, reg, publishDuration, map[string]string{"topic": "orders", "outcome": "failed"}); got != 4 {
		t.Errorf("failed publish durations = %v, want 4", got)
	}
	for _, r := range p.received() {
		if r.Attempt != 3 {
			t.Errorf("message %s delivered on attempt %d, want 3", r.UUID, r.Attempt)
		}
	}
}

func TestMetricsCountDeadLetters(t *testing.T) {
	t.Parallel()
	o := newOutbox(t)
	reg := prometheus.NewRegistry()
	m := newMetrics(t, reg, 2)
	o.publish(t, "doomed", "", "never")
	o.publish(t, "fine", "", "ok")

	p := newTarget(func(msg *message.Message, _ int) error {
		if string(msg.Payload) == "never" {
			return errBroker
		}
		return nil
	})
	f := newForwarder(t, o, p, fastConfig(2, m.Middleware))
	runUntil(t, f, "one record delivered, one dead", func() bool {
		_, delivered, dead := o.stats(t)
		return delivered == 1 && dead == 1
	})

	err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP txoutbox_forwarder_dead_lettered_total Failed publishes on the last attempt: the record is dead-lettered.
# TYPE txoutbox_forwarder_dead_lettered_total counter
txoutbox_forwarder_dead_lettered_total{topic="doomed"} 1
# HELP txoutbox_forwarder_failed_total Publishes to the target that failed (each try counts).
# TYPE txoutbox_forwarder_failed_total counter
txoutbox_forwarder_failed_total{topic="doomed"} 2
# HELP txoutbox_forwarder_published_total Records the forwarder published to the target.
# TYPE txoutbox_forwarder_published_total counter
txoutbox_forwarder_published_total{topic="fine"} 1
# HELP txoutbox_forwarder_retried_total Failed publishes that will be retried, by the forwarder's attempt number.
# TYPE txoutbox_forwarder_retried_total counter
txoutbox_forwarder_retried_total{attempt="1",topic="doomed"} 1
`), publishedTotal, failedTotal, retriedTotal, deadLetteredTotal)
	if err != nil {
		t.Error(err)
	}
	if _, ok := sample(t, reg, lagSeconds, topic("doomed")); ok {
		t.Error("a lag was observed for a record never published")
	}
}

// Watermill's Retry and Timeout run inside the forwarder's chain, around the
// metrics middleware, which therefore sees every in-process try.
func TestMetricsInsideWatermillRetryAndTimeout(t *testing.T) {
	t.Parallel()
	o := newOutbox(t)
	reg := prometheus.NewRegistry()
	m := newMetrics(t, reg, 0)
	o.publish(t, "orders", "order-1", "a")

	const timeout = 100 * time.Millisecond
	// Try 1 hangs until Watermill's Timeout cancels its context, try 2 fails,
	// try 3 succeeds: all within the forwarder's first attempt.
	p := newTarget(func(msg *message.Message, try int) error {
		switch try {
		case 1:
			<-msg.Context().Done()
			return msg.Context().Err()
		case 2:
			return errBroker
		}
		return nil
	})
	retry := wmw.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, Multiplier: 1, ResetContextOnRetry: true}
	f := newForwarder(t, o, p, fastConfig(0, retry.Middleware, wmw.Timeout(timeout), m.Middleware))

	res, err := f.RunOnce(context.Background())
	if err != nil || res.Published != 1 || res.Nacked != 0 {
		t.Fatalf("RunOnce = %+v, %v; want 1 published, none nacked", res, err)
	}
	err = testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP txoutbox_forwarder_failed_total Publishes to the target that failed (each try counts).
# TYPE txoutbox_forwarder_failed_total counter
txoutbox_forwarder_failed_total{topic="orders"} 2
# HELP txoutbox_forwarder_published_total Records the forwarder published to the target.
# TYPE txoutbox_forwarder_published_total counter
txoutbox_forwarder_published_total{topic="orders"} 1
# HELP txoutbox_forwarder_retried_total Failed publishes that will be retried, by the forwarder's attempt number.
# TYPE txoutbox_forwarder_retried_total counter
txoutbox_forwarder_retried_total{attempt="1",topic="orders"} 2
`), publishedTotal, failedTotal, retriedTotal, deadLetteredTotal)
	if err != nil {
		t.Error(err)
	}
	failed := find(t, reg, publishDuration, map[string]string{"topic": "orders", "outcome": "failed"}).GetHistogram()
	// Watermill's Timeout starts its clock before the metrics middleware
	// starts its own, so the hung try measures a little under the timeout;
	// what matters is that the hang is in the histogram, not a 0s sample.
	if minHang := 0.9 * timeout.Seconds(); failed.GetSampleCount() != 2 || failed.GetSampleSum() < minHang {
		t.Errorf("failed durations: %d samples, %vs in all; want 2, at least %.3fs (the %s timeout less the time before the metrics clock starts)", failed.GetSampleCount(), failed.GetSampleSum(), minHang, timeout)
	}
	got := p.received()
	if len(got) != 1 || got[0].Attempt != 1 {
		t.Errorf("target got %+v, want one message on attempt 1", got)
	}
}

func TestMetricsCountPanicAsFailure(t *testing.T) {
	t.Parallel()
	o := newOutbox(t)
	reg := prometheus.NewRegistry()
	m := newMetrics(t, reg, 3)
	o.publish(t, "orders", "", "a")

	boom := func(message.HandlerFunc) message.HandlerFunc {
		return func(*message.Message) ([]*message.Message, error) { panic("boom") }
	}
	f := newForwarder(t, o, newTarget(nil), fastConfig(3, m.Middleware, boom))
	res, err := f.RunOnce(context.Background())
	if err != nil || res.Nacked != 1 {
		t.Fatalf("RunOnce = %+v, %v; want 1 nacked", res, err)
	}
	if got := value(t, reg, failedTotal, topic("orders")); got != 1 {
		t.Errorf("failed = %v, want 1", got)
	}
	if got := value(t, reg, retriedTotal, map[string]string{"topic": "orders", "attempt": "1"}); got != 1 {
		t.Errorf("retried = %v, want 1", got)
	}
}

// Watermill's components/metrics and these metrics share one registry, even
// when Watermill's are given the same namespace and subsystem.
func TestMetricsCoexistWithWatermillMetrics(t *testing.T) {
	t.Parallel()
	o := newOutbox(t)
	reg := prometheus.NewRegistry()
	m := newMetrics(t, reg, 0)
	var chain []message.HandlerMiddleware
	var pub message.Publisher = newTarget(nil)
	for _, ns := range [][2]string{{"", ""}, {"txoutbox", ""}, {"txoutbox", "forwarder"}, {"txoutbox", "outbox"}} {
		b := metrics.NewPrometheusMetricsBuilder(reg, ns[0], ns[1])
		var err error
		if pub, err = b.DecoratePublisher(pub); err != nil {
			t.Fatalf("Watermill metrics %v: %v", ns, err)
		}
		chain = append(chain, b.NewRouterMiddleware().Middleware)
	}
	stats, err := middleware.NewStatsCollector(o.store, middleware.StatsCollectorConfig{})
	if err != nil {
		t.Fatal(err)
	}
	reg.MustRegister(stats)
	o.publish(t, "orders", "", "a")

	f := newForwarder(t, o, pub, fastConfig(0, append(chain, m.Middleware)...))
	if res, err := f.RunOnce(context.Background()); err != nil || res.Published != 1 {
		t.Fatalf("RunOnce = %+v, %v; want 1 published", res, err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("Gather with both sets of metrics: %v", err)
	}
	names := map[string]bool{}
	for _, mf := range mfs {
		names[mf.GetName()] = true
	}
	for _, want := range []string{
		publishedTotal, publishDuration, lagSeconds, "txoutbox_outbox_pending",
		"handler_execution_time_seconds", "txoutbox_forwarder_handler_execution_time_seconds",
		// Stacked publisher decorators observe only in the outermost one.
		"txoutbox_outbox_publish_time_seconds",
	} {
		if !names[want] {
			t.Errorf("metric %s missing from the registry (have %v)", want, names)
		}
	}
}

func TestNewMetrics(t *testing.T) {
	t.Parallel()
	if _, err := middleware.NewMetrics(nil, middleware.MetricsConfig{}); err == nil {
		t.Error("NewMetrics(nil registerer) succeeded")
	}
	if _, err := middleware.NewMetrics(prometheus.NewRegistry(), middleware.MetricsConfig{MaxAttempts: -1}); err == nil || !strings.Contains(err.Error(), "MaxAttempts") {
		t.Errorf("NewMetrics(MaxAttempts -1) = %v, want an error naming MaxAttempts", err)
	}

	// Made twice on one registry, the metrics share their collectors.
	reg := prometheus.NewRegistry()
	newMetrics(t, reg, 0)
	o := newOutbox(t)
	o.publish(t, "orders", "", "a")
	f := newForwarder(t, o, newTarget(nil), fastConfig(0, newMetrics(t, reg, 0).Middleware))
	if _, err := f.RunOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := value(t, reg, publishedTotal, topic("orders")); got != 1 {
		t.Errorf("published = %v, want 1", got)
	}

	// Const labels tell two sets apart on one registry (with the same label
	// names in each set).
	labelled := prometheus.NewRegistry()
	for _, table := range []string{"a", "b"} {
		if _, err := middleware.NewMetrics(labelled, middleware.MetricsConfig{ConstLabels: prometheus.Labels{"table": table}}); err != nil {
			t.Errorf("NewMetrics with table=%s: %v", table, err)
		}
	}

	// A different metric under one of the names is an error, not a panic.
	clash := prometheus.NewRegistry()
	clash.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: publishedTotal, Help: "something else"}))
	if _, err := middleware.NewMetrics(clash, middleware.MetricsConfig{}); err == nil {
		t.Error("NewMetrics over a clashing registry succeeded")
	}
}

// OnOutcome counts the forwarder's own outcomes, released records included,
// which no middleware sees.
func TestMetricsOnOutcomeCountsForwarderOutcomes(t *testing.T) {
	t.Parallel()
	o := newOutbox(t)
	reg := prometheus.NewRegistry()
	m := newMetrics(t, reg, 2)
	o.publish(t, "orders", "k", "first", "second")

	// "first" fails twice and is dead-lettered; "second" waits behind it
	// (released) on the first failure, then is published.
	p := newTarget(func(msg *message.Message, _ int) error {
		if string(msg.Payload) == "first" {
			return errBroker
		}
		return nil
	})
	cfg := fastConfig(2)
	cfg.OnOutcome = m.OnOutcome
	f := newForwarder(t, o, p, cfg)
	runUntil(t, f, "one delivered, one dead", func() bool {
		_, delivered, dead := o.stats(t)
		return delivered == 1 && dead == 1
	})
	err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP txoutbox_forwarder_outcomes_total What became of claimed records, as the forwarder wrote it back (set ForwarderConfig.OnOutcome = metrics.OnOutcome).
# TYPE txoutbox_forwarder_outcomes_total counter
txoutbox_forwarder_outcomes_total{outcome="dead_lettered",topic="orders"} 1
txoutbox_forwarder_outcomes_total{outcome="nacked",topic="orders"} 1
txoutbox_forwarder_outcomes_total{outcome="published",topic="orders"} 1
txoutbox_forwarder_outcomes_total{outcome="released",topic="orders"} 1
`), "txoutbox_forwarder_outcomes_total")
	if err != nil {
		t.Error(err)
	}
}

// The abandoned publishes gauge follows Forwarder.AbandonedPublishes: one
// publish hung in a target that ignores its context counts until it returns.
func TestMetricsAbandonedPublishesGauge(t *testing.T) {
	t.Parallel()
	o := newOutbox(t)
	reg := prometheus.NewRegistry()
	m := newMetrics(t, reg, 5)
	o.publish(t, "orders", "k", "hangs")
	hang := make(chan struct{})
	var once sync.Once
	defer once.Do(func() { close(hang) })
	p := newTarget(func(*message.Message, int) error { <-hang; return nil })
	cfg := fastConfig(5)
	cfg.PublishTimeout = 20 * time.Millisecond
	f := newForwarder(t, o, p, cfg)
	m.WatchForwarder(f)
	const name = "txoutbox_forwarder_abandoned_publishes"
	if got := value(t, reg, name, nil); got != 0 {
		t.Fatalf("%s = %v before any publish, want 0", name, got)
	}
	if res, err := f.RunOnce(context.Background()); err != nil || res.Nacked != 1 {
		t.Fatalf("RunOnce = %+v, %v; want the hung publish nacked at its timeout", res, err)
	}
	if got := value(t, reg, name, nil); got != 1 {
		t.Fatalf("%s = %v while the publish hangs, want 1", name, got)
	}
	once.Do(func() { close(hang) })
	deadline := time.Now().Add(10 * time.Second)
	for value(t, reg, name, nil) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%s still %v after the target returned", name, value(t, reg, name, nil))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// The outages gauge follows Forwarder.Outages: a topic down has a series
// while it is, the whole target's series is always there.
func TestMetricsOutagesGauge(t *testing.T) {
	t.Parallel()
	o := newOutbox(t)
	reg := prometheus.NewRegistry()
	m := newMetrics(t, reg, 5)
	for _, k := range []string{"a", "b", "c", "d"} {
		o.publish(t, "orders", k, "x")
	}
	var down atomic.Bool
	down.Store(true)
	p := newTarget(func(*message.Message, int) error {
		if down.Load() {
			return errors.New("broker down")
		}
		return nil
	})
	cfg := fastConfig(5)
	cfg.ProbeInterval, cfg.ProbeIntervalMax = 2*time.Millisecond, 10*time.Millisecond
	f := newForwarder(t, o, p, cfg)
	m.WatchForwarder(f)
	const name = "txoutbox_forwarder_outages"
	if got := value(t, reg, name, topic("")); got != 0 {
		t.Fatalf("%s{topic=\"\"} = %v before any publish, want 0", name, got)
	}
	runUntil(t, f, "the outage to be seen", func() bool { return len(f.Outages()) > 0 })
	if got := value(t, reg, name, topic("orders")); got != 1 {
		t.Fatalf("%s{topic=\"orders\"} = %v while it is down, want 1", name, got)
	}
	if got := value(t, reg, name, topic("")); got != 0 {
		t.Fatalf("%s{topic=\"\"} = %v with one topic down, want 0", name, got)
	}
	down.Store(false)
	runUntil(t, f, "the outage to end", func() bool { return len(f.Outages()) == 0 })
	if _, ok := sample(t, reg, name, topic("orders")); ok {
		t.Fatalf("%s{topic=\"orders\"} still there after the outage", name)
	}
}
