package middleware

import (
	"cmp"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/txoutbox/txoutbox"
)

// Namespace prefixes every metric of this package.
const Namespace = "txoutbox"

// Label names of the forwarder metrics.
const (
	// LabelTopic is the topic the record is published to.
	LabelTopic = "topic"
	// LabelAttempt is the forwarder's attempt number, 1 for the first.
	LabelAttempt = "attempt"
	// LabelOutcome is "published" or "failed".
	LabelOutcome = "outcome"
)

// Values of LabelOutcome.
const (
	OutcomePublished = "published"
	OutcomeFailed    = "failed"
)

// Default buckets of [MetricsConfig].
var (
	// DurationBucketsDefault spans 0.5ms to 10s: in-process targets answer in
	// microseconds, a broker across a network in milliseconds.
	DurationBucketsDefault = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}
	// LagBucketsDefault spans 5ms to 1h: a relay keeping up shows tens of
	// milliseconds, a backlog drained after an outage minutes or hours.
	LagBucketsDefault = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600}
)

// MetricsConfig configures [Metrics]. The zero value is usable.
type MetricsConfig struct {
	// MaxAttempts must be the forwarder's MaxAttempts: a failed publish on an
	// attempt >= MaxAttempts is counted as dead-lettered, an earlier one as
	// retried. Defaults to txoutbox.MaxAttemptsDefault, the forwarder's default.
	MaxAttempts int
	// DurationBuckets are the buckets of the publish duration histogram, in
	// seconds. Defaults to DurationBucketsDefault.
	DurationBuckets []float64
	// LagBuckets are the buckets of the commit-to-publish lag histogram, in
	// seconds. Defaults to LagBucketsDefault.
	LagBuckets []float64
	// ConstLabels are added to every metric, for example to tell apart the
	// forwarders of two outbox tables in one process. Metrics sharing a
	// registry must use the same label names (table="a", table="b").
	ConstLabels prometheus.Labels
}

func (c *MetricsConfig) setDefaults() {
	c.MaxAttempts = cmp.Or(c.MaxAttempts, txoutbox.MaxAttemptsDefault)
	if c.DurationBuckets == nil {
		c.DurationBuckets = DurationBucketsDefault
	}
	if c.LagBuckets == nil {
		c.LagBuckets = LagBucketsDefault
	}
}

// Validate checks a configuration after defaults were applied.
func (c MetricsConfig) Validate() error {
	if c.MaxAttempts <= 0 {
		return fmt.Errorf("invalid metrics config: MaxAttempts must be > 0 (the forwarder's MaxAttempts), got %d", c.MaxAttempts)
	}
	return nil
}

// Metrics counts and times the forwarder's publishes. Put Middleware into
// txoutbox.ForwarderConfig.Middlewares.
//
// Middleware observes each call of the handler below it. Placed first, it sees
// one call per forwarder attempt, and its failure counts match the forwarder's
// outcomes exactly: retried means nacked, dead-lettered means dead-lettered.
// Placed inside Watermill's middleware.Retry, it also counts each in-process
// retry (as retried, under the forwarder's attempt); but on the forwarder's
// last attempt it cannot know whether Retry will try again, so every failed
// try there counts as dead-lettered. Records the forwarder dead-letters
// without publishing (undecodable, or claimed more than MaxAttempts times by
// crashed workers) never reach a middleware: watch txoutbox_outbox_dead from
// the StatsCollector for those. When a target ignores the context and outruns
// the forwarder's PublishTimeout, the forwarder retries the record at once,
// while Middleware counts whatever the publish returns when it ends.
type Metrics struct {
	maxAttempts  int
	published    *prometheus.CounterVec
	failed       *prometheus.CounterVec
	retried      *prometheus.CounterVec
	deadLettered *prometheus.CounterVec
	duration     *prometheus.HistogramVec
	lag          *prometheus.HistogramVec
	outcomes     *prometheus.CounterVec
	abandoned    *abandonedCollector
}

// NewMetrics registers the forwarder metrics with reg and returns them.
// Metrics made again with the same registry and ConstLabels share the
// registered collectors, so several forwarders in one process can use one
// registry.
func NewMetrics(reg prometheus.Registerer, config MetricsConfig) (*Metrics, error) {
	if reg == nil {
		return nil, errors.New("txoutbox/middleware: nil prometheus.Registerer (try prometheus.NewRegistry() or prometheus.DefaultRegisterer)")
	}
	config.setDefaults()
	if err := config.Validate(); err != nil {
		return nil, err
	}
	const sub = "forwarder"
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Subsystem: sub, Name: name, Help: help, ConstLabels: config.ConstLabels,
		}, labels)
	}
	histogram := func(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Subsystem: sub, Name: name, Help: help, Buckets: buckets, ConstLabels: config.ConstLabels,
		}, labels)
	}
	m := &Metrics{
		maxAttempts: config.MaxAttempts,
		published: counter("published_total",
			"Records the forwarder published to the target.", LabelTopic),
		failed: counter("failed_total",
			"Publishes to the target that failed (each try counts).", LabelTopic),
		retried: counter("retried_total",
			"Failed publishes that will be retried, by the forwarder's attempt number.", LabelTopic, LabelAttempt),
		deadLettered: counter("dead_lettered_total",
			"Failed publishes on the last attempt: the record is dead-lettered.", LabelTopic),
		duration: histogram("publish_duration_seconds",
			"Time one publish took through the rest of the middleware chain and the target.", config.DurationBuckets, LabelTopic, LabelOutcome),
		lag: histogram("lag_seconds",
			"Time from the record's insertion into the outbox to the end of its successful publish.", config.LagBuckets, LabelTopic),
		outcomes: counter("outcomes_total",
			"What became of claimed records, as the forwarder wrote it back (set ForwarderConfig.OnOutcome = metrics.OnOutcome).", LabelTopic, LabelOutcome),
	}
	m.abandoned = &abandonedCollector{desc: prometheus.NewDesc(
		prometheus.BuildFQName(Namespace, sub, "abandoned_publishes"),
		"Publishes that outlived their timeout and still run in the target, which ignores their context (see Metrics.WatchForwarder); at the forwarder's MaxAbandonedPublishes it claims nothing.",
		nil, config.ConstLabels),
		outages: prometheus.NewDesc(
			prometheus.BuildFQName(Namespace, sub, "outages"),
			"Outages the watched forwarders see (Forwarder.Outages), one per forwarder: topic=\"\" is the whole target, always present; a topic that is down has its own series while it is. Records of what is down are given back untried and one record probes it.",
			[]string{LabelTopic}, config.ConstLabels),
	}
	var err error
	if m.abandoned, err = register(reg, m.abandoned); err != nil {
		return nil, err
	}
	if m.published, err = register(reg, m.published); err != nil {
		return nil, err
	}
	if m.failed, err = register(reg, m.failed); err != nil {
		return nil, err
	}
	if m.retried, err = register(reg, m.retried); err != nil {
		return nil, err
	}
	if m.deadLettered, err = register(reg, m.deadLettered); err != nil {
		return nil, err
	}
	if m.duration, err = register(reg, m.duration); err != nil {
		return nil, err
	}
	if m.lag, err = register(reg, m.lag); err != nil {
		return nil, err
	}
	if m.outcomes, err = register(reg, m.outcomes); err != nil {
		return nil, err
	}
	return m, nil
}

// WatchForwarder adds f's abandoned publishes (Forwarder.AbandonedPublishes)
// to the txoutbox_forwarder_abandoned_publishes gauge and its outages
// (Forwarder.Outages) to the txoutbox_forwarder_outages gauge, read at each
// scrape. Watch each forwarder of the process once.
func (m *Metrics) WatchForwarder(f *txoutbox.Forwarder) {
	m.abandoned.mu.Lock()
	m.abandoned.forwarders = append(m.abandoned.forwarders, f)
	m.abandoned.mu.Unlock()
}

// abandonedCollector is the gauges read from the watched forwarders at each
// scrape: abandoned publishes and outages, summed over the forwarders. It is
// one collector per registry, shared by the Metrics made with it.
type abandonedCollector struct {
	desc       *prometheus.Desc
	outages    *prometheus.Desc
	mu         sync.Mutex
	forwarders []*txoutbox.Forwarder
}

func (c *abandonedCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.desc
	ch <- c.outages
}

func (c *abandonedCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	n := 0
	down := map[string]int{"": 0}
	for _, f := range c.forwarders {
		n += f.AbandonedPublishes()
		for _, o := range f.Outages() {
			down[o.Topic]++
		}
	}
	c.mu.Unlock()
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n))
	for topic, k := range down {
		ch <- prometheus.MustNewConstMetric(c.outages, prometheus.GaugeValue, float64(k), topic)
	}
}

// OnOutcome counts the forwarder's own outcome of every claimed record in
// txoutbox_forwarder_outcomes_total{topic, outcome} (outcome: published,
// nacked, released, dead_lettered). Unlike Middleware it is exact wherever the
// middleware sits, and it sees the records that never reach a middleware
// (undecodable, timed out, released). Use it as ForwarderConfig.OnOutcome.
func (m *Metrics) OnOutcome(o txoutbox.Outcome) {
	m.outcomes.WithLabelValues(o.Record.Topic, o.Kind.String()).Inc()
}

// register registers c, or returns the collector already registered in its
// place.
func register[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	err := reg.Register(c)
	if err == nil {
		return c, nil
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	return c, fmt.Errorf("register txoutbox forwarder metrics: %w", err)
}

// Middleware is the metrics middleware for txoutbox.ForwarderConfig.Middlewares.
// A panic below it counts as a failure and goes on up.
func (m *Metrics) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (_ []*message.Message, err error) {
		topic := topicOf(msg)
		start := time.Now()
		done := false
		defer func() {
			if !done {
				m.fail(msg, topic, time.Since(start))
			}
		}()
		out, err := h(msg)
		done = true
		elapsed := time.Since(start)
		if err != nil {
			m.fail(msg, topic, elapsed)
			return out, err
		}
		m.published.WithLabelValues(topic).Inc()
		m.duration.WithLabelValues(topic, OutcomePublished).Observe(elapsed.Seconds())
		if created, ok := CreatedAtFromMessage(msg); ok {
			m.lag.WithLabelValues(topic).Observe(max(time.Since(created), 0).Seconds())
		}
		return out, nil
	}
}

func (m *Metrics) fail(msg *message.Message, topic string, elapsed time.Duration) {
	m.failed.WithLabelValues(topic).Inc()
	m.duration.WithLabelValues(topic, OutcomeFailed).Observe(elapsed.Seconds())
	attempt := AttemptFromMessage(msg)
	if attempt >= m.maxAttempts {
		m.deadLettered.WithLabelValues(topic).Inc()
		return
	}
	m.retried.WithLabelValues(topic, strconv.Itoa(attempt)).Inc()
}
