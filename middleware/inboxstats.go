package middleware

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/txoutbox/txoutbox/storage"
)

// InboxStatsCollector is a prometheus.Collector that reads the inbox
// table's stats (storage.InboxStore.InboxStats) on each scrape:
//
//	txoutbox_inbox_entries             entries of every consumer
//	txoutbox_inbox_oldest_age_seconds  age of the oldest entry; 0 without one
//
// A read that fails or outruns the timeout leaves both out of that scrape
// and sets txoutbox_inbox_stats_last_scrape_error to 1. An oldest age that
// keeps growing past the inbox's retention says nothing prunes it
// (inbox.Inbox.Run is not running).
type InboxStatsCollector struct {
	store   storage.InboxStore
	timeout time.Duration
	logger  watermill.LoggerAdapter

	entries, oldestAge, lastError *prometheus.Desc
}

var _ prometheus.Collector = (*InboxStatsCollector)(nil)

// NewInboxStatsCollector returns a collector over store (a SQL storage's
// Inbox). config is read as for [NewStatsCollector].
func NewInboxStatsCollector(store storage.InboxStore, config StatsCollectorConfig) (*InboxStatsCollector, error) {
	if store == nil {
		return nil, errors.New("txoutbox/middleware: nil storage.InboxStore (try postgres.Storage.Inbox or sqlite.Storage.Inbox)")
	}
	config, err := config.withDefaults()
	if err != nil {
		return nil, err
	}
	desc := config.desc("inbox")
	return &InboxStatsCollector{
		store: store, timeout: config.Timeout, logger: config.Logger,
		entries:   desc("entries", "Entries of the inbox table, every consumer."),
		oldestAge: desc("oldest_age_seconds", "Age of the oldest inbox entry; 0 when there is none."),
		lastError: desc("stats_last_scrape_error", "1 if the last read of the inbox stats failed, else 0."),
	}, nil
}

// Describe implements prometheus.Collector.
func (c *InboxStatsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.entries
	ch <- c.oldestAge
	ch <- c.lastError
}

// Collect implements prometheus.Collector.
func (c *InboxStatsCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	st, err := c.store.InboxStats(ctx)
	failed := 0.0
	if err != nil {
		failed = 1
		c.logger.Error("Reading inbox stats failed", err, watermill.LogFields{"timeout": c.timeout})
	} else {
		age := 0.0
		if !st.Oldest.IsZero() {
			age = max(time.Since(st.Oldest).Seconds(), 0)
		}
		ch <- prometheus.MustNewConstMetric(c.entries, prometheus.GaugeValue, float64(st.Entries))
		ch <- prometheus.MustNewConstMetric(c.oldestAge, prometheus.GaugeValue, age)
	}
	ch <- prometheus.MustNewConstMetric(c.lastError, prometheus.GaugeValue, failed)
}
