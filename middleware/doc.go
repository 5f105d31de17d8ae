// Package middleware holds Watermill handler middleware made for the txoutbox
// forwarder: Prometheus metrics of every publish, a Prometheus collector over
// the outbox table's storage.Stats, and OpenTelemetry tracing that carries the
// producer's trace context through the outbox to the consumer.
//
// Each middleware is a plain message.HandlerMiddleware, so it goes into
// txoutbox.ForwarderConfig.Middlewares next to Watermill's own (Retry, Timeout,
// CircuitBreaker, ...). The first middleware of that list is the outermost.
//
// # Metrics
//
// NewMetrics registers counters and histograms under the txoutbox_forwarder_
// prefix, labelled by topic:
//
//	txoutbox_forwarder_published_total{topic}
//	txoutbox_forwarder_failed_total{topic}
//	txoutbox_forwarder_retried_total{topic,attempt}
//	txoutbox_forwarder_dead_lettered_total{topic}
//	txoutbox_forwarder_publish_duration_seconds{topic,outcome}
//	txoutbox_forwarder_lag_seconds{topic}
//
// The lag is the time from the record's insertion to the end of its
// successful publish. NewStatsCollector adds gauges read from the table on
// every scrape (txoutbox_outbox_pending, _leased, _delivered, _dead,
// _oldest_pending_age_seconds). None of the names clash with those of
// Watermill's components/metrics, so both can share one registry.
//
//	m, err := middleware.NewMetrics(reg, middleware.MetricsConfig{MaxAttempts: 10})
//	stats, err := middleware.NewStatsCollector(outbox, middleware.StatsCollectorConfig{})
//	reg.MustRegister(stats)
//	fwd, err := txoutbox.NewForwarder(outbox, target, txoutbox.ForwarderConfig{
//		MaxAttempts: 10,
//		Middlewares: []message.HandlerMiddleware{m.Middleware},
//	}, logger)
//
// # Tracing
//
// TracePublisherDecorator, set as txoutbox.PublisherConfig.Decorate, stores
// the trace context of msg.Context() in the message metadata (W3C traceparent
// by default) when the record is written. Tracing, in the forwarder's chain,
// starts a producer span "txoutbox publish <topic>" linked to that stored
// context, puts the span into the message context and writes the span's
// context into the metadata, so the consumer continues the relay's trace and
// reaches the producer's through the link.
//
// See docs/observability.md for the alerts worth setting on these metrics.
package middleware
