// Command metrics shows the forwarder's Prometheus metrics: it runs a
// forwarder over a SQLite outbox with the metrics middleware and a collector
// over the outbox table, serves them on /metrics, and writes a few events
// through the transactional publisher. The target fails the first attempt of
// every third record, so the retry counters move too.
//
//	go run ./examples/metrics                # serve until Ctrl-C, one event a second
//	go run ./examples/metrics -once          # print the txoutbox metrics once delivered, then exit
//	curl -s 127.0.0.1:2112/metrics | grep txoutbox_
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/middleware"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// options are the command line flags.
type options struct {
	addr   string // where /metrics is served
	dbPath string // SQLite file; empty means a temporary one
	events int    // events written at start
	once   bool   // print the metrics once every event is delivered, then exit
}

func main() {
	var opts options
	flag.StringVar(&opts.addr, "addr", "127.0.0.1:2112", "address to serve /metrics on")
	flag.StringVar(&opts.dbPath, "db", "", "SQLite database file (default: a temporary file)")
	flag.IntVar(&opts.events, "events", 9, "events to write at start")
	flag.BoolVar(&opts.once, "once", false, "exit after printing the metrics once every event is delivered")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Stdout, opts); err != nil {
		fmt.Fprintln(os.Stderr, "metrics:", err)
		os.Exit(1)
	}
}

const maxAttempts = 5

// run is the whole example; the test calls it too.
func run(ctx context.Context, out io.Writer, opts options) error {
	if opts.dbPath == "" {
		dir, err := os.MkdirTemp("", "txoutbox-metrics-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		opts.dbPath = filepath.Join(dir, "app.db")
	}
	db, err := sqlite.Open(opts.dbPath)
	if err != nil {
		return err
	}
	defer db.Close()
	outbox, err := sqlite.New(db, sqlite.Config{})
	if err != nil {
		return err
	}
	if err := outbox.CreateSchema(ctx); err != nil {
		return err
	}

	// The metrics: forwarder counters and histograms, and gauges read from
	// the outbox table on each scrape.
	reg := prometheus.NewRegistry()
	metrics, err := middleware.NewMetrics(reg, middleware.MetricsConfig{MaxAttempts: maxAttempts})
	if err != nil {
		return err
	}
	stats, err := middleware.NewStatsCollector(outbox, middleware.StatsCollectorConfig{Timeout: 2 * time.Second})
	if err != nil {
		return err
	}
	reg.MustRegister(stats)

	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", opts.addr)
	if err != nil {
		return fmt.Errorf("listen for /metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	server := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	serveErr := make(chan error, 1)
	go func() { serveErr <- server.Serve(ln) }()
	defer func() {
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = server.Shutdown(shutdownCtx)
	}()
	metricsURL := "http://" + ln.Addr().String() + "/metrics"
	fmt.Fprintln(out, "serving", metricsURL)

	// The broker: Watermill's Go channel pub/sub, with a consumer.
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, nil)
	defer pubsub.Close()
	var consumed atomic.Int64
	for _, topic := range []string{"orders", "payments"} {
		msgs, err := pubsub.Subscribe(ctx, topic)
		if err != nil {
			return err
		}
		go func() {
			for msg := range msgs {
				consumed.Add(1)
				msg.Ack()
			}
		}()
	}

	forwarder, err := txoutbox.NewForwarder(outbox, flaky{pubsub}, txoutbox.ForwarderConfig{
		MaxAttempts: maxAttempts,
		PollMax:     500 * time.Millisecond,
		Backoff:     txoutbox.Backoff{Base: 100 * time.Millisecond},
		Middlewares: []message.HandlerMiddleware{metrics.Middleware},
	}, nil)
	if err != nil {
		return err
	}
	fwdCtx, stopForwarder := context.WithCancel(ctx)
	fwdDone := make(chan error, 1)
	go func() { fwdDone <- forwarder.Run(fwdCtx) }()
	defer func() { stopForwarder(); <-fwdDone }()

	publisher, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
	if err != nil {
		return err
	}
	write := func(n int) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		// ... business writes through tx go here ...
		topic := []string{"orders", "payments"}[n%2]
		msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"n":%d}`, n)))
		msg.Metadata.Set(txoutbox.MetadataKey, "customer-"+strconv.Itoa(n%3))
		msg.SetContext(txoutbox.ContextWithTx(ctx, tx))
		if err := publisher.Publish(topic, msg); err != nil {
			return err
		}
		return tx.Commit()
	}
	for n := range opts.events {
		if err := write(n); err != nil {
			return fmt.Errorf("write event %d: %w", n, err)
		}
	}
	forwarder.Wake()

	if opts.once {
		if err := waitDelivered(ctx, outbox, int64(opts.events), 30*time.Second); err != nil {
			return err
		}
		fmt.Fprintf(out, "%d events delivered, %d consumed\n", opts.events, consumed.Load())
		return printMetrics(ctx, out, metricsURL)
	}

	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for n := opts.events; ; n++ {
		select {
		case <-ctx.Done():
			fmt.Fprintln(out, "stopping")
			return nil
		case err := <-serveErr:
			return fmt.Errorf("serve /metrics: %w", err)
		case <-tick.C:
			if err := write(n); err != nil {
				return fmt.Errorf("write event %d: %w", n, err)
			}
		}
	}
}

// flaky fails the first attempt of every third record, so that retries show.
type flaky struct{ message.Publisher }

func (f flaky) Publish(topic string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		id, _ := middleware.OutboxIDFromMessage(msg)
		if id%3 == 0 && middleware.AttemptFromMessage(msg) == 1 {
			return errors.New("broker hiccup (simulated)")
		}
	}
	return f.Publisher.Publish(topic, msgs...)
}

// waitDelivered polls the outbox stats until want records are delivered.
func waitDelivered(ctx context.Context, outbox *sqlite.Storage, want int64, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		st, err := outbox.Stats(ctx)
		if err != nil {
			return err
		}
		if st.Delivered >= want {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("only %d of %d events delivered after %s", st.Delivered, want, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// printMetrics scrapes url and prints the txoutbox series, histograms
// summarised by their _count and _sum.
func printMetrics(ctx context.Context, out io.Writer, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("scrape %s: %s", url, resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "txoutbox_") && !strings.Contains(line, "_bucket{") {
			fmt.Fprintln(out, line)
		}
	}
	return sc.Err()
}
