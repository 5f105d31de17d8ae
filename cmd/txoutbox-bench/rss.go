package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// childRSSArg, as the first argument, runs the bench binary as the forwarder
// process of the rss scenario.
const childRSSArg = "-child-rss"

// rss fills a table with -rss-rows pending rows in one INSERT ... SELECT, runs
// a txoutbox forwarder in a child process until it has forwarded -rss-drain
// of them, and reads the child's peak RSS (VmHWM) from /proc.
func (b *bench) rss(ctx context.Context) (err error) {
	name := b.name("rss")
	pool, err := newPool(ctx, b.o.url, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := postgres.New(pool, postgres.Config{Table: name})
	if err != nil {
		return err
	}
	if err := store.CreateSchema(ctx); err != nil {
		return err
	}
	defer func() {
		_, derr := pool.Exec(context.WithoutCancel(ctx), "DROP TABLE IF EXISTS "+pgx.Identifier{name}.Sanitize()+", "+store.LeaseTable()+", "+store.WorkerTable()+", "+store.DeliveredTable()+", "+store.MigrationTable()+", "+store.SkippedTable()+", "+store.InboxTable())
		err = errors.Join(err, derr)
	}()
	b.progress("rss: inserting %d pending rows", b.o.rssRows)
	fillStart := time.Now()
	keyExpr := "''"
	if b.o.keys > 0 {
		keyExpr = fmt.Sprintf("'k' || (g %% %d)", b.o.keys)
	}
	if _, err := pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (uuid, topic, key, payload, metadata)
SELECT '00000000-0000-4000-8000-' || lpad(g::text, 12, '0'), $2, %s, $3, '{"a":"b"}'
FROM generate_series(0, $1 - 1) g`, store.Table(), keyExpr), b.o.rssRows, destTopic, b.payload); err != nil {
		return fmt.Errorf("fill backlog: %w", err)
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE "+store.Table()); err != nil {
		return fmt.Errorf("analyze backlog: %w", err)
	}
	b.progress("rss: filled in %s; forwarding %d of them in a child process", time.Since(fillStart).Round(time.Millisecond), b.o.rssDrain)

	batch := b.o.batches[len(b.o.batches)-1]
	conc := b.concurrencyFor(0)
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find own executable: %w", err)
	}
	cmd := exec.CommandContext(ctx, exe, childRSSArg,
		"-url", b.o.url, "-table", name, "-batch", strconv.Itoa(batch),
		"-concurrency", strconv.Itoa(conc), "-drain", strconv.Itoa(min(b.o.rssDrain, b.o.rssRows)))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start child: %w", err)
	}
	pid := cmd.Process.Pid
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	var peak, report int64
	var result string
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	deadline := time.NewTimer(b.o.runTimeout)
	defer deadline.Stop()
wait:
	for {
		select {
		case <-deadline.C:
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			b.add(row{scenario: "peak RSS", settings: fmt.Sprintf("%d pending rows (child VmHWM)", b.o.rssRows),
				txo: fmt.Sprintf("timed out after -run-timeout %s (%.1f MiB so far)", b.o.runTimeout, float64(peak)/1024)})
			b.lost = true
			return nil
		case l, ok := <-lines:
			if !ok {
				break wait
			}
			if strings.HasPrefix(l, "DONE ") {
				result = strings.TrimPrefix(l, "DONE ")
				peak = max(peak, readVm(pid, "VmHWM"))
				break wait
			}
		case <-tick.C:
			peak = max(peak, readVm(pid, "VmHWM"))
			report = max(report, readVm(pid, "VmRSS"))
		}
	}
	_ = stdin.Close()
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("child: %w", err)
	}
	if result == "" {
		return errors.New("child ended without reporting")
	}
	fields := strings.Fields(result) // "<forwarded> <seconds>"
	forwarded, _ := strconv.Atoi(fields[0])
	secs, _ := strconv.ParseFloat(fields[1], 64)
	b.add(row{
		scenario: "peak RSS",
		settings: fmt.Sprintf("%d pending rows, forwarded %d at %.0f/s; batch=%d conc=%d (child VmHWM)", b.o.rssRows, forwarded, float64(forwarded)/secs, batch, conc),
		txo:      fmt.Sprintf("%.1f MiB", float64(peak)/1024), wm: "-", ratio: "-", txoDL: "-", wmDL: "-",
	})
	return nil
}

// readVm returns a /proc/<pid>/status field in KiB, 0 when unreadable.
func readVm(pid int, field string) int64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(l, field+":"); ok {
			f := strings.Fields(rest)
			if len(f) > 0 {
				v, _ := strconv.ParseInt(f[0], 10, 64)
				return v
			}
		}
	}
	return 0
}

// countSink counts deliveries and nothing else, so the child's memory is the
// forwarder's.
type countSink struct{ n atomic.Int64 }

func (s *countSink) Publish(_ string, msgs ...*message.Message) error {
	s.n.Add(int64(len(msgs)))
	return nil
}
func (s *countSink) Close() error { return nil }

// childRSS is the forwarder process: it runs a forwarder until it has
// forwarded -drain records, prints "DONE <forwarded> <seconds>" and waits for
// stdin to close, so the parent can read its peak RSS while it is still alive.
func childRSS(args []string) error {
	fs := flag.NewFlagSet("child", flag.ContinueOnError)
	url := fs.String("url", "", "database URL")
	table := fs.String("table", "", "outbox table")
	batch := fs.Int("batch", 1000, "batch size")
	conc := fs.Int("concurrency", 16, "concurrency")
	drain := fs.Int64("drain", 0, "records to forward")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pool, err := newPool(ctx, *url, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := postgres.New(pool, postgres.Config{Table: *table})
	if err != nil {
		return err
	}
	s := &countSink{}
	f, err := txoutbox.NewForwarder(store, s, txoutbox.ForwarderConfig{BatchSize: *batch, Concurrency: *conc, WorkerID: "rss"}, nil)
	if err != nil {
		return err
	}
	// Run, as a relay in production runs: what it keeps between claims
	// counts (RunOnce would free everything at each return).
	runCtx, stop := context.WithCancel(ctx)
	go func() {
		defer stop()
		for s.n.Load() < *drain {
			time.Sleep(10 * time.Millisecond)
		}
	}()
	start := time.Now()
	if err := f.Run(runCtx); err != nil {
		return err
	}
	fmt.Printf("DONE %d %f\n", s.n.Load(), time.Since(start).Seconds())
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n') // until the parent closes stdin
	return nil
}
