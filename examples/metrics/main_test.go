package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// TestMetricsOnce runs the example as CI does with -once, on a free port.
func TestMetricsOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out, options{addr: "127.0.0.1:0", events: 9, once: true}); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	text := out.String()
	for _, want := range []string{
		`txoutbox_forwarder_published_total{topic="orders"} 5`,
		`txoutbox_forwarder_published_total{topic="payments"} 4`,
		// Records 3, 6 and 9 (events 2, 5, 8) fail their first attempt.
		`txoutbox_forwarder_retried_total{attempt="1",topic="orders"} 2`,
		`txoutbox_forwarder_retried_total{attempt="1",topic="payments"} 1`,
		`txoutbox_outbox_pending 0`,
		`txoutbox_outbox_delivered 9`,
		`txoutbox_forwarder_lag_seconds_count{topic="orders"} 5`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("output lacks %q:\n%s", want, text)
		}
	}
}
