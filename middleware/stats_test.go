package middleware_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/txoutbox/txoutbox/middleware"
	"github.com/txoutbox/txoutbox/storage"
)

func newStatsCollector(t *testing.T, r storage.StatsReader, cfg middleware.StatsCollectorConfig) *middleware.StatsCollector {
	t.Helper()
	c, err := middleware.NewStatsCollector(r, cfg)
	if err != nil {
		t.Fatalf("NewStatsCollector: %v", err)
	}
	return c
}

func TestStatsCollectorReadsTheTable(t *testing.T) {
	t.Parallel()
	o := newOutbox(t)
	o.publish(t, "orders", "", "a", "b")
	o.publish(t, "doomed", "", "never")
	p := newTarget(func(msg *message.Message, _ int) error {
		if string(msg.Payload) == "never" {
			return errBroker
		}
		return nil
	})
	f := newForwarder(t, o, p, fastConfig(1))
	runUntil(t, f, "2 delivered, 1 dead", func() bool {
		_, delivered, dead := o.stats(t)
		return delivered == 2 && dead == 1
	})
	o.publish(t, "orders", "", "c", "d")
	if recs, err := o.store.Claim(context.Background(), storage.ClaimParams{BatchSize: 1, Lease: time.Minute, WorkerID: "w"}); err != nil || len(recs) != 1 {
		t.Fatalf("Claim = %d records, %v; want 1", len(recs), err)
	}

	c := newStatsCollector(t, o.store, middleware.StatsCollectorConfig{ConstLabels: prometheus.Labels{"table": "outbox"}})
	err := testutil.CollectAndCompare(c, strings.NewReader(`
# HELP txoutbox_outbox_dead Dead-lettered records, waiting for an operator to re-drive or purge them.
# TYPE txoutbox_outbox_dead gauge
txoutbox_outbox_dead{table="outbox"} 1
# HELP txoutbox_outbox_fenced Pending records held back by the commit fence: a transaction older than theirs is still running.
# TYPE txoutbox_outbox_fenced gauge
txoutbox_outbox_fenced{table="outbox"} 0
# HELP txoutbox_outbox_forwarders Distinct forwarders holding a live lease.
# TYPE txoutbox_outbox_forwarders gauge
txoutbox_outbox_forwarders{table="outbox"} 1
# HELP txoutbox_outbox_held_keys Keys held back right now: their first record is leased, waiting for a retry, or dead (with hold on dead-letter), with records behind it.
# TYPE txoutbox_outbox_held_keys gauge
txoutbox_outbox_held_keys{table="outbox"} 0
# HELP txoutbox_outbox_delivered Delivered records not yet purged.
# TYPE txoutbox_outbox_delivered gauge
txoutbox_outbox_delivered{table="outbox"} 2
# HELP txoutbox_outbox_leased Pending records currently leased to a forwarder.
# TYPE txoutbox_outbox_leased gauge
txoutbox_outbox_leased{table="outbox"} 1
# HELP txoutbox_outbox_pending Records not yet delivered nor dead, leased ones included.
# TYPE txoutbox_outbox_pending gauge
txoutbox_outbox_pending{table="outbox"} 2
# HELP txoutbox_outbox_stats_last_scrape_error 1 if the last read of the outbox stats failed, else 0.
# TYPE txoutbox_outbox_stats_last_scrape_error gauge
txoutbox_outbox_stats_last_scrape_error{table="outbox"} 0
# HELP txoutbox_outbox_stats_scrape_errors_total Reads of the outbox stats that failed or timed out.
# TYPE txoutbox_outbox_stats_scrape_errors_total counter
txoutbox_outbox_stats_scrape_errors_total{table="outbox"} 0
`), "txoutbox_outbox_dead", "txoutbox_outbox_delivered", "txoutbox_outbox_fenced", "txoutbox_outbox_forwarders", "txoutbox_outbox_held_keys", "txoutbox_outbox_leased", "txoutbox_outbox_pending",
		"txoutbox_outbox_stats_last_scrape_error", "txoutbox_outbox_stats_scrape_errors_total")
	if err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(c); n != 13 {
		t.Errorf("collected %d metrics, want 13", n)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	if age := value(t, reg, "txoutbox_outbox_oldest_pending_age_seconds", map[string]string{"table": "outbox"}); age <= 0 || age > 60 {
		t.Errorf("oldest pending age = %vs, want in (0, 60]", age)
	}
	if age := value(t, reg, "txoutbox_outbox_oldest_delivered_age_seconds", map[string]string{"table": "outbox"}); age < 0 || age > 60 {
		t.Errorf("oldest delivered age = %vs, want in [0, 60] (2 records delivered just now)", age)
	}
	if problems, err := testutil.CollectAndLint(c); err != nil || len(problems) > 0 {
		t.Errorf("lint: %v %v", problems, err)
	}
}

// statsFunc is a storage.StatsReader made of a function.
type statsFunc func(ctx context.Context) (storage.Stats, error)

func (f statsFunc) Stats(ctx context.Context) (storage.Stats, error) { return f(ctx) }

func TestStatsCollectorReportsFailedReads(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		reader statsFunc
	}{
		{"error", func(context.Context) (storage.Stats, error) { return storage.Stats{}, errors.New("database is down") }},
		{"timeout", func(ctx context.Context) (storage.Stats, error) { <-ctx.Done(); return storage.Stats{}, ctx.Err() }},
		{"panic", func(context.Context) (storage.Stats, error) { panic("driver bug") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newStatsCollector(t, tc.reader, middleware.StatsCollectorConfig{Timeout: 50 * time.Millisecond})
			reg := prometheus.NewRegistry()
			reg.MustRegister(c)

			for scrape := 1; scrape <= 2; scrape++ {
				start := time.Now()
				// The scrape itself succeeds: the failure is a metric.
				if n, err := testutil.GatherAndCount(reg); err != nil || n != 3 {
					t.Fatalf("scrape %d: %d metrics, %v; want 3 and no error", scrape, n, err)
				}
				if d := time.Since(start); d > 5*time.Second {
					t.Errorf("scrape %d took %s with a 50ms timeout", scrape, d)
				}
			}
			snap := snapshot(t, reg) // the third scrape
			if v := value(t, snap, "txoutbox_outbox_stats_last_scrape_error", nil); v != 1 {
				t.Errorf("last_scrape_error = %v, want 1", v)
			}
			if v := value(t, snap, "txoutbox_outbox_stats_scrape_errors_total", nil); v != 3 {
				t.Errorf("scrape_errors_total = %v after 3 failed scrapes", v)
			}
			if _, ok := sample(t, snap, "txoutbox_outbox_pending", nil); ok {
				t.Error("pending gauge exported although the read failed")
			}

			// Served over HTTP, the scrape is a 200.
			rec := httptest.NewRecorder()
			promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
			if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), "txoutbox_outbox_stats_last_scrape_error 1") {
				t.Errorf("GET /metrics = %d:\n%s", rec.Code, rec.Body)
			}
		})
	}
}

func TestNewStatsCollectorValidates(t *testing.T) {
	t.Parallel()
	if _, err := middleware.NewStatsCollector(nil, middleware.StatsCollectorConfig{}); err == nil {
		t.Error("NewStatsCollector(nil) succeeded")
	}
	ok := statsFunc(func(context.Context) (storage.Stats, error) { return storage.Stats{}, nil })
	if _, err := middleware.NewStatsCollector(ok, middleware.StatsCollectorConfig{Timeout: -time.Second}); err == nil || !strings.Contains(err.Error(), "Timeout") {
		t.Errorf("NewStatsCollector(Timeout -1s) = %v, want an error naming Timeout", err)
	}
}
