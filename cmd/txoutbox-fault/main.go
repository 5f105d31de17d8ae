// Command txoutbox-fault is the worker process of txoutbox's fault-tolerance
// suite (internal/faulttest). In forwarder mode it runs one txoutbox
// Forwarder over a PostgreSQL outbox table, woken by LISTEN/NOTIFY, and
// publishes every message as an HTTP POST to a target URL, so the suite can
// kill it, cut its database connections, restart the database under it and
// make the target fail, and then check what the target received.
//
// Usage:
//
//	txoutbox-fault forwarder -table app.outbox -channel app_outbox -worker fwd-1 -target http://127.0.0.1:8080/publish
//
// With -driver mysql it runs over a MySQL or MariaDB table instead, through
// storage/mysql; there is no LISTEN/NOTIFY there, so it polls:
//
//	txoutbox-fault forwarder -driver mysql -table outbox -worker fwd-1 -target http://127.0.0.1:8080/publish
//
// The database URL (or MySQL DSN) comes from -db or, better for a URL that
// holds a password, from the TXOUTBOX_FAULT_DB environment variable. The password is
// never written to the logs. Every connection carries the application_name
// "txoutbox-fault-<worker>". SIGTERM or SIGINT stops the forwarder gracefully
// (it finishes in-flight publishes and releases what it claimed) and the
// process exits 0; a configuration error exits 2.
package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	mysqldriver "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/faulttest"
	"github.com/txoutbox/txoutbox/storage"
	mysqlstorage "github.com/txoutbox/txoutbox/storage/mysql"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// claimLogger logs the ids of every claim, for debugging ordering.
type claimLogger struct {
	storage.Storage
	out io.Writer
}

func (c claimLogger) Claim(ctx context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	recs, _, err := c.ClaimDrained(ctx, p)
	return recs, err
}

// ClaimDrained passes the storage's drained report on (false from a
// storage that gives none), so that a forwarder paces its claims as it
// would without the log.
func (c claimLogger) ClaimDrained(ctx context.Context, p storage.ClaimParams) ([]storage.Record, bool, error) {
	start := time.Now()
	var recs []storage.Record
	var drained bool
	var err error
	if d, ok := c.Storage.(storage.DrainClaimer); ok {
		recs, drained, err = d.ClaimDrained(ctx, p)
	} else {
		recs, err = c.Storage.Claim(ctx, p)
	}
	ids := make([]string, len(recs))
	for i, r := range recs {
		ids[i] = fmt.Sprintf("%d/%s", r.ID, r.Key)
	}
	fmt.Fprintf(c.out, "claim start=%s end=%s err=%v drained=%v ids=%s\n", start.Format("15:04:05.000000"), time.Now().Format("15:04:05.000000"), err, drained, strings.Join(ids, ","))
	return recs, drained, err
}

func main() {
	os.Exit(run(os.Args[1:], os.Stderr))
}

const usage = `usage: txoutbox-fault forwarder [flags]

Runs one outbox forwarder that publishes to an HTTP target; see
"txoutbox-fault forwarder -h" for its flags.
`

func run(args []string, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "forwarder":
		return runForwarder(args[1:], stderr)
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stderr, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "txoutbox-fault: unknown mode %q\n%s", args[0], usage)
		return 2
	}
}

// forwarderFlags are the settings of forwarder mode.
type forwarderFlags struct {
	db              string
	driver          string
	table           string
	channel         string
	worker          string
	target          string
	lease           time.Duration
	publishTimeout  time.Duration
	batch           int
	concurrency     int
	maxAttempts     int
	shutdownTimeout time.Duration
	debug           bool
}

func parseForwarderFlags(args []string, stderr io.Writer) (forwarderFlags, error) {
	var c forwarderFlags
	fs := flag.NewFlagSet("txoutbox-fault forwarder", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.db, "db", os.Getenv("TXOUTBOX_FAULT_DB"), "PostgreSQL URL (default $TXOUTBOX_FAULT_DB)")
	fs.StringVar(&c.driver, "driver", "postgres", "database: postgres or mysql (MySQL and MariaDB, DSN in go-sql-driver/mysql form)")
	fs.StringVar(&c.table, "table", "outbox", "outbox table, optionally schema-qualified")
	fs.StringVar(&c.channel, "channel", "", "LISTEN/NOTIFY channel (empty: poll only)")
	fs.StringVar(&c.worker, "worker", "", "worker id (required)")
	fs.StringVar(&c.target, "target", "", "HTTP URL each message is POSTed to (required)")
	fs.DurationVar(&c.lease, "lease", 2*time.Second, "lease of claimed records")
	fs.DurationVar(&c.publishTimeout, "publish-timeout", 300*time.Millisecond, "bound of each publish")
	fs.IntVar(&c.batch, "batch", 20, "records per claim")
	fs.IntVar(&c.concurrency, "concurrency", 8, "key groups published in parallel")
	fs.IntVar(&c.maxAttempts, "max-attempts", 1000, "attempts before a record is dead-lettered")
	fs.DurationVar(&c.shutdownTimeout, "shutdown-timeout", 3*time.Second, "bound on in-flight publishes after SIGTERM")
	fs.BoolVar(&c.debug, "debug", false, "log every claim, round and failed publish")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	switch {
	case c.db == "":
		return c, errors.New("no database URL: set -db or TXOUTBOX_FAULT_DB")
	case c.worker == "":
		return c, errors.New("-worker is required")
	case c.target == "":
		return c, errors.New("-target is required")
	case c.driver != "postgres" && c.driver != "mysql":
		return c, fmt.Errorf("-driver %q: want postgres or mysql", c.driver)
	case c.driver == "mysql" && c.channel != "":
		return c, errors.New("-channel: MySQL has no LISTEN/NOTIFY")
	}
	return c, nil
}

func runForwarder(args []string, stderr io.Writer) int {
	c, err := parseForwarderFlags(args, stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		// The error is ours or the flag package's; neither quotes -db.
		fmt.Fprintf(stderr, "txoutbox-fault: %v\n", err)
		return 2
	}
	// Everything this process writes goes through the redactor, so the
	// password cannot reach the logs whatever a library puts in an error.
	out := newRedactor(stderr, secretsOf(c.db))
	level := slog.LevelInfo
	if c.debug {
		level = watermill.LevelTrace
	}
	logger := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(out, &slog.HandlerOptions{Level: level})))

	var store storage.Storage
	var listen func(ctx context.Context, wake func()) error
	var database string
	if c.driver == "mysql" {
		my, db, desc, err := openMySQL(c)
		if err != nil {
			fmt.Fprintf(out, "txoutbox-fault: %v\n", err)
			return 2
		}
		defer db.Close()
		store, database = my, desc
	} else {
		poolCfg, err := pgxpool.ParseConfig(c.db)
		if err != nil {
			fmt.Fprintf(out, "txoutbox-fault: invalid database URL: %v\n", err)
			return 2
		}
		appName := faulttest.ApplicationNamePrefix + "-" + c.worker
		poolCfg.ConnConfig.RuntimeParams["application_name"] = appName
		poolCfg.ConnConfig.ConnectTimeout = 2 * time.Second
		poolCfg.MaxConns = int32(min(c.concurrency, 4) + 1)
		poolCfg.HealthCheckPeriod = time.Second
		// NewWithConfig does not connect: a database that is down at start-up
		// (the suite restarts it) is retried by the forwarder's loop.
		pool, err := pgxpool.NewWithConfig(context.Background(), poolCfg)
		if err != nil {
			fmt.Fprintf(out, "txoutbox-fault: open pool: %v\n", err)
			return 2
		}
		defer pool.Close()
		pg, err := postgres.New(pool, postgres.Config{Table: c.table, NotifyChannel: c.channel, Logger: logger})
		if err != nil {
			fmt.Fprintf(out, "txoutbox-fault: %v\n", err)
			return 2
		}
		store, database = pg, describe(poolCfg)
		if c.channel != "" {
			listen = pg.Listen
		}
	}
	target := newHTTPPublisher(c.target, c.worker, out)
	defer target.Close()
	relay := store
	if c.debug {
		relay = claimLogger{Storage: store, out: out}
	}
	fwd, err := txoutbox.NewForwarder(relay, target, txoutbox.ForwarderConfig{
		WorkerID:           c.worker,
		BatchSize:          c.batch,
		Concurrency:        c.concurrency,
		Lease:              c.lease,
		PublishTimeout:     c.publishTimeout,
		MaxAttempts:        c.maxAttempts,
		PollMin:            10 * time.Millisecond,
		PollMax:            500 * time.Millisecond,
		StorageErrorDelay:  200 * time.Millisecond,
		ShutdownTimeout:    c.shutdownTimeout,
		BookkeepingTimeout: time.Second,
		Backoff:            txoutbox.Backoff{Base: 50 * time.Millisecond, Max: 500 * time.Millisecond},
	}, logger)
	if err != nil {
		fmt.Fprintf(out, "txoutbox-fault: %v\n", err)
		return 2
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	var wg sync.WaitGroup
	if listen != nil {
		wg.Go(func() {
			if err := listen(ctx, fwd.Wake); err != nil {
				logger.Error("Listener stopped", err, nil)
			}
		})
	}
	logger.Info("Fault worker started", watermill.LogFields{"worker": c.worker, "table": c.table, "driver": c.driver, "database": database})
	start := time.Now()
	err = fwd.Run(ctx)
	wg.Wait()
	if err != nil {
		logger.Error("Forwarder failed", err, nil)
		return 1
	}
	logger.Info("Fault worker stopped gracefully", watermill.LogFields{"worker": c.worker, "ran": time.Since(start).String()})
	return 0
}

// openMySQL opens the MySQL pool and storage. Every connection carries the
// connection attribute program_name "txoutbox-fault-<worker>".
func openMySQL(c forwarderFlags) (*mysqlstorage.Storage, *sql.DB, string, error) {
	cfg, err := mysqldriver.ParseDSN(c.db)
	if err != nil {
		return nil, nil, "", fmt.Errorf("invalid MySQL DSN: %w", err)
	}
	cfg.ConnectionAttributes = "program_name:" + faulttest.ApplicationNamePrefix + "-" + c.worker
	cfg.Timeout = 2 * time.Second
	conn, err := mysqldriver.NewConnector(cfg)
	if err != nil {
		return nil, nil, "", fmt.Errorf("invalid MySQL DSN: %w", err)
	}
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(min(c.concurrency, 4) + 1)
	db.SetConnMaxLifetime(time.Minute)
	store, err := mysqlstorage.New(db, mysqlstorage.Config{Table: c.table})
	if err != nil {
		db.Close()
		return nil, nil, "", err
	}
	return store, db, fmt.Sprintf("%s@%s/%s", cfg.User, cfg.Addr, cfg.DBName), nil
}

// describe names the database without credentials.
func describe(cfg *pgxpool.Config) string {
	cc := cfg.ConnConfig
	return fmt.Sprintf("%s@%s:%d/%s", cc.User, cc.Host, cc.Port, cc.Database)
}

// secretsOf returns the password of a database URL or key=value string in
// every form it may be printed: decoded, and URL-escaped.
func secretsOf(dsn string) []string {
	var raw []string
	if u, err := url.Parse(dsn); err == nil {
		if u.User != nil {
			if pw, ok := u.User.Password(); ok {
				raw = append(raw, pw)
			}
		}
		raw = append(raw, u.Query().Get("password"))
	}
	if cfg, err := pgxpool.ParseConfig(dsn); err == nil {
		raw = append(raw, cfg.ConnConfig.Password)
	}
	if cfg, err := mysqldriver.ParseDSN(dsn); err == nil {
		raw = append(raw, cfg.Passwd)
	}
	for _, f := range strings.Fields(dsn) {
		if v, ok := strings.CutPrefix(f, "password="); ok {
			raw = append(raw, strings.Trim(v, "'"))
		}
	}
	var out []string
	for _, s := range raw {
		if len(s) < 3 { // too short to hide without mangling the logs
			continue
		}
		out = append(out, s, url.QueryEscape(s), url.PathEscape(s), url.UserPassword("", s).String()[1:])
	}
	return out
}

// redactor writes to w with every secret replaced. Each Write is redacted on
// its own; slog writes whole lines, so a secret never spans two writes.
type redactor struct {
	mu      sync.Mutex
	w       io.Writer
	replace *strings.Replacer
}

func newRedactor(w io.Writer, secrets []string) *redactor {
	pairs := make([]string, 0, 2*len(secrets))
	for _, s := range secrets {
		pairs = append(pairs, s, "xxxxx")
	}
	return &redactor{w: w, replace: strings.NewReplacer(pairs...)}
}

func (r *redactor) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, err := io.WriteString(r.w, r.replace.Replace(string(p))); err != nil {
		return 0, err
	}
	return len(p), nil
}

// httpPublisher is a Watermill publisher that POSTs each message, as a
// faulttest.Delivery, to one URL. A 2xx answer is a successful publish; the
// message context bounds the call.
type httpPublisher struct {
	url    string
	worker string
	client *http.Client
	log    io.Writer
}

var _ message.Publisher = (*httpPublisher)(nil)

func newHTTPPublisher(url, worker string, log io.Writer) *httpPublisher {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 32
	return &httpPublisher{url: url, worker: worker, client: &http.Client{Transport: tr}, log: log}
}

func (p *httpPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		if err := p.publish(topic, msg); err != nil {
			return err
		}
	}
	return nil
}

func (p *httpPublisher) publish(topic string, msg *message.Message) error {
	var id int64
	var attempt int
	fmt.Sscan(msg.Metadata.Get(txoutbox.MetadataOutboxID), &id)
	fmt.Sscan(msg.Metadata.Get(txoutbox.MetadataAttempt), &attempt)
	body, err := json.Marshal(faulttest.Delivery{
		UUID: msg.UUID, Topic: topic, Key: msg.Metadata.Get(txoutbox.MetadataKey),
		OutboxID: id, Attempt: attempt, Worker: p.worker, Payload: msg.Payload,
	})
	if err != nil {
		return fmt.Errorf("encode delivery: %w", err)
	}
	ctx := msg.Context()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("build request: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(faulttest.HeaderWorker, p.worker)
	resp, err := p.client.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			// The request may have reached the target before the deadline:
			// a redelivery of this message is an expected duplicate.
			fmt.Fprintf(p.log, "%s uuid=%s outbox_id=%d attempt=%d at=%s\n", faulttest.LogOutcomeUnknown, msg.UUID, id, attempt, time.Now().UTC().Format(time.RFC3339Nano))
		}
		return fmt.Errorf("post to target: %w", err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("target answered %s", resp.Status)
	}
	return nil
}

func (p *httpPublisher) Close() error {
	p.client.CloseIdleConnections()
	return nil
}
