package middleware

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/txoutbox/txoutbox/storage"
)

// StatsTimeoutDefault is the default of [StatsCollectorConfig.Timeout].
const StatsTimeoutDefault = 5 * time.Second

// StatsCollectorConfig configures a [StatsCollector]. The zero value is usable.
type StatsCollectorConfig struct {
	// Timeout bounds each read of the stats; keep it under the scrape timeout.
	// Defaults to 5s.
	Timeout time.Duration
	// ConstLabels are added to every metric, for example the table's name when
	// one process watches several outbox tables.
	ConstLabels prometheus.Labels
	// Logger, if set, logs failed reads. Defaults to none: the failure shows
	// in txoutbox_outbox_stats_last_scrape_error.
	Logger watermill.LoggerAdapter
}

// withDefaults checks config and fills in its defaults.
func (config StatsCollectorConfig) withDefaults() (StatsCollectorConfig, error) {
	if config.Timeout < 0 {
		return config, fmt.Errorf("invalid stats collector config: Timeout must be > 0, got %s", config.Timeout)
	}
	config.Timeout = cmp.Or(config.Timeout, StatsTimeoutDefault)
	if config.Logger == nil {
		config.Logger = watermill.NopLogger{}
	}
	return config, nil
}

// desc returns the describer of the gauges of subsystem (outbox, inbox),
// with the config's constant labels.
func (config StatsCollectorConfig) desc(subsystem string) func(name, help string) *prometheus.Desc {
	return func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(Namespace, subsystem, name), help, nil, config.ConstLabels)
	}
}

// StatsCollector is a prometheus.Collector that reads storage.Stats on each
// scrape and exports them as gauges:
//
//	txoutbox_outbox_pending
//	txoutbox_outbox_leased
//	txoutbox_outbox_delivered
//	txoutbox_outbox_dead
//	txoutbox_outbox_oldest_pending_age_seconds
//	txoutbox_outbox_skipped
//	txoutbox_outbox_held_keys
//	txoutbox_outbox_forwarders
//	txoutbox_outbox_fenced
//
// The last four are 0 from storages that do not report them (see
// storage.Stats).
//
// A read that fails or outruns Timeout leaves those gauges out of that scrape
// (stale, rather than a false zero) and sets
// txoutbox_outbox_stats_last_scrape_error to 1; the scrape itself succeeds.
// txoutbox_outbox_stats_scrape_errors_total counts the failed reads and
// txoutbox_outbox_stats_scrape_duration_seconds times the last one.
type StatsCollector struct {
	reader  storage.StatsReader
	timeout time.Duration
	logger  watermill.LoggerAdapter
	errors  atomic.Uint64

	pending, leased, delivered, dead, oldestAge *prometheus.Desc
	oldestDelivered                             *prometheus.Desc
	skipped, heldKeys, forwarders, fenced       *prometheus.Desc
	lastError, errorsTotal, duration            *prometheus.Desc
}

var _ prometheus.Collector = (*StatsCollector)(nil)

// NewStatsCollector returns a collector over reader (postgres.Storage,
// sqlite.Storage and memory.Storage implement it). Register it with
// reg.Register or reg.MustRegister.
func NewStatsCollector(reader storage.StatsReader, config StatsCollectorConfig) (*StatsCollector, error) {
	if reader == nil {
		return nil, errors.New("txoutbox/middleware: nil storage.StatsReader (try a postgres.Storage or sqlite.Storage)")
	}
	config, err := config.withDefaults()
	if err != nil {
		return nil, err
	}
	desc := config.desc("outbox")
	return &StatsCollector{
		reader:  reader,
		timeout: config.Timeout,
		logger:  config.Logger,

		pending:   desc("pending", "Records not yet delivered nor dead, leased ones included."),
		leased:    desc("leased", "Pending records currently leased to a forwarder."),
		delivered: desc("delivered", "Delivered records not yet purged."),
		dead:      desc("dead", "Dead-lettered records, waiting for an operator to re-drive or purge them."),
		oldestAge: desc("oldest_pending_age_seconds", "Age of the oldest pending record; 0 when none is pending."),
		oldestDelivered: desc("oldest_delivered_age_seconds",
			"How long ago the oldest delivered record not yet purged was delivered; 0 when none. With the forwarders' retention running it stays near the retention window."),
		skipped:    desc("skipped", "Dead records an operator gave up on (skipped), kept for audit."),
		heldKeys:   desc("held_keys", "Keys held back right now: their first record is leased, waiting for a retry, or dead (with hold on dead-letter), with records behind it."),
		forwarders: desc("forwarders", "Distinct forwarders holding a live lease."),
		fenced:     desc("fenced", "Pending records held back by the commit fence: a transaction older than theirs is still running."),

		lastError:   desc("stats_last_scrape_error", "1 if the last read of the outbox stats failed, else 0."),
		errorsTotal: desc("stats_scrape_errors_total", "Reads of the outbox stats that failed or timed out."),
		duration:    desc("stats_scrape_duration_seconds", "Time the last read of the outbox stats took."),
	}, nil
}

// Describe implements prometheus.Collector.
func (c *StatsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.pending, c.leased, c.delivered, c.dead, c.oldestAge, c.oldestDelivered, c.skipped, c.heldKeys, c.forwarders, c.fenced, c.lastError, c.errorsTotal, c.duration} {
		ch <- d
	}
}

// Collect implements prometheus.Collector: it reads the stats, bounded by the
// configured timeout.
func (c *StatsCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	start := time.Now()
	st, err := c.read(ctx)
	elapsed := time.Since(start)

	failed := 0.0
	if err != nil {
		failed = 1
		c.errors.Add(1)
		c.logger.Error("Reading outbox stats failed", err, watermill.LogFields{"timeout": c.timeout})
	} else {
		gauge := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v)
		}
		gauge(c.pending, float64(st.Pending))
		gauge(c.leased, float64(st.Leased))
		gauge(c.delivered, float64(st.Delivered))
		gauge(c.dead, float64(st.Dead))
		gauge(c.oldestAge, st.OldestPendingAge.Seconds())
		gauge(c.oldestDelivered, st.OldestDeliveredAge.Seconds())
		gauge(c.skipped, float64(st.Skipped))
		gauge(c.heldKeys, float64(st.HeldKeys))
		gauge(c.forwarders, float64(st.Forwarders))
		gauge(c.fenced, float64(st.Fenced))
	}
	ch <- prometheus.MustNewConstMetric(c.lastError, prometheus.GaugeValue, failed)
	ch <- prometheus.MustNewConstMetric(c.errorsTotal, prometheus.CounterValue, float64(c.errors.Load()))
	ch <- prometheus.MustNewConstMetric(c.duration, prometheus.GaugeValue, elapsed.Seconds())
}

// read calls the reader, gives up at ctx's deadline even when the reader
// ignores ctx, and turns a panic into an error.
func (c *StatsCollector) read(ctx context.Context) (storage.Stats, error) {
	type result struct {
		st  storage.Stats
		err error
	}
	done := make(chan result, 1)
	go func() {
		var r result
		defer func() {
			if p := recover(); p != nil {
				r.err = fmt.Errorf("read outbox stats panicked: %v", p)
			}
			done <- r
		}()
		r.st, r.err = c.reader.Stats(ctx)
	}()
	select {
	case r := <-done:
		if r.err != nil {
			return r.st, fmt.Errorf("read outbox stats: %w", r.err)
		}
		return r.st, nil
	case <-ctx.Done():
		return storage.Stats{}, fmt.Errorf("read outbox stats: gave up after %s: %w", c.timeout, ctx.Err())
	}
}
