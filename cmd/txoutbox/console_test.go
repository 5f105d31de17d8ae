package main

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/postgres"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// consoleBuffer is a bytes.Buffer safe to read while the command writes.
type consoleBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *consoleBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *consoleBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// consoleDB makes a migrated outbox (SQLite, PostgreSQL in a schema of its
// own, or a MySQL table of its own) with one dead record (key k, holding one
// more record) and returns its URL and table.
func consoleDB(t *testing.T, kind string) (string, string) {
	t.Helper()
	return consoleDBWithKey(t, kind, "k")
}

// consoleDBWithKey is consoleDB with the records' key chosen.
func consoleDBWithKey(t *testing.T, kind, key string) (string, string) {
	t.Helper()
	var f fixture
	switch kind {
	case "mysql":
		f = openMySQLFixture(t)
	case "postgres":
		url, _ := pgSchemaURL(t)
		pool := pgPool(t, url)
		s, err := postgres.New(pool, postgres.Config{HoldOnDeadLetter: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		f = fixture{url: url, s: s, begin: func(t *testing.T) (any, func() error) {
			tx, err := pool.Begin(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			return tx, func() error { return tx.Commit(context.Background()) }
		}}
	default:
		path := filepath.Join(t.TempDir(), "console.db")
		db, err := sqlite.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		s, err := sqlite.New(db, sqlite.Config{HoldOnDeadLetter: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		f = fixture{url: "sqlite://" + path, s: s, begin: func(t *testing.T) (any, func() error) {
			tx, err := db.Begin()
			if err != nil {
				t.Fatal(err)
			}
			return tx, tx.Commit
		}}
	}
	s := f.s
	ctx := context.Background()
	tx, commit := f.begin(t)
	if err := s.Insert(ctx, tx, []storage.Record{
		{UUID: "u1", Topic: "orders", Key: key, Payload: []byte(`{"poison":"<script>x</script>"}`)},
		{UUID: "u2", Topic: "orders", Key: key, Payload: []byte("behind")},
	}); err != nil {
		t.Fatal(err)
	}
	if err := commit(); err != nil {
		t.Fatal(err)
	}
	recs, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 10, Lease: time.Minute, WorkerID: "w"})
	if err != nil || len(recs) != 2 {
		t.Fatalf("claim = %d records, %v", len(recs), err)
	}
	if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: recs[0].Ref(), WorkerID: "w", Error: "broker said no"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, storage.ReleaseParams{Records: []storage.ClaimRef{recs[1].Ref()}, WorkerID: "w", RetryAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	return f.url, cmp.Or(f.table, "outbox")
}

// startConsole runs `txoutbox console` in-process and returns its base URL
// and a stop function that returns the exit code.
func startConsole(t *testing.T, dbURL string, args ...string) (base string, stderr *consoleBuffer, stop func() int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stdout, stderr := &consoleBuffer{}, &consoleBuffer{}
	done := make(chan int, 1)
	getenv := func(k string) string {
		if k == envDatabaseURL {
			return dbURL
		}
		return ""
	}
	go func() {
		done <- run(ctx, append([]string{"console", "--listen", "127.0.0.1:0"}, args...), stdout, stderr, getenv)
	}()
	re := regexp.MustCompile(`serving (http://\S+?)/ `)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if m := re.FindStringSubmatch(stdout.String()); m != nil {
			base = m[1]
			break
		}
		select {
		case code := <-done:
			cancel()
			t.Fatalf("txoutbox console exited with %d before serving\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
		default:
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("txoutbox console did not serve within 30s\nstdout:\n%s\nstderr:\n%s", stdout, stderr)
		}
		time.Sleep(20 * time.Millisecond)
	}
	var once sync.Once
	code := -1
	stop = func() int {
		once.Do(func() {
			cancel()
			select {
			case code = <-done:
			case <-time.After(30 * time.Second):
				t.Fatal("txoutbox console did not stop within 30s of the interrupt")
			}
		})
		return code
	}
	t.Cleanup(func() { stop() })
	return base, stderr, stop
}

func consoleGet(t *testing.T, c *http.Client, u string) (int, string) {
	t.Helper()
	res, err := c.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = res.Body.Close() }()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

func TestConsoleCommand(t *testing.T) {
	for _, kind := range []string{"sqlite", "postgres", "mysql"} {
		t.Run(kind, func(t *testing.T) { testConsoleCommand(t, kind) })
	}
}

func testConsoleCommand(t *testing.T, kind string) {
	dbURL, table := consoleDB(t, kind)
	base, stderr, stop := startConsole(t, dbURL, "--actions", "--hold-on-dead-letter", "--prefix", "/outbox", "--table", table)
	if !strings.HasSuffix(base, "/outbox") {
		t.Fatalf("served at %s, want the /outbox prefix", base)
	}
	c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	if code, body := consoleGet(t, c, base+"/"); code != 200 || !strings.Contains(body, "txoutbox: "+table) || !strings.Contains(body, "actions on") {
		t.Fatalf("GET / = %d\n%s", code, body)
	}
	code, body := consoleGet(t, c, base+"/held")
	if code != 200 || !strings.Contains(body, `href="./records/1"`) || !strings.Contains(body, "until re-driven or skipped") {
		t.Fatalf("GET /held = %d, want key k held by dead record 1\n%s", code, body)
	}
	if code, body := consoleGet(t, c, base+"/records/1"); code != 200 || strings.Contains(body, "<script>x") {
		t.Fatalf("GET /records/1 = %d, or the payload is not escaped\n%s", code, body)
	}
	// An action without its token is refused; with it, the key is re-driven.
	res, err := c.PostForm(base+"/redrive", url.Values{"key": {"k"}})
	if err != nil {
		t.Fatal(err)
	}
	_ = res.Body.Close()
	if res.StatusCode != http.StatusForbidden {
		t.Fatalf("POST /redrive without a token = %d, want 403", res.StatusCode)
	}
	confirm, err := c.Get(base + "/redrive?key=k")
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(confirm.Body)
	_ = confirm.Body.Close()
	m := regexp.MustCompile(`name="csrf_token" value="([^"]+)"`).FindSubmatch(page)
	if m == nil || len(confirm.Cookies()) == 0 {
		t.Fatalf("confirmation page without a token or cookie:\n%s", page)
	}
	req, _ := http.NewRequest("POST", base+"/redrive", strings.NewReader(url.Values{"key": {"k"}, "csrf_token": {string(m[1])}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.AddCookie(confirm.Cookies()[0])
	res, err = c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = res.Body.Close()
	if res.StatusCode != http.StatusSeeOther {
		t.Fatalf("POST /redrive with its token = %d, want 303", res.StatusCode)
	}
	if code := stop(); code != exitOK {
		t.Fatalf("console exited with %d after the interrupt, want 0", code)
	}
	if !strings.Contains(stderr.String(), "txoutbox console: re-drive") || !strings.Contains(stderr.String(), "key=k") {
		t.Fatalf("no audit line on stderr:\n%s", stderr)
	}
	r := run(context.Background(), []string{"dead", "list", "--json", "--table", table}, io.Discard, io.Discard, func(k string) string {
		if k == envDatabaseURL {
			return dbURL
		}
		return ""
	})
	if r != exitOK {
		t.Fatalf("dead list after the console = exit %d", r)
	}
}

func TestConsoleCommandRefusesOtherHostsWithoutPassword(t *testing.T) {
	var stderr bytes.Buffer
	code := run(context.Background(), []string{"console", "--listen", "0.0.0.0:0"}, io.Discard, &stderr, func(k string) string {
		if k == envDatabaseURL {
			return "sqlite:///nonexistent.db"
		}
		return ""
	})
	if code != exitUsage || !strings.Contains(stderr.String(), envConsolePassword) {
		t.Fatalf("console --listen 0.0.0.0:0 without a password = exit %d, want %d naming %s\n%s", code, exitUsage, envConsolePassword, stderr.String())
	}
}

func TestConsoleCommandBasicAuth(t *testing.T) {
	t.Setenv(envConsolePassword, "s3cret-pass")
	dbURL, _ := consoleDB(t, "sqlite")
	base, _, _ := startConsole(t, dbURL)
	c := &http.Client{}
	res, err := c.Get(base + "/")
	if err != nil {
		t.Fatal(err)
	}
	_ = res.Body.Close()
	if res.StatusCode != http.StatusUnauthorized || !strings.HasPrefix(res.Header.Get("WWW-Authenticate"), "Basic ") {
		t.Fatalf("GET / without the password = %d %q, want 401 with a Basic challenge", res.StatusCode, res.Header.Get("WWW-Authenticate"))
	}
	for pass, want := range map[string]int{"wrong": http.StatusUnauthorized, "s3cret-pass": http.StatusOK} {
		req, _ := http.NewRequest("GET", base+"/dead", nil)
		req.SetBasicAuth("ops", pass)
		res, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = res.Body.Close()
		if res.StatusCode != want {
			t.Errorf("GET /dead with password %q = %d, want %d", pass, res.StatusCode, want)
		}
	}
}

func TestConsoleLoopbackOnly(t *testing.T) {
	for addr, want := range map[string]bool{"127.0.0.1:1": true, "[::1]:1": true, "localhost:1": true, "0.0.0.0:1": false, ":8080": false, "10.0.0.1:1": false} {
		if got := loopbackAddr(addr); got != want {
			t.Errorf("loopbackAddr(%q) = %v, want %v", addr, got, want)
		}
	}
	for remote, want := range map[string]bool{"127.0.0.1:5555": true, "[::1]:5555": true, "192.168.1.4:5555": false, "garbage": false} {
		if got := loopbackClient(&http.Request{RemoteAddr: remote}); got != want {
			t.Errorf("loopbackClient(%q) = %v, want %v", remote, got, want)
		}
	}
}

// secretOperator fails Record with an error that carries the password, as a driver's
// connection error might.
type secretOperator struct{ storage.Operator }

func (secretOperator) Record(context.Context, int64) (storage.RecordInfo, error) {
	return storage.RecordInfo{}, fmt.Errorf("dial postgres://app:hunter2-pw@db:5432/app: %w", storage.ErrRecordNotFound)
}

func TestConsoleRedactsStorageErrors(t *testing.T) {
	op := redactingOperator{secretOperator{}}
	_, err := op.Record(context.Background(), 1)
	if strings.Contains(err.Error(), "hunter2-pw") || !errors.Is(err, storage.ErrRecordNotFound) {
		t.Fatalf("error %q: want the password redacted and ErrRecordNotFound kept", err)
	}
}
