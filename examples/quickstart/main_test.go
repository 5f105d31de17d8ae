package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// TestQuickstart runs the example's code path: every committed event is
// printed, the rolled-back one never is.
func TestQuickstart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, &out); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	text := out.String()
	if got := strings.Count(text, "delivered orders."); got != 6 {
		t.Errorf("%d deliveries printed, want 6 (3 committed orders x 2 events):\n%s", got, text)
	}
	if strings.Contains(text, "mallory") {
		t.Errorf("the rolled-back order's event was delivered:\n%s", text)
	}
	if !strings.Contains(text, "all 6 committed events delivered") {
		t.Errorf("missing the final line:\n%s", text)
	}
}
