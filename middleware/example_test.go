package middleware_test

import (
	"context"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/middleware"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/memory"
)

func ExampleNewMetrics() {
	outbox := memory.New(memory.Config{})
	outbox.Add(
		storage.Record{UUID: watermill.NewUUID(), Topic: "orders", Key: "order-1", Payload: []byte(`{}`)},
		storage.Record{UUID: watermill.NewUUID(), Topic: "orders", Key: "order-2", Payload: []byte(`{}`)},
	)

	reg := prometheus.NewRegistry()
	metrics, err := middleware.NewMetrics(reg, middleware.MetricsConfig{MaxAttempts: 10})
	if err != nil {
		panic(err)
	}
	stats, err := middleware.NewStatsCollector(outbox, middleware.StatsCollectorConfig{})
	if err != nil {
		panic(err)
	}
	reg.MustRegister(stats)

	fwd, err := txoutbox.NewForwarder(outbox, newTarget(nil), txoutbox.ForwarderConfig{
		MaxAttempts: 10,
		Middlewares: []message.HandlerMiddleware{metrics.Middleware},
	}, nil)
	if err != nil {
		panic(err)
	}
	if _, err := fwd.RunOnce(context.Background()); err != nil {
		panic(err)
	}

	err = testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP txoutbox_forwarder_published_total Records the forwarder published to the target.
# TYPE txoutbox_forwarder_published_total counter
txoutbox_forwarder_published_total{topic="orders"} 2
# HELP txoutbox_outbox_pending Records not yet delivered nor dead, leased ones included.
# TYPE txoutbox_outbox_pending gauge
txoutbox_outbox_pending 0
`), "txoutbox_forwarder_published_total", "txoutbox_outbox_pending")
	fmt.Println("metrics as expected:", err == nil)
	// Output: metrics as expected: true
}
