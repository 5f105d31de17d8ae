package middleware_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/txoutbox/txoutbox/middleware"
	"github.com/txoutbox/txoutbox/storage"
)

// TestInboxStatsCollector reads the entries and the oldest entry's age of
// a real (SQLite) inbox table.
func TestInboxStatsCollector(t *testing.T) {
	t.Parallel()
	o := newOutbox(t)
	store := o.store.Inbox()
	c, err := middleware.NewInboxStatsCollector(store, middleware.StatsCollectorConfig{})
	if err != nil {
		t.Fatal(err)
	}
	gather := func() map[string]float64 {
		reg := prometheus.NewPedanticRegistry()
		reg.MustRegister(c)
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]float64{}
		for _, mf := range mfs {
			got[mf.GetName()] = mf.GetMetric()[0].GetGauge().GetValue()
		}
		return got
	}
	if got := gather(); got["txoutbox_inbox_entries"] != 0 || got["txoutbox_inbox_oldest_age_seconds"] != 0 || got["txoutbox_inbox_stats_last_scrape_error"] != 0 {
		t.Fatalf("empty inbox: %v", got)
	}
	ctx := context.Background()
	for i, at := range []time.Time{time.Now().Add(-time.Hour), time.Now()} {
		tx, seen, err := store.BeginInbox(ctx, storage.InboxParams{Consumer: "billing", UUID: string(rune('a' + i)), ReceivedAt: at})
		if err != nil || seen {
			t.Fatal(seen, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	got := gather()
	if age := got["txoutbox_inbox_oldest_age_seconds"]; got["txoutbox_inbox_entries"] != 2 || age < 3600 || age > 3600+600 {
		t.Fatalf("two entries, the oldest an hour old: %v", got)
	}
	if _, err := middleware.NewInboxStatsCollector(nil, middleware.StatsCollectorConfig{}); err == nil {
		t.Fatal("a nil store was accepted")
	}
}
