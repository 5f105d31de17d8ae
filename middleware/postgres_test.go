package middleware_test

import (
	"cmp"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/middleware"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// newPostgres returns a storage over a table in a fresh schema, dropped when
// the test ends. Without a database it skips, except under CI=true.
func newPostgres(t *testing.T) (*pgxpool.Pool, *postgres.Storage) {
	t.Helper()
	url := cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, url)
	if err == nil {
		err = pool.Ping(ctx)
		if err != nil {
			pool.Close()
		}
	}
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("PostgreSQL at %s: %v", url, err)
		}
		t.Skipf("PostgreSQL not reachable at %s (%v); start it with: pg_ctlcluster --skip-systemctl-redirect 15 main start", url, err)
	}
	t.Cleanup(pool.Close)
	schema := "txo_mw_" + strings.ToLower(watermill.NewShortUUID())
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	s, err := postgres.New(pool, postgres.Config{Table: schema + ".outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CreateSchema(ctx); err != nil {
		t.Fatal(err)
	}
	return pool, s
}

func TestMetricsAndStatsOverPostgres(t *testing.T) {
	t.Parallel()
	pool, s := newPostgres(t)
	ctx := context.Background()

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := txoutbox.NewTxPublisher(s, tx, txoutbox.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []struct{ topic, payload string }{{"orders", "a"}, {"orders", "b"}, {"doomed", "never"}} {
		if err := pub.Publish(m.topic, message.NewMessage(watermill.NewUUID(), []byte(m.payload))); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	reg := prometheus.NewRegistry()
	m := newMetrics(t, reg, 2)
	reg.MustRegister(newStatsCollector(t, s, middleware.StatsCollectorConfig{}))
	p := newTarget(func(msg *message.Message, _ int) error {
		if string(msg.Payload) == "never" {
			return errBroker
		}
		return nil
	})
	f, err := txoutbox.NewForwarder(s, p, fastConfig(2, m.Middleware), nil)
	if err != nil {
		t.Fatal(err)
	}
	runUntil(t, f, "2 delivered, 1 dead", func() bool {
		st, err := s.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st.Delivered == 2 && st.Dead == 1
	})

	err = testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP txoutbox_forwarder_dead_lettered_total Failed publishes on the last attempt: the record is dead-lettered.
# TYPE txoutbox_forwarder_dead_lettered_total counter
txoutbox_forwarder_dead_lettered_total{topic="doomed"} 1
# HELP txoutbox_forwarder_published_total Records the forwarder published to the target.
# TYPE txoutbox_forwarder_published_total counter
txoutbox_forwarder_published_total{topic="orders"} 2
# HELP txoutbox_forwarder_retried_total Failed publishes that will be retried, by the forwarder's attempt number.
# TYPE txoutbox_forwarder_retried_total counter
txoutbox_forwarder_retried_total{attempt="1",topic="doomed"} 1
# HELP txoutbox_outbox_dead Dead-lettered records, waiting for an operator to re-drive or purge them.
# TYPE txoutbox_outbox_dead gauge
txoutbox_outbox_dead 1
# HELP txoutbox_outbox_delivered Delivered records not yet purged.
# TYPE txoutbox_outbox_delivered gauge
txoutbox_outbox_delivered 2
# HELP txoutbox_outbox_pending Records not yet delivered nor dead, leased ones included.
# TYPE txoutbox_outbox_pending gauge
txoutbox_outbox_pending 0
`), publishedTotal, retriedTotal, deadLetteredTotal, "txoutbox_outbox_dead", "txoutbox_outbox_delivered", "txoutbox_outbox_pending")
	if err != nil {
		t.Error(err)
	}
	// Postgres stamps created_at with its own clock: the lag is still sane.
	if lag := find(t, reg, lagSeconds, topic("orders")).GetHistogram(); lag.GetSampleCount() != 2 || lag.GetSampleSum() > 60 {
		t.Errorf("lag: %d samples summing to %vs, want 2 and a few ms each", lag.GetSampleCount(), lag.GetSampleSum())
	}
}
