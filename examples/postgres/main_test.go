package main

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// TestPostgresExample runs the example against the local PostgreSQL and
// RabbitMQ, in a schema of its own: every order placed is printed as
// delivered by RabbitMQ, each with its order's key and payload.
func TestPostgresExample(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	databaseURL := cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	amqpURL := cmp.Or(os.Getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
	need(t, databaseURL, amqpURL)

	schema := fmt.Sprintf("example_postgres_%d_%d", os.Getpid(), time.Now().UnixNano())
	admin, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	u, err := url.Parse(databaseURL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()

	var out bytes.Buffer
	if err := run(ctx, u.String(), amqpURL, &out); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	text := out.String()
	placed := regexp.MustCompile(`placed order (\d+) \(total (\d+)\)`).FindAllStringSubmatch(text, -1)
	if len(placed) != 3 {
		t.Fatalf("%d orders placed, want 3:\n%s", len(placed), text)
	}
	for _, p := range placed {
		want := fmt.Sprintf(`RabbitMQ delivered orders.created key order-%s: {"order_id":%s,"total":%s}`, p[1], p[1], p[2])
		if !strings.Contains(text, want) {
			t.Errorf("missing %q:\n%s", want, text)
		}
	}
	if !strings.Contains(text, "all 3 orders' events delivered") {
		t.Errorf("missing the final line:\n%s", text)
	}
	var orders, delivered int
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM "+schema+".orders").Scan(&orders); err != nil {
		t.Fatal(err)
	}
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM "+schema+".outbox_delivered").Scan(&delivered); err != nil {
		t.Fatal(err)
	}
	if orders != 3 || delivered != 3 {
		t.Errorf("%d orders and %d delivered outbox records in %s, want 3 and 3", orders, delivered, schema)
	}
}

// need skips (or, with CI=true, fails) when PostgreSQL or RabbitMQ is not
// listening.
func need(t *testing.T, databaseURL, amqpURL string) {
	t.Helper()
	for _, s := range []struct{ raw, start string }{
		{databaseURL, "pg_ctlcluster --skip-systemctl-redirect 15 main start"},
		{amqpURL, "rabbitmq-server -detached"},
	} {
		u, err := url.Parse(s.raw)
		if err != nil {
			t.Fatal(err)
		}
		c, err := net.DialTimeout("tcp", u.Host, time.Second)
		if err == nil {
			c.Close()
			continue
		}
		msg := fmt.Sprintf("%s is not reachable (%v); start it with %#q", u.Host, err, s.start)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
}
