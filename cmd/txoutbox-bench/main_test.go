package main

import (
	"bytes"
	"cmp"
	"context"
	"database/sql"
	"encoding/xml"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
)

// TestMain lets the test binary act as the rss scenario's child process, as
// the bench binary does.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == childRSSArg {
		if err := childRSS(os.Args[2:]); err != nil {
			os.Stderr.WriteString("child: " + err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func databaseURL(t *testing.T) string {
	t.Helper()
	url := cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("PostgreSQL not reachable at %s: %v", url, err)
		}
		t.Skipf("PostgreSQL not reachable (%v); start it with: pg_ctlcluster --skip-systemctl-redirect 15 main start", err)
	}
	_ = conn.Close(ctx)
	return url
}

// TestQuickRunsEveryScenario runs the -quick smoke workload end to end: both
// relays, every scenario, no loss, and the tables dropped afterwards.
func TestQuickRunsEveryScenario(t *testing.T) {
	url := databaseURL(t)
	o, err := parseFlags([]string{"-quick", "-url", url, "-latency", "0,1ms", "-forwarders", "1,2", "-strict", "on"}, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	code, err := run(t.Context(), o, &out)
	if err != nil || code != 0 {
		t.Fatalf("run = %d, %v; output:\n%s", code, err, out.String())
	}
	text := out.String()
	for _, want := range []string{"drain", "insert", "steady delivered", "steady producers", "latency p99", "100/s commit p99", "500/s CPU per commit", "peak RSS", "MiB"} {
		if !strings.Contains(text, want) {
			t.Errorf("output lacks %q:\n%s", want, text)
		}
	}
	// The drains without broker latency have a floor figure and the
	// fraction of it txoutbox reached, streamed as they finished.
	if !regexp.MustCompile(`(?m)^= drain latency=0s batch=100 fwd=1 strict=on .*floor [0-9]+/s; txoutbox/floor [0-9.]+`).MatchString(text) {
		t.Errorf("no streamed drain row with a floor figure:\n%s", text)
	}
	if strings.Contains(text, "FAIL") {
		t.Errorf("output reports a failure:\n%s", text)
	}
	// A smoke run measures no warm-up, so steady has lags to report (with
	// the full run's warm-up its few messages were all sent before it).
	if !regexp.MustCompile(`steady delivered .* txo [0-9.]+ms, wm [0-9.]+ms`).MatchString(text) {
		t.Errorf("the steady rows report no p99 lag:\n%s", text)
	}
	checkNoBenchTables(t, url)
}

func messageWithUUID(uuid string) *message.Message { return message.NewMessage(uuid, nil) }

func TestSinkCountsLossesDuplicatesAndReorders(t *testing.T) {
	s := newSink(4, 2, nil, 0, false)
	pub := func(i int) {
		if err := s.Publish("t", messageWithUUID(makeUUID(i))); err != nil {
			t.Fatal(err)
		}
	}
	pub(0)
	pub(2)
	pub(2) // duplicate
	pub(1)
	if got := s.losses(); got != 1 {
		t.Errorf("losses = %d, want 1 (message 3 never came)", got)
	}
	if got := s.duplicates(); got != 1 {
		t.Errorf("duplicates = %d, want 1", got)
	}
	pub(3)
	select {
	case <-s.done:
	default:
		t.Error("sink not done after every message came")
	}
	// key 0 saw 0, 2, 2: the repeated 2 is not a reorder; key 1 saw 1, 3.
	if got := s.reorders.Load(); got != 0 {
		t.Errorf("reorders = %d, want 0", got)
	}
	pub(1) // key 1 after 3: a reorder
	if got := s.reorders.Load(); got != 1 {
		t.Errorf("reorders = %d, want 1", got)
	}
	if err := s.Publish("t", messageWithUUID("not-ours")); err != nil || s.bad.Load() != 1 {
		t.Errorf("foreign UUID: err %v, bad %d", err, s.bad.Load())
	}
}

// TestSinkLeavesTheWarmUpOutOfTheLatencies: a message sent before
// recordFrom is delivered and counted, but its latency is not recorded.
func TestSinkLeavesTheWarmUpOutOfTheLatencies(t *testing.T) {
	s := newSink(2, 0, nil, 0, true)
	from := time.Now()
	s.recordFrom.Store(from.UnixNano())
	sentAt := func(i int, at time.Time) *message.Message {
		m := messageWithUUID(makeUUID(i))
		m.Metadata.Set(metaSent, strconv.FormatInt(at.UnixNano(), 10))
		return m
	}
	if err := s.Publish("t", sentAt(0, from.Add(-time.Second)), sentAt(1, from)); err != nil {
		t.Fatal(err)
	}
	if got := s.unique.Load(); got != 2 {
		t.Errorf("delivered %d, want 2", got)
	}
	if len(s.latencies) != 1 || s.latencies[0] > time.Second/2 {
		t.Errorf("latencies %v, want one (the message sent at recordFrom, not the warm-up's)", s.latencies)
	}
}

// TestSinkSplitsOffTheRelaysPart: the relay's part of a latency runs from
// the return of the producer's Commit to the delivery, looked up by message
// index whatever the order of delivery; a delivery before that return
// counts as 0, and a message whose commit was not recorded is left out.
func TestSinkSplitsOffTheRelaysPart(t *testing.T) {
	s := newSink(3, 0, nil, 0, true)
	now := time.Now()
	sentAt := func(i int, at time.Time) *message.Message {
		m := messageWithUUID(makeUUID(i))
		m.Metadata.Set(metaSent, strconv.FormatInt(at.UnixNano(), 10))
		return m
	}
	s.commit([]int{0}, now.Add(-40*time.Millisecond))
	if err := s.Publish("t", sentAt(2, now), sentAt(1, now), sentAt(0, now.Add(-100*time.Millisecond))); err != nil {
		t.Fatal(err)
	}
	s.commit([]int{1}, time.Now().Add(time.Second)) // returned after the delivery
	relay := s.relayLatencies()
	if len(relay) != 2 {
		t.Fatalf("relay latencies %v, want two (message 2's commit is not recorded)", relay)
	}
	if relay[0] != 0 {
		t.Errorf("message 1, delivered before its Commit returned: relay %s, want 0", relay[0])
	}
	if relay[1] < 40*time.Millisecond || relay[1] >= s.latencies[2] {
		t.Errorf("message 0: relay %s, want at least 40ms and less than its latency %s", relay[1], s.latencies[2])
	}
	var oc outcome
	(&bench{}).finish(&oc, s)
	if oc.rp99 != relay[1] || oc.rp50 != relay[1] {
		t.Errorf("finish: relay p50 %s p99 %s, want both %s (the upper of two)", oc.rp50, oc.rp99, relay[1])
	}
}

// commitRelay is a relay whose PublishTx does nothing.
type commitRelay struct{ relay }

func (commitRelay) PublishTx(context.Context, []*message.Message) error { return nil }

// TestPublishTxRecordsTheCommitInTheRunsSink: a stamped transaction records
// its commit in the sink of the run (b.cur, which together sets); an
// unstamped one (the drains' backlog) records nothing.
func TestPublishTxRecordsTheCommitInTheRunsSink(t *testing.T) {
	b := &bench{cur: newSink(4, 0, nil, 0, true)}
	before := time.Now().UnixNano()
	if err := b.publishTx(t.Context(), commitRelay{}, []int{1, 3}, true); err != nil {
		t.Fatal(err)
	}
	if err := b.publishTx(t.Context(), commitRelay{}, []int{0}, false); err != nil {
		t.Fatal(err)
	}
	for i, want := range []bool{false, true, false, true} {
		if got := b.cur.committed[i].Load() >= before; got != want {
			t.Errorf("message %d: commit recorded %t, want %t", i, got, want)
		}
	}
}

// TestSpeedSaysWhichWay: a latency ratio reads "faster" only when
// txoutbox's latency is the lower one.
func TestSpeedSaysWhichWay(t *testing.T) {
	ms := time.Millisecond
	for _, c := range []struct {
		txo, wm time.Duration
		want    string
	}{
		{1 * ms, 2 * ms, "2.00x faster"},
		{2 * ms, 2 * ms, "1.00x faster"},
		{4 * ms, 2 * ms, "2.00x slower"},
		{0, 2 * ms, "-"},
		{2 * ms, 0, "-"},
	} {
		if got := speed(c.txo, c.wm); got != c.want {
			t.Errorf("speed(%s, %s) = %q, want %q", c.txo, c.wm, got, c.want)
		}
	}
}

// TestMedianRunsTakesEachFigureOnItsOwn: with -repeat, the latency and
// steady scenarios report the median rate, p50 and p99 of the runs, which
// may come from different runs, and add up their duplicates and losses.
func TestMedianRunsTakesEachFigureOnItsOwn(t *testing.T) {
	ms := time.Millisecond
	got := medianRuns([]outcome{
		{p50: 2 * ms, p99: 40 * ms, rp50: 7 * ms, rp99: 1 * ms, rate: 900, n: 10, dup: 1},
		{p50: 3 * ms, p99: 5 * ms, rp50: 1 * ms, rp99: 8 * ms, rate: 100, n: 10},
		{p50: 9 * ms, p99: 6 * ms, rp50: 2 * ms, rp99: 3 * ms, rate: 500, n: 10, lost: 2},
	})
	if got.p50 != 3*ms || got.p99 != 6*ms || got.rate != 500 || got.n != 30 || got.dup != 1 || got.lost != 2 {
		t.Errorf("medianRuns = p50 %s p99 %s rate %.0f n %d dup %d lost %d; want 3ms, 6ms, 500, 30, 1, 2", got.p50, got.p99, got.rate, got.n, got.dup, got.lost)
	}
	if got.rp50 != 2*ms || got.rp99 != 3*ms {
		t.Errorf("medianRuns relay p50 %s p99 %s, want 2ms and 3ms", got.rp50, got.rp99)
	}
	if got := medianRuns(nil); got.p99 != 0 {
		t.Errorf("medianRuns(nil).p99 = %s, want 0 (no runs: the table shows -)", got.p99)
	}
}

func TestPlanKeepsEachKeyOnOneProducerInOrder(t *testing.T) {
	b := &bench{o: options{producers: 3, perTx: 4, keys: 5}}
	owner := map[int]int{}
	seen := 0
	for p, txs := range b.plan(100) {
		last := map[int]int{}
		for _, tx := range txs {
			if len(tx) > 4 {
				t.Fatalf("transaction of %d messages, per-tx is 4", len(tx))
			}
			for _, i := range tx {
				seen++
				k := i % 5
				if o, ok := owner[k]; ok && o != p {
					t.Fatalf("key %d on producers %d and %d", k, o, p)
				}
				owner[k] = p
				if l, ok := last[k]; ok && i <= l {
					t.Fatalf("key %d: message %d after %d", k, i, l)
				}
				last[k] = i
			}
		}
	}
	if seen != 100 {
		t.Errorf("planned %d messages, want 100", seen)
	}
}

func TestParseFlagsRejectsBadInput(t *testing.T) {
	for _, args := range [][]string{
		{"-latency", "fast"}, {"-batch", "0"}, {"-strict", "maybe"}, {"-scenarios", "nope"}, {"extra"},
		{"-scenarios", "outage", "-keys", "0"}, {"-scenarios", "outage", "-outage-rows", "0"}, {"-db", "mysql", "-scenarios", "outage"},
	} {
		if _, err := parseFlags(args, &bytes.Buffer{}); err == nil {
			t.Errorf("parseFlags(%q) succeeded", args)
		}
	}
	o, err := parseFlags([]string{"-quick", "-messages", "77", "-skip-rss"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.messages != 77 || o.keys != 100 || o.scenarios["rss"] {
		t.Errorf("-quick with -messages 77 -skip-rss: messages %d keys %d rss %v", o.messages, o.keys, o.scenarios["rss"])
	}
}

// TestOutageDrainsWithoutLoss runs the outage scenario on a tiny backlog,
// with fresh forwarders after the outage and with the forwarders kept running:
// every key's head refused and nacked once, nothing dead-lettered, the
// backlog then drained with no loss and no duplicate, and the tables dropped.
// The subtests run one after another: table names are unique per bench, not
// per process.
func TestOutageDrainsWithoutLoss(t *testing.T) {
	url := databaseURL(t)
	for _, tc := range []struct {
		name  string
		extra []string
		timed string
	}{
		{"restart", nil, "timed from the last retry due"},
		{"keep-running", []string{"-outage-keep-running"}, "timed from the first retry due"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"-quick", "-url", url, "-scenarios", "outage", "-outage-rows", "600", "-keys", "20",
				"-batch", "50", "-latency", "0", "-forwarders", "1", "-outage-backoff", "5s"}, tc.extra...)
			o, err := parseFlags(args, os.Stderr)
			if err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			code, err := run(t.Context(), o, &out)
			if err != nil || code != 0 {
				t.Fatalf("run = %d, %v; output:\n%s", code, err, out.String())
			}
			text := out.String()
			var line string
			for l := range strings.Lines(text) {
				if strings.HasPrefix(l, "outage ") {
					line = l
				}
			}
			if line == "" {
				t.Fatalf("no outage row:\n%s", text)
			}
			for _, want := range []string{tc.timed, "rows=600 keys=20", "20 heads refused and nacked", "0 dead-lettered"} {
				if !strings.Contains(line, want) {
					t.Errorf("outage row lacks %q:\n%s", want, line)
				}
			}
			if got := strings.Count(line, " 0/0 "); got != 2 {
				t.Errorf("outage row: want dup/lost 0/0 for both drains:\n%s", line)
			}
			if strings.Contains(text, "FAIL") {
				t.Errorf("output reports a failure:\n%s", text)
			}
			checkNoBenchTables(t, url)
		})
	}
}

// checkNoBenchTables fails the test if this process left bench tables behind.
func checkNoBenchTables(t *testing.T, url string) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.WithoutCancel(t.Context()))
	var left int
	if err := conn.QueryRow(t.Context(), `SELECT count(*) FROM pg_tables WHERE tablename LIKE $1`,
		"bench\\_%\\_"+strconv.Itoa(os.Getpid())+"\\_%").Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("%d bench tables left behind", left)
	}
}

func mysqlDSN(t *testing.T) string {
	t.Helper()
	dsn := cmp.Or(os.Getenv("TEST_MYSQL_DSN"), "root@tcp(127.0.0.1:3306)/test")
	db, err := openMySQL(dsn, 1)
	if err == nil {
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		err = db.PingContext(ctx)
		cancel()
		_ = db.Close()
	}
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("MySQL not reachable at %s: %v", dsn, err)
		}
		t.Skipf("MySQL not reachable (%v)", err)
	}
	return dsn
}

// TestQuickMySQL runs the -quick workload on MySQL/MariaDB: txoutbox,
// Watermill and the floor drain without loss, and the tables are dropped.
func TestQuickMySQL(t *testing.T) {
	dsn := mysqlDSN(t)
	o, err := parseFlags([]string{"-db", "mysql", "-quick", "-url", dsn, "-latency", "0", "-forwarders", "1,2", "-strict", "on"}, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	code, err := run(t.Context(), o, &out)
	if err != nil || code != 0 {
		t.Fatalf("run = %d, %v; output:\n%s", code, err, out.String())
	}
	text := out.String()
	if !regexp.MustCompile(`(?m)^= drain latency=0s batch=100 fwd=2 strict=on .*floor [0-9]+/s; txoutbox/floor [0-9.]+; dup/lost txo 0/0`).MatchString(text) {
		t.Errorf("no MySQL drain row with a floor figure:\n%s", text)
	}
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var left int
	if err := db.QueryRowContext(t.Context(), "SELECT count(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name LIKE ?",
		"bench\\_%\\_"+strconv.Itoa(os.Getpid())+"\\_%").Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("%d bench tables left behind", left)
	}
}

// TestFasterSaysWhichWay: a throughput comparison reads "faster" only when
// txoutbox's rate is the higher one, and the factor is always >= 1.
func TestFasterSaysWhichWay(t *testing.T) {
	for _, c := range []struct {
		txo, wm float64
		want    string
	}{
		{2000, 1000, "2.00x faster"},
		{1000, 1000, "1.00x faster"},
		{880, 1000, "1.14x slower"},
		{0, 1000, "-"},
		{1000, 0, "-"},
	} {
		if got := faster(c.txo, c.wm); got != c.want {
			t.Errorf("faster(%.0f, %.0f) = %q, want %q", c.txo, c.wm, got, c.want)
		}
	}
}

// TestAwaitReportsAStall: a run in which nothing is delivered for -stall is
// given up as stalled, without waiting for -run-timeout; a complete one
// returns "".
func TestAwaitReportsAStall(t *testing.T) {
	b := &bench{o: options{stall: 300 * time.Millisecond, runTimeout: time.Hour}}
	s := newSink(3, 0, nil, 0, false)
	if err := s.Publish("t", messageWithUUID(makeUUID(0))); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	why := b.await(t.Context(), s)
	if !strings.HasPrefix(why, "stalled") {
		t.Fatalf("await = %q, want a stall", why)
	}
	if d := time.Since(start); d > time.Minute {
		t.Errorf("the stall took %s to be seen", d)
	}
	if got := s.missing(5); strings.Join(got, " ") != makeUUID(1)+" "+makeUUID(2) {
		t.Errorf("missing = %v, want messages 1 and 2", got)
	}
	oc := outcome{n: 3, stalled: why, delivered: 1, elapsed: 2 * time.Second}
	if got := oc.show("9/s"); !strings.Contains(got, "1 of 3 delivered in 2s") {
		t.Errorf("show = %q, want what the run delivered", got)
	}
	for i := 1; i < 3; i++ {
		if err := s.Publish("t", messageWithUUID(makeUUID(i))); err != nil {
			t.Fatal(err)
		}
	}
	if why := b.await(t.Context(), s); why != "" {
		t.Errorf("await on a complete run = %q, want \"\"", why)
	}
}

// TestMedianShowsAStalledRun: a median over runs of which one stalled is
// the median of the complete runs and says that one stalled; a median of
// runs that all stalled shows the stall.
func TestMedianShowsAStalledRun(t *testing.T) {
	runs := []outcome{{rate: 100, n: 10}, {rate: 0, n: 10, lost: 6, stalled: "stalled: x", delivered: 4}, {rate: 300, n: 10}}
	for name, m := range map[string]outcome{"medianRun": medianRun(runs), "medianRuns": medianRuns(runs)} {
		if got := m.show(rate(m.rate)); got != "300/s (median of the 2 complete runs; run 2 of 3 stalled: x, 4 of 10 delivered in 0s)" {
			t.Errorf("%s shows %q", name, got)
		}
		if m.lost != 6 {
			t.Errorf("%s: lost %d, want the stalled run's 6", name, m.lost)
		}
	}
	all := []outcome{{n: 10, stalled: "stalled: y", delivered: 1, elapsed: time.Second}, {n: 10, stalled: "stalled: z", delivered: 2}}
	for name, m := range map[string]outcome{"medianRun": medianRun(all), "medianRuns": medianRuns(all)} {
		if got := m.show(rate(m.rate)); got != "stalled: y (every run; the first: 1 of 10 delivered in 1s)" {
			t.Errorf("%s of stalled runs shows %q", name, got)
		}
	}
}

// TestMarkdownAndReportBlock: -markdown escapes the cells, and -report
// replaces only its own block of the file.
func TestMarkdownAndReportBlock(t *testing.T) {
	b := &bench{}
	b.rows = []row{{scenario: "drain", settings: "a|b", txo: "1/s", wm: "2/s", ratio: faster(1, 2)},
		{table: tableNotify, scenario: "100/s commit p99", settings: "x", txo: "1.00ms", wm: "0.50ms", ratio: costMS(time.Millisecond, time.Millisecond/2)}}
	var md bytes.Buffer
	b.printMarkdown(&md)
	for _, want := range []string{"| drain | a\\|b | 1/s | 2/s | 2.00x slower |", "| scenario | settings | with NOTIFY trigger |", "| +0.50ms (2.00x) |"} {
		if !strings.Contains(md.String(), want) {
			t.Errorf("markdown lacks %q:\n%s", want, md.String())
		}
	}
	file := filepath.Join(t.TempDir(), "r.md")
	orig := "# R\n<!-- txoutbox-bench:postgres -->\nold\n<!-- /txoutbox-bench:postgres -->\nkeep\n<!-- txoutbox-bench:mysql -->\nmine\n<!-- /txoutbox-bench:mysql -->\n"
	if err := os.WriteFile(file, []byte(orig), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := replaceBlock(file, "postgres", "new\n"); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(file)
	want := strings.Replace(orig, "\nold\n", "\nnew\n", 1)
	if string(got) != want {
		t.Errorf("after replaceBlock:\n%s\nwant:\n%s", got, want)
	}
	if err := replaceBlock(file, "sqlite", "x"); err == nil {
		t.Error("replaceBlock of a missing block succeeded")
	}
}

// TestPlotsAreValidSVGWithTheirSeries writes the plots of a made-up run and
// checks each file is well-formed SVG that names its series.
func TestPlotsAreValidSVGWithTheirSeries(t *testing.T) {
	b := &bench{o: options{rate: 1000}, latSamples: map[string][]time.Duration{}}
	b.rows = []row{
		{scenario: "drain", settings: "latency=0s batch=1000 fwd=1 strict=on conc=16, median of 3 runs", txoV: 50000, wmV: 20000, floorV: 90000},
		{scenario: "drain", settings: "latency=1ms batch=1000 fwd=1 strict=on conc=128 (wm 5000 msgs)", txoV: 30000, wmV: 800},
		{scenario: "steady producers", settings: "batch=1000 fwd=4 strict=on conc=16, 4 producers", txoV: 20000, wmV: 24000},
		{scenario: "scaling", settings: "latency=0s", txo: "0.9x"},
	}
	for i := range 1000 {
		b.latSamples["txoutbox"] = append(b.latSamples["txoutbox"], time.Duration(i+1)*10*time.Microsecond)
		b.latSamples["Watermill"] = append(b.latSamples["Watermill"], time.Duration(i+1)*20*time.Microsecond)
	}
	pts := []point{{0, 0}, {0.5, 0.5}, {1, 1}}
	b.curves = []curve{{"drain", "txoutbox", pts}, {"drain", "Watermill", pts}, {"drain", "floor", pts}, {"outage", "after the outage", pts}, {"outage", "normal drain", pts}}
	b.notifyPts = []notifyPoint{
		{rate: 100, with: notifyRun{achieved: 99, p50: time.Millisecond, p99: 3 * time.Millisecond}, without: notifyRun{achieved: 99, p50: time.Millisecond, p99: 2 * time.Millisecond}},
		{rate: 1000, with: notifyRun{achieved: 400, p50: 2 * time.Millisecond, p99: 9 * time.Millisecond}, without: notifyRun{achieved: 990, p50: time.Millisecond, p99: 4 * time.Millisecond}},
	}
	dir := t.TempDir()
	files, err := b.writePlots(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{
		"throughput.svg":                {"txoutbox", "Watermill", "floor", "drain batch=1000 fwd=1 strict=on conc=16", "steady producers batch=1000 fwd=4"},
		"throughput-broker-latency.svg": {"txoutbox", "Watermill", "drain 1ms batch=1000"},
		"latency.svg":                   {"txoutbox", "Watermill"},
		"drain-progress.svg":            {"txoutbox", "Watermill", "floor"},
		"recovery.svg":                  {"after the outage", "normal drain"},
		"notify.svg":                    {"p99 with NOTIFY", "p99 without", "p50 with NOTIFY"},
		"notify-rate.svg":               {"with NOTIFY", "without", "offered"},
	}
	if len(files) != len(want) {
		t.Errorf("wrote %v, want %d files", files, len(want))
	}
	for name, series := range want {
		data, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		text, err := svgText(data)
		if err != nil {
			t.Errorf("%s is not well-formed SVG: %v", name, err)
			continue
		}
		for _, s := range series {
			if !strings.Contains(text, s) {
				t.Errorf("%s does not show %q; its text: %q", name, s, text)
			}
		}
	}
	// A bench that measured nothing draws nothing.
	empty, err := (&bench{latSamples: map[string][]time.Duration{}}).writePlots(t.TempDir())
	if err != nil || len(empty) != 0 {
		t.Errorf("empty bench wrote %v, %v", empty, err)
	}
}

// svgText parses data as XML with an <svg> root and returns its character
// data.
func svgText(data []byte) (string, error) {
	d := xml.NewDecoder(bytes.NewReader(data))
	var text strings.Builder
	root := ""
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return "", err
		}
		switch tok := tok.(type) {
		case xml.StartElement:
			if root == "" {
				root = tok.Name.Local
			}
		case xml.CharData:
			text.Write(tok)
			text.WriteByte(' ')
		}
	}
	if root != "svg" {
		return "", errors.New("root element is " + root + ", want svg")
	}
	return text.String(), nil
}
