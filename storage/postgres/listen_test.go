package postgres

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// listenStore returns a storage whose notify channel, unique to the test, is
// its schema name.
func listenStore(t *testing.T, cfg Config) *Storage {
	t.Helper()
	schema := newSchema(t)
	cfg.Table = schema + ".outbox"
	cfg.NotifyChannel = schema
	s, err := New(testPool(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	must(t, s.CreateSchema(t.Context()))
	return s
}

// startListen runs Listen until the test ends and returns the wake counter.
func startListen(t *testing.T, s *Storage) *atomic.Int64 {
	t.Helper()
	var wakes atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Listen(ctx, func() { wakes.Add(1) }) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Listen returned %v after cancel, want nil", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Listen did not return after cancel")
		}
	})
	return &wakes
}

// listenerPID finds the backend of the listener on s's channel, 0 if none.
func listenerPID(t *testing.T, s *Storage) int {
	t.Helper()
	var pid int
	err := testPool(t).QueryRow(t.Context(), `SELECT pid FROM pg_stat_activity
WHERE application_name = $1 AND query = $2`, ListenApplicationName, "LISTEN "+pgx.Identifier{s.config.NotifyChannel}.Sanitize()).Scan(&pid)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0
	}
	must(t, err)
	return pid
}

func TestListenWakesOnInsert(t *testing.T) {
	t.Parallel()
	s := listenStore(t, Config{})
	wakes := startListen(t, s)
	waitFor(t, 10*time.Second, "the wake after connecting", func() bool { return wakes.Load() == 1 && listenerPID(t, s) != 0 })

	insert(t, s, recs("a")...)
	waitFor(t, 10*time.Second, "a wake after an insert", func() bool { return wakes.Load() == 2 })

	// Ten rows in one statement: one wake. (PostgreSQL folds identical
	// notifications of one transaction anyway; the trigger being per
	// statement, checked below, saves the per-row calls.)
	insert(t, s, recs("", "", "", "", "", "", "", "", "", "")...)
	waitFor(t, 10*time.Second, "a wake after a 10-row insert", func() bool { return wakes.Load() >= 3 })
	insert(t, s, recs("")...)
	waitFor(t, 10*time.Second, "the marker's wake", func() bool { return wakes.Load() >= 4 })
	if n := wakes.Load(); n != 4 {
		t.Fatalf("%d wakes, want 4: connect, 1-row insert, 10-row insert, marker", n)
	}
	var rowLevel bool
	must(t, s.pool.QueryRow(t.Context(), `SELECT tgtype & 1 = 1 FROM pg_trigger
WHERE tgrelid = $1::regclass AND NOT tgisinternal`, s.table).Scan(&rowLevel))
	if rowLevel {
		t.Fatal("the notify trigger is FOR EACH ROW, want FOR EACH STATEMENT")
	}

	// A rolled-back insert notifies nobody.
	tx, err := s.pool.Begin(t.Context())
	must(t, err)
	must(t, s.Insert(t.Context(), tx, recs("")))
	must(t, tx.Rollback(t.Context()))
	insert(t, s, recs("")...)
	waitFor(t, 10*time.Second, "the wake after the next insert", func() bool { return wakes.Load() >= 5 })
	if n := wakes.Load(); n != 5 {
		t.Fatalf("%d wakes, want 5: a rolled-back insert must not wake", n)
	}
}

func TestListenReconnects(t *testing.T) {
	t.Parallel()
	logs := &captureLogger{}
	s := listenStore(t, Config{Logger: logs})
	wakes := startListen(t, s)
	var pid int
	waitFor(t, 10*time.Second, "the listener to connect", func() bool { pid = listenerPID(t, s); return pid != 0 })

	for round := range 2 {
		before := wakes.Load()
		var killed bool
		must(t, testPool(t).QueryRow(t.Context(), "SELECT pg_terminate_backend($1)", pid).Scan(&killed))
		if !killed {
			t.Fatalf("round %d: could not terminate the listener's backend %d", round, pid)
		}
		var newPID int
		waitFor(t, 10*time.Second, "the listener to reconnect", func() bool {
			newPID = listenerPID(t, s)
			return newPID != 0 && newPID != pid
		})
		pid = newPID
		// The wake after reconnecting covers rows inserted in the gap.
		waitFor(t, 10*time.Second, "the wake after reconnecting", func() bool { return wakes.Load() > before })
		before = wakes.Load()
		insert(t, s, recs("")...)
		waitFor(t, 10*time.Second, "a wake from the new connection", func() bool { return wakes.Load() > before })
	}
	if !logs.has("error", "lost its connection") || !logs.has("info", "connected") {
		t.Fatalf("logs lack the reconnect story:\n%s", logs)
	}
	if strings.Contains(strings.ToLower(logs.String()), "password") {
		t.Fatalf("logs mention a password:\n%s", logs)
	}
}

func TestListenRetriesWhileDatabaseUnreachable(t *testing.T) {
	t.Parallel()
	logs := &captureLogger{}
	s := listenStore(t, Config{Logger: logs})
	// A pool whose configuration points to a port nobody listens on.
	cfg := s.pool.Config()
	cfg.ConnConfig.Port = 1
	cfg.ConnConfig.ConnectTimeout = time.Second
	badPool, err := pgxpoolWithConfig(t, cfg)
	must(t, err)
	bad, err := New(badPool, s.config)
	must(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- bad.Listen(ctx, func() {}) }()
	waitFor(t, 10*time.Second, "two failed attempts", func() bool { return logs.count("error") >= 2 })
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Listen returned %v after cancel", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Listen did not return after cancel")
	}
}

func TestListenNeedsChannel(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	if err := s.Listen(t.Context(), func() {}); !errors.Is(err, ErrNoNotifyChannel) {
		t.Fatalf("Listen without channel = %v, want ErrNoNotifyChannel", err)
	}
}

func TestListenDefersWakeByVisibilityDelay(t *testing.T) {
	t.Parallel()
	const delay = 300 * time.Millisecond
	s := listenStore(t, Config{VisibilityDelay: delay})
	var mu sync.Mutex
	var wakeTimes []time.Time
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- s.Listen(ctx, func() {
			mu.Lock()
			wakeTimes = append(wakeTimes, time.Now())
			mu.Unlock()
		})
	}()
	defer func() {
		cancel()
		must(t, <-done)
	}()
	n := func() int { mu.Lock(); defer mu.Unlock(); return len(wakeTimes) }
	waitFor(t, 10*time.Second, "the connect wake", func() bool { return n() == 1 && listenerPID(t, s) != 0 })
	start := time.Now()
	insert(t, s, recs("")...)
	waitFor(t, 10*time.Second, "the deferred wake", func() bool { return n() == 2 })
	mu.Lock()
	got := wakeTimes[1].Sub(start)
	mu.Unlock()
	if got < delay {
		t.Fatalf("wake %v after the insert, want at least the visibility delay %v", got, delay)
	}
	// Rows now become claimable once their visibility delay passed.
	if recs := claim(t, s, "w", 10, time.Minute); len(recs) != 1 {
		t.Fatalf("claim at the deferred wake = %d records, want 1", len(recs))
	}
}

func TestDelayedWake(t *testing.T) {
	t.Parallel()
	const delay = 50 * time.Millisecond
	var mu sync.Mutex
	var wakes []time.Time
	d := &delayedWake{delay: delay, wake: func() {
		mu.Lock()
		wakes = append(wakes, time.Now())
		mu.Unlock()
	}}
	count := func() int { mu.Lock(); defer mu.Unlock(); return len(wakes) }
	first := time.Now()
	d.notify()
	time.Sleep(20 * time.Millisecond) // spacing the notifications is the point here
	second := time.Now()
	d.notify()
	// Every notification is owed a wake no earlier than delay after it; one
	// late wake may cover both.
	waitFor(t, 5*time.Second, "a wake covering the second notification", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(wakes) > 0 && !wakes[len(wakes)-1].Before(second.Add(delay))
	})
	mu.Lock()
	if wakes[0].Before(first.Add(delay)) {
		t.Errorf("first wake %v after the notification, want at least %v", wakes[0].Sub(first), delay)
	}
	if len(wakes) > 2 {
		t.Errorf("%d wakes for 2 notifications", len(wakes))
	}
	mu.Unlock()
	n := count()
	d.notify()
	d.stop()
	time.Sleep(2 * delay) // a stopped waker must stay silent
	if count() != n {
		t.Fatalf("wakes after stop")
	}
	d.notify() // after stop: ignored, no panic
}

// captureLogger records log lines for assertions.
type captureLogger struct {
	mu    sync.Mutex
	lines []string
}

func (l *captureLogger) add(level, msg string, err error, f watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf("%s %s err=%v %v", level, msg, err, f))
}

func (l *captureLogger) Error(msg string, err error, f watermill.LogFields) {
	l.add("error", msg, err, f)
}
func (l *captureLogger) Info(msg string, f watermill.LogFields)           { l.add("info", msg, nil, f) }
func (l *captureLogger) Debug(msg string, f watermill.LogFields)          { l.add("debug", msg, nil, f) }
func (l *captureLogger) Trace(msg string, f watermill.LogFields)          { l.add("trace", msg, nil, f) }
func (l *captureLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *captureLogger) has(level, part string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, s := range l.lines {
		if strings.HasPrefix(s, level+" ") && strings.Contains(s, part) {
			return true
		}
	}
	return false
}

func (l *captureLogger) count(level string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, s := range l.lines {
		if strings.HasPrefix(s, level+" ") {
			n++
		}
	}
	return n
}

func (l *captureLogger) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

// TestListenConnectsThroughThePool: the listener's connection goes through
// the pool's BeforeConnect, here the only place that sets a user that
// exists (as IAM or rotating-password auth would set a password).
func TestListenConnectsThroughThePool(t *testing.T) {
	t.Parallel()
	base := newStore(t, Config{NotifyChannel: "hooked"})
	cfg, err := pgxpool.ParseConfig(testDatabaseURL())
	must(t, err)
	realUser := cfg.ConnConfig.User
	cfg.ConnConfig.User = "txoutbox_no_such_role"
	var hooked atomic.Int64
	cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
		hooked.Add(1)
		cc.User = realUser
		return nil
	}
	p, err := pgxpoolWithConfig(t, cfg)
	must(t, err)
	s, err := New(p, Config{Table: base.ident[0] + ".outbox", NotifyChannel: "hooked"})
	must(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	var wakes atomic.Int64
	done := make(chan error, 1)
	go func() { done <- s.Listen(ctx, func() { wakes.Add(1) }) }()
	waitFor(t, 10*time.Second, "the listener's first wake (connected)", func() bool { return wakes.Load() >= 1 })
	insert(t, base, rec("a"))
	waitFor(t, 10*time.Second, "a wake after an insert", func() bool { return wakes.Load() >= 2 })
	cancel()
	must(t, <-done)
	if hooked.Load() == 0 {
		t.Fatal("BeforeConnect never ran")
	}
}
