// Command txoutbox-bench runs txoutbox and Watermill's components/forwarder
// (over watermill-sql) side by side on one PostgreSQL database, with the same
// workload, one after the other, and prints a table of figures with the ratios
// txoutbox/watermill.
//
// Usage:
//
//	go run ./cmd/txoutbox-bench                       # default matrix, a few minutes
//	go run ./cmd/txoutbox-bench -quick                # tiny smoke workload (CI)
//	go run ./cmd/txoutbox-bench -scenarios drain -latency 1ms -batch 1000 -forwarders 1,4
//
// Scenarios: insert (producer msgs/s), drain (a backlog, msgs/s), steady
// (producers and forwarders together), latency (p50/p99 from a message's
// send stamp, taken just before its producer's transaction begins, to the
// target at a fixed offered load,
// and the relay's part of it, from the return of the producer's Commit;
// txoutbox woken by LISTEN/NOTIFY, Watermill polling),
// hotkey (a backlog on one key, then on 10 keys carrying half the messages,
// 1 ms broker latency, several forwarders and leases renewed while a key's
// batch goes: msgs/s and duplicates, which must be none), rss (txoutbox forwarder peak RSS over a large backlog, in a child process),
// outage (txoutbox alone: a backlog of -outage-rows whose every key's head
// failed against a broker that was down and waits for its retry; the drain
// rate from the moment the retries are due, against the normal drain rate of
// the same backlog; not in the default list, as it adds minutes).
// The target is an in-process publisher that sleeps -latency per Publish call
// and counts deliveries per message: any lost message makes the command exit 1.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox"
)

type options struct {
	db          string // postgres or mysql
	url         string // PostgreSQL URL, or the MySQL DSN with -db mysql
	messages    int
	keys        int
	payload     int
	perTx       int
	producers   int
	latencies   []time.Duration
	batches     []int
	forwarders  []int
	stricts     []bool
	concurrency []int // empty: by latency, see concurrenciesFor
	poll        time.Duration
	rate        int
	duration    time.Duration
	warmup      time.Duration
	wmPolls     []time.Duration
	wmLatMsgs   int
	scenarios   map[string]bool
	rssRows     int
	rssDrain    int
	runTimeout  time.Duration
	quick       bool
	deleteOnAck bool
	peer        bool          // run Watermill's forwarder too
	repeat      int           // drain, steady and latency runs per setting; medians are reported
	cpuProfile  string        // write a CPU profile of this process here
	hotMsgs     int           // messages of each hotkey run
	stall       time.Duration // a run with no delivery for this long is stalled
	floor       bool          // run the floor relay beside the drains
	notifyRates []int         // commits/s of the notify scenario
	markdown    bool          // print the final tables in Markdown
	plotDir     string        // write SVG plots here
	reportFile  string        // rewrite this file's generated block
	args        string        // the flags given, for the report

	// the outage scenario
	outageRows        int           // backlog
	outageRetry       time.Duration // retry delay of the heads failed in the outage
	outageKeepRunning bool          // no fresh forwarders when every retry is due
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == childRSSArg {
		if err := childRSS(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "txoutbox-bench child:", err)
			os.Exit(1)
		}
		return
	}
	o, err := parseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "txoutbox-bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	code, err := run(ctx, o, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "txoutbox-bench:", err)
		os.Exit(1)
	}
	os.Exit(code)
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	fs := flag.NewFlagSet("txoutbox-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o options
	var latencies, batches, forwarders, stricts, wmPolls, scenarios string
	var skipRSS bool
	defURL := cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	fs.StringVar(&o.url, "url", "", "PostgreSQL URL (default from TEST_DATABASE_URL), or with -db mysql a go-sql-driver/mysql DSN (default from TEST_MYSQL_DSN)")
	fs.StringVar(&o.db, "db", "postgres", "database of both relays: postgres, or mysql (MySQL/MariaDB: scenarios insert, drain and steady; both relays poll)")
	fs.IntVar(&o.messages, "messages", 50000, "messages per run")
	fs.IntVar(&o.keys, "keys", 1000, "distinct ordering keys; 0 = keyless")
	fs.IntVar(&o.payload, "payload", 256, "payload bytes")
	fs.IntVar(&o.perTx, "per-tx", 10, "messages per producer transaction (one Publish call)")
	fs.IntVar(&o.producers, "producers", 4, "concurrent producers")
	fs.StringVar(&latencies, "latency", "0,1ms", "simulated broker latency per Publish call (list)")
	fs.StringVar(&batches, "batch", "100,1000", "batch sizes (txoutbox BatchSize, watermill-sql SubscribeBatchSize) (list)")
	fs.StringVar(&forwarders, "forwarders", "1,4", "forwarders running at once (list)")
	fs.StringVar(&stricts, "strict", "on,off", "txoutbox strict ordering (list of on/off)")
	var concurrency string
	fs.StringVar(&concurrency, "concurrency", "auto", "txoutbox Concurrency (list); auto = 16 (the default) without broker latency, 16 and 128 with it")
	fs.DurationVar(&o.poll, "poll", 10*time.Millisecond, "idle poll interval of both relays in drain and steady runs")
	fs.IntVar(&o.rate, "rate", 1000, "offered load of the latency scenario, msgs/s")
	fs.DurationVar(&o.duration, "duration", 5*time.Second, "length of the latency scenario")
	fs.DurationVar(&o.warmup, "warmup", time.Second, "latency and steady scenarios: the first stretch of the load, whose latencies are not counted (both relays start cold: new connections, statements not yet planned); in latency, offered before the measured -duration")
	fs.StringVar(&wmPolls, "wm-poll", "1ms,10ms", "watermill poll intervals tried in the latency scenario; the best is reported (list)")
	fs.IntVar(&o.wmLatMsgs, "wm-latency-messages", 5000, "cap on messages of watermill drains with broker latency (it forwards one at a time)")
	fs.StringVar(&scenarios, "scenarios", "insert,drain,steady,latency,notify,hotkey,rss", "scenarios to run (list); notify: what the NOTIFY trigger costs producers per commit (commit latency, CPU) at each -notify-rates, one message per commit, with and without the trigger; hotkey: one key, then 10 keys carrying half the messages, 1 ms broker latency, the most -forwarders, a 2 s lease; outage (not in the default list, it adds minutes): txoutbox alone, strict ordering, a backlog of -outage-rows over -keys keys whose every key's head failed while the broker was down, drained once the retries are due, against a normal drain of the same backlog, at the first -latency, -batch and -forwarders; with -db mysql the default is insert,drain,steady")
	fs.IntVar(&o.hotMsgs, "hot-messages", 3000, "messages of each hotkey run")
	fs.IntVar(&o.outageRows, "outage-rows", 200_000, "backlog of the outage scenario")
	fs.DurationVar(&o.outageRetry, "outage-backoff", 30*time.Second, "outage scenario: retry delay of the failed heads (Backoff.Base = Max, no jitter); must outlast the outage phase (every key's head failing)")
	fs.BoolVar(&o.outageKeepRunning, "outage-keep-running", false, "outage scenario: keep the forwarders running after the outage and time the drain from the first retry due (paced by the retries coming due); by default they stop once every head has failed, and fresh ones start when the last retry is due, timed from then")
	fs.IntVar(&o.rssRows, "rss-rows", 1_000_000, "pending rows of the rss scenario")
	fs.IntVar(&o.rssDrain, "rss-drain", 200_000, "rows the rss child forwards before its peak RSS is read")
	fs.BoolVar(&skipRSS, "skip-rss", false, "skip the rss scenario (inserting its backlog takes a while)")
	fs.DurationVar(&o.runTimeout, "run-timeout", 5*time.Minute, "bound on each run; a run that outlives it is reported as stalled (its undelivered messages count as lost for txoutbox)")
	fs.DurationVar(&o.stall, "stall", 30*time.Second, "a run in which nothing is delivered for this long is stopped and reported as stalled, with what it delivered")
	fs.BoolVar(&o.floor, "floor", true, "run the floor relay (the storage contract's minimum in bare SQL, primary key only) beside each drain without broker latency")
	var notifyRates string
	fs.StringVar(&notifyRates, "notify-rates", "100,1000,5000", "notify scenario: offered commits/s (list)")
	fs.BoolVar(&o.markdown, "markdown", false, "print the final tables in Markdown (rows still stream as text while the runs finish)")
	fs.StringVar(&o.plotDir, "plot", "", "write SVG plots of the results into this directory (throughput, latency distribution, drain progress, NOTIFY cost)")
	fs.StringVar(&o.reportFile, "report", "", "replace the generated block of this Markdown file (between <!-- txoutbox-bench:DB --> and <!-- /txoutbox-bench:DB -->, DB the -db) with the Markdown tables")
	fs.BoolVar(&o.quick, "quick", false, "tiny smoke workload (small sizes for the flags not given)")
	fs.BoolVar(&o.deleteOnAck, "delete-on-ack", false, "txoutbox: postgres.Config.DeleteOnAck (delete delivered rows instead of marking them)")
	fs.IntVar(&o.repeat, "repeat", 1, "drain, steady and latency runs of each relay per setting, alternating; the median rate (drain), or the median of each figure (steady, latency) is reported")
	fs.BoolVar(&o.peer, "peer", true, "also run Watermill's forwarder (false: txoutbox only, no ratios; for profiling)")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the bench process (relays included) to this file")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	o.args = shellJoin(args)
	switch o.db {
	case "postgres":
		o.url = cmp.Or(o.url, defURL)
	case "mysql":
		o.url = cmp.Or(o.url, os.Getenv("TEST_MYSQL_DSN"), "root@tcp(127.0.0.1:3306)/test")
		scenariosSet := false
		fs.Visit(func(f *flag.Flag) { scenariosSet = scenariosSet || f.Name == "scenarios" })
		if !scenariosSet {
			scenarios = "insert,drain,steady"
		}
		for _, sc := range strings.Split(scenarios, ",") {
			if sc == "latency" || sc == "rss" || sc == "hotkey" || sc == "outage" || sc == "notify" {
				return o, fmt.Errorf("-scenarios %s: not available with -db mysql (it needs LISTEN/NOTIFY, the PostgreSQL child, or is not ported to MySQL yet)", sc)
			}
		}
	default:
		return o, fmt.Errorf("-db %q: want postgres or mysql", o.db)
	}
	var err error
	if o.latencies, err = parseList(latencies, time.ParseDuration); err != nil {
		return o, fmt.Errorf("-latency: %w", err)
	}
	if o.batches, err = parseList(batches, strconv.Atoi); err != nil {
		return o, fmt.Errorf("-batch: %w", err)
	}
	if o.forwarders, err = parseList(forwarders, strconv.Atoi); err != nil {
		return o, fmt.Errorf("-forwarders: %w", err)
	}
	if concurrency != "auto" {
		if o.concurrency, err = parseList(concurrency, strconv.Atoi); err != nil {
			return o, fmt.Errorf("-concurrency: %w", err)
		}
	}
	if o.notifyRates, err = parseList(notifyRates, strconv.Atoi); err != nil {
		return o, fmt.Errorf("-notify-rates: %w", err)
	}
	if o.wmPolls, err = parseList(wmPolls, time.ParseDuration); err != nil {
		return o, fmt.Errorf("-wm-poll: %w", err)
	}
	if o.stricts, err = parseList(stricts, func(s string) (bool, error) {
		switch s {
		case "on", "true":
			return true, nil
		case "off", "false":
			return false, nil
		}
		return false, fmt.Errorf("%q: want on or off", s)
	}); err != nil {
		return o, fmt.Errorf("-strict: %w", err)
	}
	o.scenarios = map[string]bool{}
	for _, s := range strings.Split(scenarios, ",") {
		s = strings.TrimSpace(s)
		switch s {
		case "insert", "drain", "steady", "latency", "notify", "hotkey", "rss", "outage":
			o.scenarios[s] = true
		case "":
		default:
			return o, fmt.Errorf("-scenarios: unknown scenario %q", s)
		}
	}
	if skipRSS {
		delete(o.scenarios, "rss")
	}
	if o.quick {
		// Small sizes for the flags not given explicitly.
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		quick := map[string]func(){
			"messages": func() { o.messages = 1000 }, "keys": func() { o.keys = 100 },
			"rate": func() { o.rate = 500 }, "duration": func() { o.duration = time.Second }, "warmup": func() { o.warmup = 0 },
			"rss-rows": func() { o.rssRows = 20000 }, "rss-drain": func() { o.rssDrain = 5000 },
			"wm-latency-messages": func() { o.wmLatMsgs = 300 }, "batch": func() { o.batches = []int{100} },
			"hot-messages": func() { o.hotMsgs = 300 },
			"outage-rows":  func() { o.outageRows = 2000 }, "outage-backoff": func() { o.outageRetry = 3 * time.Second },
			"forwarders": func() { o.forwarders = []int{1, 2} }, "wm-poll": func() { o.wmPolls = []time.Duration{10 * time.Millisecond} },
			"notify-rates": func() { o.notifyRates = []int{100, 500} },
		}
		for name, apply := range quick {
			if !set[name] {
				apply()
			}
		}
	}
	for _, v := range slices.Concat([]int{o.messages, o.perTx, o.producers, o.rate, o.repeat, o.hotMsgs}, o.batches, o.forwarders, o.notifyRates) {
		if v <= 0 {
			return o, errors.New("-messages, -per-tx, -producers, -rate, -repeat, -hot-messages, -batch, -forwarders and -notify-rates must be > 0")
		}
	}
	if o.stall <= 0 || o.runTimeout <= 0 {
		return o, errors.New("-stall and -run-timeout must be > 0")
	}
	if o.keys < 0 || o.payload < 0 {
		return o, errors.New("-keys and -payload must be >= 0")
	}
	if o.scenarios["outage"] {
		switch {
		case o.outageRows <= 0 || o.outageRetry <= 0:
			return o, errors.New("-outage-rows and -outage-backoff must be > 0")
		case o.keys == 0:
			return o, errors.New("-scenarios outage needs -keys > 0: it measures keys held behind their failed heads")
		}
	}
	for _, c := range o.concurrency {
		if c <= 0 {
			return o, errors.New("-concurrency must be auto or > 0")
		}
	}
	return o, nil
}

// shellJoin joins args for a shell, quoting those that need it.
func shellJoin(args []string) string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = a
		if a == "" || strings.ContainsAny(a, " \t'\"$\\*?;&|<>()") {
			out[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
	}
	return strings.Join(out, " ")
}

func parseList[T any](s string, parse func(string) (T, error)) ([]T, error) {
	var out []T
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		v, err := parse(f)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	if len(out) == 0 {
		return nil, errors.New("empty list")
	}
	return out, nil
}

type bench struct {
	o       options
	out     io.Writer
	rows    []row
	printed int // rows already streamed to out
	lost    bool
	seq     int
	payload []byte
	inserts map[string][]float64 // producer msgs/s per relay
	cpu     cpuMeter
	// hot, when set, maps a message index to its key (hotkey scenario);
	// hotKeys is then the number of keys.
	hot     func(i int) int
	hotKeys int

	checkpointWarned bool
	// cur is the sink of the run that records latencies (together), for
	// the producers to record their commits in; nil otherwise.
	cur *sink
	// What the plots draw: latency samples per relay (latency scenario,
	// all runs pooled), drain progress curves, NOTIFY points.
	loadStart  string // the load average when the bench started
	latSamples map[string][]time.Duration
	curves     []curve
	notifyPts  []notifyPoint
}

func run(ctx context.Context, o options, out io.Writer) (int, error) {
	b := &bench{o: o, out: out, payload: make([]byte, o.payload), inserts: map[string][]float64{}, latSamples: map[string][]time.Duration{}}
	if o.db == "postgres" {
		b.cpu = newCPUMeter(o.url)
	}
	for i := range b.payload {
		b.payload[i] = byte('a' + rand.IntN(26))
	}
	if o.cpuProfile != "" {
		f, err := os.Create(o.cpuProfile)
		if err != nil {
			return 1, fmt.Errorf("-cpuprofile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return 1, fmt.Errorf("-cpuprofile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	start := time.Now()
	b.loadStart = loadAverage()
	fmt.Fprintf(out, "txoutbox-bench %s: %s\n", start.Format(time.RFC3339), b.conditions())
	steps := []struct {
		name string
		fn   func(context.Context) error
	}{
		{"drain", b.drain}, {"insert", b.insert}, {"steady", b.steady}, {"latency", b.latency}, {"notify", b.notify}, {"hotkey", b.hotkey}, {"outage", b.outage}, {"rss", b.rss},
	}
	var stepErr error
	for _, s := range steps {
		if !o.scenarios[s.name] {
			continue
		}
		err := s.fn(ctx)
		b.flush()
		if err != nil {
			stepErr = fmt.Errorf("%s: %w", s.name, err)
			break
		}
	}
	total := time.Since(start).Round(time.Second)
	if err := b.finishOutput(ctx, total); err != nil {
		stepErr = errors.Join(stepErr, err)
	}
	if stepErr != nil {
		return 1, stepErr
	}
	if b.lost {
		fmt.Fprintln(out, "FAIL: messages were lost")
		return 1, nil
	}
	return 0, nil
}

func (b *bench) progress(format string, args ...any) { progressf(format, args...) }

// progressf prints a line of progress on stderr.
func progressf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "  "+format+"\n", args...)
}

// name returns a table name unique to this process and run.
func (b *bench) name(kind string) string {
	b.seq++
	return fmt.Sprintf("bench_%s_%d_%d", kind, os.Getpid(), b.seq)
}

// concurrenciesFor returns the txoutbox Concurrency values a drain runs at:
// the forwarder's default, and with broker latency also 128, which lets one
// forwarder keep more publishes in flight than the default does.
func (b *bench) concurrenciesFor(latency time.Duration) []int {
	if len(b.o.concurrency) > 0 {
		return b.o.concurrency
	}
	if latency > 0 {
		return []int{txoutbox.ConcurrencyDefault, 128}
	}
	return []int{txoutbox.ConcurrencyDefault}
}

// concurrencyFor is the Concurrency of the runs that take one value.
func (b *bench) concurrencyFor(latency time.Duration) int {
	return b.concurrenciesFor(latency)[0]
}

func (b *bench) message(i int, sent bool) *message.Message {
	m := message.NewMessage(makeUUID(i), b.payload)
	if k := b.keyOf(i); k >= 0 {
		m.Metadata.Set(txoutbox.MetadataKey, "k"+strconv.Itoa(k))
	}
	if sent {
		m.Metadata.Set(metaSent, strconv.FormatInt(time.Now().UnixNano(), 10))
	}
	return m
}

// plan splits messages [0, n) into transactions of up to per-tx messages,
// one list per producer. All messages of a key go to one producer, in index
// order, so per-key insertion order is index order and the sink can count
// reorders. Keyless messages are dealt round-robin.
func (b *bench) plan(n int) [][][]int {
	p := b.o.producers
	owned := make([][]int, p)
	for i := range n {
		owner := i % p
		if k := b.keyOf(i); k >= 0 {
			owner = k % p
		}
		owned[owner] = append(owned[owner], i)
	}
	txs := make([][][]int, p)
	for w, ids := range owned {
		for len(ids) > 0 {
			k := min(b.o.perTx, len(ids))
			txs[w] = append(txs[w], ids[:k])
			ids = ids[k:]
		}
	}
	return txs
}

// keyOf returns the key of message i, -1 for keyless.
func (b *bench) keyOf(i int) int {
	switch {
	case b.hot != nil:
		return b.hot(i)
	case b.o.keys > 0:
		return i % b.o.keys
	}
	return -1
}

// newSink returns a sink for n messages keyed like the bench's messages.
func (b *bench) newSink(n int, latency time.Duration, recordLatency bool) *sink {
	if b.hot != nil {
		return newSink(n, b.hotKeys, b.hot, latency, recordLatency)
	}
	return newSink(n, b.o.keys, nil, latency, recordLatency)
}

// messagesOf returns the messages of indexes ids.
func (b *bench) messagesOf(ids []int, stamp bool) []*message.Message {
	msgs := make([]*message.Message, len(ids))
	for j, i := range ids {
		msgs[j] = b.message(i, stamp)
	}
	return msgs
}

func (b *bench) publishTx(ctx context.Context, r relay, ids []int, stamp bool) error {
	if err := r.PublishTx(ctx, b.messagesOf(ids, stamp)); err != nil {
		return fmt.Errorf("producer: %w", err)
	}
	if stamp && b.cur != nil {
		b.cur.commit(ids, time.Now())
	}
	return nil
}

// produce writes messages [0, n) through r with the configured producers as
// fast as they go, and returns msgs/s.
func (b *bench) produce(ctx context.Context, r relay, n int, stamp bool) (float64, error) {
	plan := b.plan(n)
	var wg sync.WaitGroup
	errs := make(chan error, len(plan))
	start := time.Now()
	for _, txs := range plan {
		wg.Go(func() {
			for _, ids := range txs {
				if ctx.Err() != nil {
					return
				}
				if err := b.publishTx(ctx, r, ids, stamp); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return 0, err
	}
	return float64(n) / time.Since(start).Seconds(), ctx.Err()
}

// produceAt writes n messages at rate msgs/s, stamped with their send time:
// transactions are started on a fixed schedule, round-robin over producers.
func (b *bench) produceAt(ctx context.Context, r relay, n, rate int) error {
	plan := b.plan(n)
	var wg sync.WaitGroup
	errs := make(chan error, len(plan))
	queues := make([]chan []int, len(plan))
	for w := range plan {
		queues[w] = make(chan []int, len(plan[w]))
		wg.Go(func() {
			for ids := range queues[w] {
				if err := b.publishTx(ctx, r, ids, true); err != nil {
					select {
					case errs <- err:
					default:
					}
				}
			}
		})
	}
	interval := time.Duration(float64(time.Second) * float64(b.o.perTx) / float64(rate))
	start := time.Now()
	next := make([]int, len(plan))
	for k := 0; ctx.Err() == nil; k++ {
		w := k % len(plan)
		if next[w] >= len(plan[w]) {
			done := true
			for v := range plan {
				if next[v] < len(plan[v]) {
					done = false
				}
			}
			if done {
				break
			}
			continue
		}
		if d := time.Until(start.Add(time.Duration(k) * interval)); d > 0 {
			time.Sleep(d) // pacing the offered load, not synchronisation
		}
		queues[w] <- plan[w][next[w]]
		next[w]++
	}
	for _, q := range queues {
		close(q)
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	return ctx.Err()
}

// outcome is what one relay did in one run.
type outcome struct {
	rate      float64 // msgs/s
	sustained float64 // msgs/s between a tenth and nine tenths delivered
	insert    float64 // producer msgs/s, when measured
	dup, lost int64
	reorders  int64
	p50, p99  time.Duration
	// rp50, rp99: the relay's part of the latency, from the producer's
	// commit to the delivery (printed by the latency scenario).
	rp50, rp99 time.Duration
	n          int
	cpu        string // database+relay CPU per message, when measured
	// stalled says why the run ended before every message was delivered
	// ("stalled: nothing delivered for 30s", "failed: ..."), with what it
	// delivered by then and how long it ran; "" for a complete run.
	stalled   string
	note      string // a median's runs that did not complete
	delivered int64
	elapsed   time.Duration
	lats      []time.Duration // sorted latencies (runs that record them)
	curve     []point         // drain progress: seconds from the start, fraction delivered
}

// show returns fig, or what the run did if it did not complete.
func (oc outcome) show(fig string) string {
	switch {
	case oc.stalled != "" && strings.Contains(oc.stalled, "(every run"):
		return oc.stalled
	case oc.stalled != "":
		return fmt.Sprintf("%s (%d of %d delivered in %s)", oc.stalled, oc.delivered, oc.n, oc.elapsed.Round(100*time.Millisecond))
	case oc.note != "":
		return fig + " (" + oc.note + ")"
	}
	return fig
}

func (oc outcome) dl() string {
	if oc.n == 0 {
		return "-" // not run
	}
	s := fmt.Sprintf("%d/%d", oc.dup, oc.lost)
	if oc.reorders > 0 {
		s += fmt.Sprintf(" (%d reordered)", oc.reorders)
	}
	return s
}

// await waits until s saw every message, and returns "". It gives up and
// says why when nothing was delivered for -stall, when the run outlived
// -run-timeout, or when ctx is done.
func (b *bench) await(ctx context.Context, s *sink) string {
	deadline := time.NewTimer(b.o.runTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(min(b.o.stall/10, time.Second))
	defer tick.Stop()
	last, lastAt := s.unique.Load(), time.Now()
	for {
		select {
		case <-s.done:
			return ""
		case <-deadline.C:
			return fmt.Sprintf("timed out after -run-timeout %s", b.o.runTimeout)
		case <-ctx.Done():
			return "interrupted"
		case now := <-tick.C:
			if u := s.unique.Load(); u != last {
				last, lastAt = u, now
			} else if now.Sub(lastAt) >= b.o.stall {
				return fmt.Sprintf("stalled: nothing delivered for %s", b.o.stall)
			}
		}
	}
}

// stopGrace bounds how long a relay may take to stop or to tear down: one
// that stalled may not return (a forwarder blocked in its database); the
// bench then leaves it behind and goes on with the next run.
const stopGrace = 30 * time.Second

// bounded runs fn and waits at most stopGrace for it; it reports whether fn
// returned.
func (b *bench) bounded(what string, fn func()) bool {
	done := make(chan struct{})
	go func() { defer close(done); fn() }()
	select {
	case <-done:
		return true
	case <-time.After(stopGrace):
		b.progress("%s did not return within %s: left behind", what, stopGrace)
		return false
	}
}

// failRun records that a run could not complete: err for txoutbox and the
// floor fails the command, for Watermill it is only reported.
func (b *bench) failRun(kind string, oc *outcome, err error) {
	oc.stalled = "failed: " + err.Error()
	if kind != "wm" {
		b.lost = true
	}
	b.progress("%s run failed: %v", kind, err)
}

func (b *bench) finish(oc *outcome, s *sink) {
	oc.dup, oc.lost, oc.reorders = s.duplicates(), s.losses(), s.reorders.Load()
	oc.delivered = s.unique.Load()
	if oc.lost > 0 {
		b.lost = true
	}
	if s.recordLatency {
		s.mu.Lock()
		lats := slices.Clone(s.latencies)
		s.mu.Unlock()
		slices.Sort(lats)
		oc.lats = lats
		oc.p50, oc.p99 = percentiles(lats)
		relay := s.relayLatencies()
		slices.Sort(relay)
		oc.rp50, oc.rp99 = percentiles(relay)
	}
}

// percentiles returns the p50 and p99 of sorted (0, 0 when empty).
func percentiles(sorted []time.Duration) (p50, p99 time.Duration) {
	if len(sorted) == 0 {
		return 0, 0
	}
	return sorted[len(sorted)*50/100], sorted[min(len(sorted)*99/100, len(sorted)-1)]
}

// drainRun fills a backlog of n messages through the producers, then starts
// the forwarders and times the drain. A run that cannot complete (an error,
// a stall, the run timeout) is reported in oc.stalled; err is only for what
// stops the bench (ctx done).
func (b *bench) drainRun(ctx context.Context, kind string, cfg relayConfig, n int, latency time.Duration) (oc outcome, err error) {
	oc.n = n
	cfg.name = b.name(kind)
	r := b.newRelay(kind, cfg)
	defer b.teardown(ctx, r)
	runCtx, cancel := context.WithTimeout(ctx, b.o.runTimeout)
	defer cancel()
	start := time.Now()
	if err := r.Setup(runCtx); err != nil {
		b.failRun(kind, &oc, fmt.Errorf("set up: %w", err))
		return oc, ctx.Err()
	}
	if oc.insert, err = b.produce(runCtx, r, n, false); err != nil {
		b.failRun(kind, &oc, fmt.Errorf("fill the backlog: %w", err))
		oc.elapsed = time.Since(start)
		return oc, ctx.Err()
	}
	b.inserts[kind] = append(b.inserts[kind], oc.insert)
	if err := b.settle(runCtx); err != nil {
		b.failRun(kind, &oc, err)
		return oc, ctx.Err()
	}
	s := b.newSink(n, latency, false)
	cpu0 := b.cpu.sample()
	start = time.Now()
	stop, err := r.Start(runCtx, s)
	if err != nil {
		b.failRun(kind, &oc, fmt.Errorf("start: %w", err))
		return oc, ctx.Err()
	}
	why := b.await(runCtx, s)
	cpu1 := b.cpu.sample()
	b.bounded(kind+" forwarders' stop", stop)
	oc.elapsed = time.Since(start)
	if a, b := s.tenthAt.Load(), s.nineTenthsAt.Load(); a > 0 && b > a {
		oc.sustained = float64(n*9/10-n/10) / time.Duration(b-a).Seconds()
	}
	if db, self, ok := perMessage(cpu0, cpu1, int(s.unique.Load())); ok {
		oc.cpu = fmt.Sprintf("%.1f+%.1f", db, self)
	}
	if at := s.doneAt.Load(); at > 0 {
		oc.rate = float64(n) / time.Unix(0, at).Sub(start).Seconds()
	}
	oc.curve = s.curve(start)
	b.finishRun(ctx, kind, &oc, s, why)
	return oc, ctx.Err()
}

// finishRun counts what the sink saw (finish) and records a run that did
// not complete; only txoutbox's and the floor's losses fail the command:
// Watermill's stalls are its own figures.
func (b *bench) finishRun(ctx context.Context, kind string, oc *outcome, s *sink, why string) {
	lost := b.lost
	b.finish(oc, s)
	if why != "" {
		if b.o.db == "postgres" {
			why += b.heldBack(ctx)
		}
		oc.stalled = why
		b.progress("%s run %s: %d of %d delivered in %s; first undelivered: %s", kind, why, oc.delivered, oc.n, oc.elapsed.Round(time.Millisecond), strings.Join(s.missing(5), " "))
	}
	if kind == "wm" {
		b.lost = lost
	}
}

// heldBack names the oldest transaction open elsewhere in the database, if
// one has been open longer than -stall: it holds back the snapshot's xmin,
// and watermill-sql's PostgreSQL subscriber reads only rows whose
// transaction is older than that xmin (its commit fence), so it delivers
// nothing until that transaction ends.
func (b *bench) heldBack(ctx context.Context) string {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, b.o.url)
	if err != nil {
		return ""
	}
	defer conn.Close(ctx)
	var age time.Duration
	var app, state string
	err = conn.QueryRow(ctx, `SELECT now() - xact_start, application_name, state FROM pg_stat_activity
WHERE xact_start IS NOT NULL AND backend_xmin IS NOT NULL AND pid <> pg_backend_pid() AND application_name <> $1
ORDER BY xact_start LIMIT 1`, benchApp).Scan(&age, &app, &state)
	if err != nil || age < b.o.stall {
		return ""
	}
	return fmt.Sprintf("; a transaction open %s elsewhere (application %q, %s) held back the snapshot", age.Round(time.Second), app, state)
}

// teardown drops a run's tables, bounded (a stalled relay's connections may
// hold locks on them).
func (b *bench) teardown(ctx context.Context, r relay) {
	b.bounded("teardown", func() {
		tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), stopGrace)
		defer cancel()
		if err := r.Teardown(tctx); err != nil {
			b.progress("teardown: %v", err)
		}
	})
}

// settle puts the database in the same state before every timed drain, so
// that runs compare: a checkpoint, so that no run pays for another's dirty
// pages or starts in the middle of a checkpoint. It does not ANALYZE: each
// relay runs on the statistics autovacuum left it, as after a burst in
// production. CHECKPOINT needs a superuser or pg_checkpoint; without it the
// runs are noisier.
func (b *bench) settle(ctx context.Context) error {
	switch {
	case b.o.db == "mysql":
		return nil // InnoDB flushes in the background; there is no CHECKPOINT to ask for
	case b.o.quick:
		return nil // a smoke run checks deliveries, not timing: a checkpoint per drain only slows it
	}
	conn, err := pgx.Connect(ctx, b.o.url)
	if err != nil {
		return fmt.Errorf("settle: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "CHECKPOINT"); err != nil && !b.checkpointWarned {
		b.checkpointWarned = true
		b.progress("no CHECKPOINT between runs (%v): expect noisier figures", err)
	}
	return nil
}

func (b *bench) newRelay(kind string, cfg relayConfig) relay {
	cfg.url = b.o.url
	cfg.producers = b.o.producers
	cfg.deleteOnAck = b.o.deleteOnAck
	switch {
	case b.o.db == "mysql" && kind == "wm":
		return newWmMyRelay(cfg)
	case b.o.db == "mysql" && kind == "floor":
		return newFloorMyRelay(cfg)
	case b.o.db == "mysql":
		return newTxoMyRelay(cfg)
	case kind == "wm":
		return newWmRelay(cfg)
	case kind == "floor":
		return newFloorRelay(cfg, b.payload)
	}
	return newTxoRelay(cfg)
}

func ratio(a, w float64) string {
	if a <= 0 || w <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", a/w)
}

// speed compares txoutbox's latency txo with Watermill's wm: "1.40x
// faster" when txo is lower, "1.14x slower" when it is higher.
func speed(txo, wm time.Duration) string {
	if txo <= 0 || wm <= 0 {
		return "-"
	}
	if txo <= wm {
		return fmt.Sprintf("%.2fx faster", float64(wm)/float64(txo))
	}
	return fmt.Sprintf("%.2fx slower", float64(txo)/float64(wm))
}

func rate(v float64) string {
	if v <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f/s", v)
}

func onOff(v bool) string {
	if v {
		return "on"
	}
	return "off"
}

func (b *bench) drain(ctx context.Context) error {
	// Watermill and the floor have no strict ordering and no Concurrency:
	// each runs once per latency, batch and forwarder count, and its figure
	// is reused for the txoutbox variants.
	wmCache, floorCache := map[string]outcome{}, map[string]outcome{}
	type scaleKey struct {
		lat         time.Duration
		batch, conc int
		strict      bool
	}
	txoByFw := map[scaleKey]map[int]outcome{}
	var order []scaleKey
	for _, lat := range b.o.latencies {
		for _, batch := range b.o.batches {
			for _, conc := range b.concurrenciesFor(lat) {
				for _, fw := range b.o.forwarders {
					for _, strict := range b.o.stricts {
						cfg := relayConfig{batch: batch, concurrency: conc, strict: strict, poll: b.o.poll, forwarders: fw}
						key := fmt.Sprint(lat, batch, fw)
						w, haveW := wmCache[key]
						f, haveF := floorCache[key]
						runW := !haveW && b.o.peer
						// The floor is the database's minimum for a no-op
						// broker; with broker latency it would measure the
						// sleep, not the database.
						runF := !haveF && b.o.floor && lat == 0
						var tRuns, wRuns, fRuns []outcome
						// Repeats alternate the relays, so that a slow
						// moment of the machine hits all of them.
						for rep := range b.o.repeat {
							b.progress("drain txoutbox latency=%s batch=%d concurrency=%d forwarders=%d strict=%s (run %d of %d)", lat, batch, conc, fw, onOff(strict), rep+1, b.o.repeat)
							t, err := b.drainRun(ctx, "txo", cfg, b.o.messages, lat)
							if err != nil {
								return err
							}
							tRuns = append(tRuns, t)
							if runW {
								n := b.o.messages
								if lat > 0 {
									n = min(n, b.o.wmLatMsgs)
								}
								b.progress("drain watermill latency=%s batch=%d forwarders=%d messages=%d (run %d of %d)", lat, batch, fw, n, rep+1, b.o.repeat)
								w, err := b.drainRun(ctx, "wm", cfg, n, lat)
								if err != nil {
									return err
								}
								wRuns = append(wRuns, w)
							}
							if runF {
								b.progress("drain floor batch=%d forwarders=%d (run %d of %d)", batch, fw, rep+1, b.o.repeat)
								f, err := b.drainRun(ctx, "floor", cfg, b.o.messages, lat)
								if err != nil {
									return err
								}
								fRuns = append(fRuns, f)
							}
						}
						t := medianRun(tRuns)
						if runW {
							w = medianRun(wRuns)
							wmCache[key] = w
						}
						if runF {
							f = medianRun(fRuns)
							floorCache[key] = f
						}
						sk := scaleKey{lat, batch, conc, strict}
						if txoByFw[sk] == nil {
							txoByFw[sk] = map[int]outcome{}
							order = append(order, sk)
						}
						txoByFw[sk][fw] = t
						settings := fmt.Sprintf("latency=%s batch=%d fwd=%d strict=%s conc=%d", lat, batch, fw, onOff(strict), conc)
						if w.n != t.n && w.n > 0 {
							settings += fmt.Sprintf(" (wm %d msgs)", w.n)
						}
						// One curve per relay: the first batch-size setting
						// of the largest batch, one forwarder, no latency.
						if lat == 0 && fw == slices.Min(b.o.forwarders) && batch == slices.Max(b.o.batches) && strict == b.o.stricts[0] && conc == b.concurrencyFor(0) {
							b.addCurve("drain", "txoutbox", t)
							b.addCurve("drain", "Watermill", w)
							b.addCurve("drain", "floor", f)
						}
						b.add(row{
							scenario: "drain", settings: settings,
							txo: t.show(rate(t.rate)), wm: w.show(rate(w.rate)), ratio: faster(t.rate, w.rate),
							floor: f.show(rate(f.rate)), ofFloor: fraction(t.rate, f.rate),
							txoDL: t.dl(), wmDL: w.dl(), txoCPU: t.cpu, wmCPU: w.cpu,
							txoV: t.rate, wmV: w.rate, floorV: f.rate,
						})
					}
				}
			}
		}
	}
	// Scaling: the most forwarders against one, same settings otherwise.
	if len(b.o.forwarders) > 1 {
		lo, hi := slices.Min(b.o.forwarders), slices.Max(b.o.forwarders)
		for _, sk := range order {
			t1, ok1 := txoByFw[sk][lo]
			tn, okn := txoByFw[sk][hi]
			if !ok1 || !okn || lo == hi {
				continue
			}
			w1, wn := wmCache[fmt.Sprint(sk.lat, sk.batch, lo)], wmCache[fmt.Sprint(sk.lat, sk.batch, hi)]
			f1, fn := floorCache[fmt.Sprint(sk.lat, sk.batch, lo)], floorCache[fmt.Sprint(sk.lat, sk.batch, hi)]
			b.add(row{
				scenario: "scaling",
				settings: fmt.Sprintf("latency=%s batch=%d strict=%s conc=%d: rate with fwd=%d / with fwd=%d (sustained: txo %s, wm %s)", sk.lat, sk.batch, onOff(sk.strict), sk.conc, hi, lo,
					ratio(tn.sustained, t1.sustained), ratio(wn.sustained, w1.sustained)),
				txo: ratio(tn.rate, t1.rate), wm: ratio(wn.rate, w1.rate), floor: ratio(fn.rate, f1.rate),
			})
		}
	}
	return nil
}

// medianRun returns the run with the median rate, with the duplicates, losses
// and reorders of all the runs added up.
func medianRun(runs []outcome) outcome {
	sorted := completed(runs)
	slices.SortFunc(sorted, func(a, b outcome) int { return cmp.Compare(a.rate, b.rate) })
	m := sorted[len(sorted)/2]
	m.dup, m.lost, m.reorders = 0, 0, 0
	for _, r := range runs {
		m.dup += r.dup
		m.lost += r.lost
		m.reorders += r.reorders
	}
	m.stalledFrom(runs)
	return m
}

// completed returns the runs that delivered every message, or all of them
// if none did.
func completed(runs []outcome) []outcome {
	var out []outcome
	for _, r := range runs {
		if r.stalled == "" {
			out = append(out, r)
		}
	}
	if len(out) == 0 {
		return slices.Clone(runs)
	}
	return out
}

// stalledFrom makes m, the median of the completed runs, say how many runs
// did not complete and why the first one did not: a median that hid them
// would flatter the relay. With no completed run, m is the first run's
// stall.
func (m *outcome) stalledFrom(runs []outcome) {
	stalled, first := 0, -1
	for i, r := range runs {
		if r.stalled != "" {
			stalled++
			if first < 0 {
				first = i
			}
		}
	}
	switch {
	case stalled == 0:
	case stalled == len(runs):
		r := runs[first]
		m.stalled, m.delivered, m.elapsed, m.n = r.stalled, r.delivered, r.elapsed, r.n
		if len(runs) > 1 {
			m.stalled = fmt.Sprintf("%s (every run; the first: %d of %d delivered in %s)", r.stalled, r.delivered, r.n, r.elapsed.Round(100*time.Millisecond))
		}
	default:
		r := runs[first]
		m.note = fmt.Sprintf("median of the %d complete runs; run %d of %d %s, %d of %d delivered in %s",
			len(runs)-stalled, first+1, len(runs), r.stalled, r.delivered, r.n, r.elapsed.Round(100*time.Millisecond))
	}
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	v = slices.Clone(v)
	slices.Sort(v)
	return v[len(v)/2]
}

// insert reports producer msgs/s: the median of the drain runs' fill phases,
// or one fill per relay when drain did not run.
func (b *bench) insert(ctx context.Context) error {
	for _, kind := range []string{"txo", "wm", "floor"} {
		if len(b.inserts[kind]) > 0 || kind == "wm" && !b.o.peer || kind == "floor" && !b.o.floor {
			continue
		}
		cfg := relayConfig{batch: b.o.batches[0], strict: true, poll: b.o.poll, forwarders: 1}
		cfg.name = b.name(kind)
		r := b.newRelay(kind, cfg)
		if err := r.Setup(ctx); err != nil {
			return errors.Join(err, r.Teardown(context.WithoutCancel(ctx)))
		}
		v, err := b.produce(ctx, r, b.o.messages, false)
		if err := errors.Join(err, r.Teardown(context.WithoutCancel(ctx))); err != nil {
			return err
		}
		b.inserts[kind] = append(b.inserts[kind], v)
	}
	t, w := median(b.inserts["txo"]), median(b.inserts["wm"])
	f := median(b.inserts["floor"])
	b.add(row{
		scenario: "insert", settings: fmt.Sprintf("producers=%d per-tx=%d, no relay running (median of %d fills)", b.o.producers, b.o.perTx, len(b.inserts["txo"])),
		txo: rate(t), wm: rate(w), ratio: faster(t, w), floor: rate(f), ofFloor: fraction(t, f),
		txoV: t, wmV: w, floorV: f,
	})
	return nil
}

// together runs the producers with the forwarders already running and
// returns delivered msgs/s over the whole run.
func (b *bench) together(ctx context.Context, kind string, cfg relayConfig, n int, latency time.Duration, paced bool) (oc outcome, err error) {
	oc.n = n
	cfg.name = b.name(kind)
	r := b.newRelay(kind, cfg)
	defer b.teardown(ctx, r)
	runCtx, cancel := context.WithTimeout(ctx, b.o.runTimeout)
	defer cancel()
	if err := r.Setup(runCtx); err != nil {
		b.failRun(kind, &oc, fmt.Errorf("set up: %w", err))
		return oc, ctx.Err()
	}
	s := b.newSink(n, latency, true)
	b.cur = s
	defer func() { b.cur = nil }()
	stop, err := r.Start(runCtx, s)
	if err != nil {
		b.failRun(kind, &oc, fmt.Errorf("start: %w", err))
		return oc, ctx.Err()
	}
	start := time.Now()
	// The first -warmup of the load is not measured: both relays start
	// cold (new connections, statements planned at their first executions).
	s.recordFrom.Store(start.Add(b.o.warmup).UnixNano())
	// The producers run while the deliveries are awaited: a relay that
	// stalls (and may block the producers with its locks) is found by
	// what it delivers, and the producers are then stopped.
	prodCtx, stopProducers := context.WithCancel(runCtx)
	defer stopProducers()
	produced := make(chan error, 1)
	go func() {
		var err error
		if paced {
			err = b.produceAt(prodCtx, r, n, b.o.rate)
		} else {
			oc.insert, err = b.produce(prodCtx, r, n, true)
		}
		produced <- err
	}()
	why := b.await(runCtx, s)
	stopProducers()
	if perr := <-produced; perr != nil && !errors.Is(perr, context.Canceled) {
		// A producer's error says more than the stall it caused.
		why = strings.TrimPrefix(why+"; ", "; ") + "failed: producers: " + perr.Error()
	}
	b.bounded(kind+" forwarders' stop", stop)
	oc.elapsed = time.Since(start)
	if at := s.doneAt.Load(); at > 0 {
		oc.rate = float64(n) / time.Unix(0, at).Sub(start).Seconds()
	}
	b.finishRun(ctx, kind, &oc, s, why)
	return oc, ctx.Err()
}

func (b *bench) steady(ctx context.Context) error {
	for _, batch := range b.o.batches {
		for _, fw := range b.o.forwarders {
			conc := b.concurrencyFor(0)
			cfg := relayConfig{batch: batch, concurrency: conc, strict: true, poll: b.o.poll, forwarders: fw}
			// With -repeat, the relays take turns and the rate and each
			// percentile are the medians of the runs, as in latency.
			var txoRuns, wmRuns []outcome
			for rep := range b.o.repeat {
				b.progress("steady txoutbox batch=%d forwarders=%d (run %d of %d)", batch, fw, rep+1, b.o.repeat)
				t, err := b.together(ctx, "txo", cfg, b.o.messages, 0, false)
				if err != nil {
					return err
				}
				txoRuns = append(txoRuns, t)
				if b.o.peer {
					b.progress("steady watermill batch=%d forwarders=%d (run %d of %d)", batch, fw, rep+1, b.o.repeat)
					w, err := b.together(ctx, "wm", cfg, b.o.messages, 0, false)
					if err != nil {
						return err
					}
					wmRuns = append(wmRuns, w)
				}
			}
			t, w := medianRuns(txoRuns), medianRuns(wmRuns)
			settings := fmt.Sprintf("batch=%d fwd=%d strict=on conc=%d", batch, fw, conc)
			b.add(row{
				scenario: "steady delivered", settings: fmt.Sprintf("%s; p99 lag txo %s, wm %s", settings, ms(t.p99), ms(w.p99)),
				txo: t.show(rate(t.rate)), wm: w.show(rate(w.rate)), ratio: faster(t.rate, w.rate), txoDL: t.dl(), wmDL: w.dl(),
				txoV: t.rate, wmV: w.rate,
			}, row{
				scenario: "steady producers", settings: settings,
				// The producers' rate stands even when the relay beside them
				// stalled: they had finished (a producer's error is the
				// delivered row's stall).
				txo: rate(t.insert), wm: rate(w.insert), ratio: faster(t.insert, w.insert),
				txoV: t.insert, wmV: w.insert,
			})
		}
	}
	return nil
}

func (b *bench) latency(ctx context.Context) error {
	n := max(int(float64(b.o.rate)*(b.o.warmup+b.o.duration).Seconds()), b.o.perTx)
	batch := b.o.batches[0]
	// txoutbox idles long between polls: the wake-ups come from NOTIFY.
	cfg := relayConfig{batch: batch, concurrency: b.concurrencyFor(0), strict: true, notify: true, poll: time.Second, forwarders: 1}
	// With -repeat, the relays take turns and each percentile is the median
	// of the runs: a single 5 s run's p99 is the 50 slowest messages, which a
	// stall of the shared machine decides.
	var txoRuns, wmRuns []outcome
	var polls []time.Duration
	for rep := range b.o.repeat {
		b.progress("latency txoutbox (LISTEN/NOTIFY, poll 1s) rate=%d/s for %s after %s warm-up (run %d of %d)", b.o.rate, b.o.duration, b.o.warmup, rep+1, b.o.repeat)
		t, err := b.together(ctx, "txo", cfg, n, 0, true)
		if err != nil {
			return err
		}
		txoRuns = append(txoRuns, t)
		var best outcome
		var bestPoll time.Duration
		for _, poll := range b.o.wmPolls {
			if !b.o.peer {
				break
			}
			wcfg := cfg
			wcfg.notify, wcfg.poll = false, poll
			b.progress("latency watermill poll=%s rate=%d/s for %s after %s warm-up (run %d of %d)", poll, b.o.rate, b.o.duration, b.o.warmup, rep+1, b.o.repeat)
			w, err := b.together(ctx, "wm", wcfg, n, 0, true)
			if err != nil {
				return err
			}
			if bestPoll == 0 || w.p99 < best.p99 {
				best, bestPoll = w, poll
			}
		}
		if bestPoll > 0 {
			wmRuns = append(wmRuns, best)
			polls = append(polls, bestPoll)
		}
	}
	t, best := medianRuns(txoRuns), medianRuns(wmRuns)
	wmPoll := "-"
	if len(polls) > 0 {
		// The best poll of each run: "1ms", or "[1ms 10ms]" when it varied.
		slices.Sort(polls)
		polls = slices.Compact(polls)
		wmPoll = fmt.Sprint(polls)
		if len(polls) == 1 {
			wmPoll = polls[0].String()
		}
	}
	settings := fmt.Sprintf("rate=%d/s batch=%d; txo NOTIFY (poll 1s), wm poll %s", b.o.rate, batch, wmPoll)
	for _, r := range txoRuns {
		b.latSamples["txoutbox"] = append(b.latSamples["txoutbox"], r.lats...)
	}
	for _, r := range wmRuns {
		b.latSamples["Watermill"] = append(b.latSamples["Watermill"], r.lats...)
	}
	b.add(
		row{scenario: "latency p50", settings: settings, txo: t.show(ms(t.p50)), wm: best.show(ms(best.p50)), ratio: speed(t.p50, best.p50), txoDL: t.dl(), wmDL: best.dl()},
		row{scenario: "latency p99", settings: settings, txo: t.show(ms(t.p99)), wm: best.show(ms(best.p99)), ratio: speed(t.p99, best.p99), txoDL: t.dl(), wmDL: best.dl()},
		// The same messages from the return of their producer's Commit: the
		// relay's part, without the producers' transactions (which differ:
		// txoutbox's table has a key index and the NOTIFY trigger).
		row{scenario: "latency relay p50", settings: settings, txo: ms(t.rp50), wm: ms(best.rp50), ratio: speed(t.rp50, best.rp50), txoDL: t.dl(), wmDL: best.dl()},
		row{scenario: "latency relay p99", settings: settings, txo: ms(t.rp99), wm: ms(best.rp99), ratio: speed(t.rp99, best.rp99), txoDL: t.dl(), wmDL: best.dl()},
	)
	return nil
}

// medianRuns returns the median rate, p50 and p99 of runs, each taken on
// its own, with the duplicates and losses of all the runs added up.
func medianRuns(all []outcome) outcome {
	var m outcome
	if len(all) == 0 {
		return m
	}
	runs := completed(all)
	p50s := make([]time.Duration, len(runs))
	p99s := make([]time.Duration, len(runs))
	rp50s := make([]time.Duration, len(runs))
	rp99s := make([]time.Duration, len(runs))
	rates := make([]float64, len(runs))
	inserts := make([]float64, len(runs))
	for i, r := range runs {
		p50s[i], p99s[i], rates[i], inserts[i] = r.p50, r.p99, r.rate, r.insert
		rp50s[i], rp99s[i] = r.rp50, r.rp99
		m.dup += r.dup
		m.lost += r.lost
		m.reorders += r.reorders
		m.n += r.n
	}
	for _, d := range [][]time.Duration{p50s, p99s, rp50s, rp99s} {
		slices.Sort(d)
	}
	slices.Sort(rates)
	m.p50, m.p99, m.rate = p50s[len(runs)/2], p99s[len(runs)/2], rates[len(runs)/2]
	m.rp50, m.rp99 = rp50s[len(runs)/2], rp99s[len(runs)/2]
	m.insert = median(inserts)
	m.dup, m.lost, m.reorders = 0, 0, 0
	for _, r := range all {
		m.dup += r.dup
		m.lost += r.lost
		m.reorders += r.reorders
	}
	m.stalledFrom(all)
	return m
}

func ms(d time.Duration) string {
	if d <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fms", float64(d)/float64(time.Millisecond))
}

// hotkey drains a backlog whose keys are hot: all on one key, then 10 keys
// carrying half the messages among -keys cold ones, with 1 ms of broker
// latency and the most -forwarders. txoutbox runs with BatchSize 1000 and a
// 2 s lease: a key's 1000 records in one batch take more than a second to
// publish one after another, so the lease is renewed while they go (a
// duplicate is a failure of the relay, not of the workload). A 500 ms lease
// was tried first: on a shared 2-core machine at load 12, PostgreSQL
// statements sometimes took longer than that, and acks landed after it.
func (b *bench) hotkey(ctx context.Context) error {
	defer func() { b.hot, b.hotKeys = nil, 0 }()
	cold := max(b.o.keys, 1)
	layouts := []struct {
		name string
		keys int
		of   func(int) int
	}{
		{"1 key", 1, func(int) int { return 0 }},
		{fmt.Sprintf("10 hot keys = 1/2 of msgs, %d cold", cold), 10 + cold, func(i int) int {
			if i%2 == 0 {
				return (i / 2) % 10
			}
			return 10 + (i/2)%cold
		}},
	}
	const latency = time.Millisecond
	fw := slices.Max(b.o.forwarders)
	cfg := relayConfig{batch: 1000, concurrency: b.concurrencyFor(latency), strict: true, poll: b.o.poll, forwarders: fw,
		lease: 2 * time.Second, publishTimeout: 500 * time.Millisecond}
	n := b.o.hotMsgs
	for _, l := range layouts {
		b.hot, b.hotKeys = l.of, l.keys
		b.progress("hotkey txoutbox %s forwarders=%d messages=%d", l.name, fw, n)
		t, err := b.drainRun(ctx, "txo", cfg, n, latency)
		if err != nil {
			return err
		}
		var w outcome
		if b.o.peer {
			b.progress("hotkey watermill %s forwarders=%d messages=%d", l.name, fw, n)
			if w, err = b.drainRun(ctx, "wm", cfg, n, latency); err != nil {
				return err
			}
		}
		if t.dup > 0 {
			b.lost = true // a duplicate here is a relay bug: fail the command
			b.progress("FAIL: txoutbox published %d duplicates with hot keys", t.dup)
		}
		b.add(row{
			scenario: "hotkey", settings: fmt.Sprintf("%s latency=%s batch=%d fwd=%d conc=%d lease=%s", l.name, latency, cfg.batch, fw, cfg.concurrency, cfg.lease),
			txo: t.show(rate(t.rate)), wm: w.show(rate(w.rate)), ratio: faster(t.rate, w.rate), txoDL: t.dl(), wmDL: w.dl(),
		})
	}
	return nil
}
