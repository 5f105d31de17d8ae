package main

import (
	"context"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// hostileRequest sends a request to the console at base as a page of
// another site would after rebinding its own name to 127.0.0.1: the
// connection goes to the console, Host and Origin name the attacker's site.
func hostileRequest(t *testing.T, method, base, path, host string, form url.Values, cookies []*http.Cookie) (*http.Response, string) {
	t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, base+path, body)
	if err != nil {
		t.Fatal(err)
	}
	if host != "" {
		req.Host = host
		req.Header.Set("Origin", "http://"+host)
		req.Header.Set("Sec-Fetch-Site", "same-origin") // it is, for the browser: the page's own name
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for _, c := range cookies {
		req.AddCookie(c)
	}
	c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	res, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = res.Body.Close() }()
	b, _ := io.ReadAll(res.Body)
	return res, string(b)
}

// cut shortens a page for a failure message.
func cut(s string) string {
	if len(s) > 400 {
		return s[:400] + "..."
	}
	return s
}

// TestConsoleRefusesReboundHost replays the DNS rebinding attack on a
// password-less console: read a record, open the re-drive confirmation,
// post it back. Every step must be refused and nothing re-driven, while
// the loopback names (and an SSH tunnel's other local port) still work.
func TestConsoleRefusesReboundHost(t *testing.T) {
	for _, kind := range []string{"sqlite", "postgres", "mysql"} {
		t.Run(kind, func(t *testing.T) {
			dbURL, table := consoleDB(t, kind)
			base, _, _ := startConsole(t, dbURL, "--actions", "--hold-on-dead-letter", "--table", table)
			port := base[strings.LastIndex(base, ":")+1:]
			evil := "rebind.attacker.example:" + port

			// 1. Read a record, payload included.
			res, body := hostileRequest(t, "GET", base, "/records/1", evil, nil, nil)
			if res.StatusCode != http.StatusForbidden && res.StatusCode != http.StatusMisdirectedRequest {
				t.Fatalf("GET /records/1 with Host %s = %d, want 403 or 421\n%s", evil, res.StatusCode, cut(body))
			}
			if strings.Contains(body, "poison") || strings.Contains(body, "broker said no") {
				t.Fatalf("the refused page shows the record:\n%s", body)
			}
			// 2. The confirmation page, for its cookie and token.
			res, body = hostileRequest(t, "GET", base, "/redrive?all=1", evil, nil, nil)
			if res.StatusCode < 400 || strings.Contains(body, "csrf_token") || len(res.Cookies()) > 0 {
				t.Fatalf("GET /redrive?all=1 with Host %s = %d, cookies %v: want refused, no token, no cookie\n%s", evil, res.StatusCode, res.Cookies(), cut(body))
			}
			// 3. The post, even with a token and cookie of a real session.
			res, body = hostileRequest(t, "GET", base, "/redrive?all=1", "", nil, nil)
			m := tokenField.FindStringSubmatch(body)
			if res.StatusCode != 200 || m == nil {
				t.Fatalf("GET /redrive?all=1 from 127.0.0.1 = %d, want its form\n%s", res.StatusCode, cut(body))
			}
			res, body = hostileRequest(t, "POST", base, "/redrive", evil, url.Values{"all": {"1"}, "csrf_token": {m[1]}}, res.Cookies())
			if res.StatusCode != http.StatusForbidden && res.StatusCode != http.StatusMisdirectedRequest {
				t.Fatalf("POST /redrive with Host %s = %d, want 403 or 421\n%s", evil, res.StatusCode, cut(body))
			}
			if n := deadCount(t, dbURL, table); n != 1 {
				t.Fatalf("%d dead records after the refused re-drive, want 1", n)
			}

			// Hosts that are not this machine's loopback names are refused;
			// the loopback names are served, on any port (an SSH tunnel's
			// local port may differ from --listen's).
			for host, ok := range map[string]bool{
				"127.0.0.1:" + port: true, "localhost:" + port: true, "LOCALHOST:" + port: true, "[::1]:" + port: true,
				"127.0.0.1": true, "localhost": true, "localhost:9999": true, "127.0.0.2:" + port: true,
				"localhost.attacker.example:" + port: false, "127.0.0.1.nip.io:" + port: false, "attacker.localhost.example": false,
				"0.0.0.0:" + port: false, "10.0.0.1:" + port: false, "[::ffff:7f00:1]:" + port: true, "localhost.:" + port: false,
			} {
				req, _ := http.NewRequest("GET", base+"/", nil)
				req.Host = host
				res, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				_ = res.Body.Close()
				if got := res.StatusCode == http.StatusOK; got != ok {
					t.Errorf("GET / with Host %q = %d, want served %v", host, res.StatusCode, ok)
				}
			}
		})
	}
}

// TestConsoleRefusesProxiedRequestsWithoutPassword: a reverse proxy on the
// same host makes every client look like 127.0.0.1. A password-less
// console refuses any request that says it was forwarded.
func TestConsoleRefusesProxiedRequestsWithoutPassword(t *testing.T) {
	dbURL, _ := consoleDB(t, "sqlite")
	base, _, _ := startConsole(t, dbURL)
	for _, h := range []string{"X-Forwarded-For", "Forwarded", "X-Real-Ip", "X-Forwarded-Host", "Via"} {
		req, _ := http.NewRequest("GET", base+"/", nil)
		req.Header.Set(h, "203.0.113.9")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(res.Body)
		_ = res.Body.Close()
		if res.StatusCode != http.StatusForbidden || !strings.Contains(string(b), envConsolePassword) {
			t.Errorf("GET / with %s = %d, want 403 naming %s\n%s", h, res.StatusCode, envConsolePassword, b)
		}
	}
}

// TestConsoleWithPasswordServesAnyHost: behind a password the console may
// be reached under any name (a proxy, a load balancer).
func TestConsoleWithPasswordServesAnyHost(t *testing.T) {
	t.Setenv(envConsolePassword, "s3cret-pass")
	dbURL, _ := consoleDB(t, "sqlite")
	base, _, _ := startConsole(t, dbURL)
	req, _ := http.NewRequest("GET", base+"/", nil)
	req.Host = "outbox.internal.example"
	req.Header.Set("X-Forwarded-For", "203.0.113.9")
	req.SetBasicAuth("ops", "s3cret-pass")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Fatalf("GET / with a password, another Host and X-Forwarded-For = %d, want 200", res.StatusCode)
	}
}

func deadCount(t *testing.T, dbURL, table string) int64 {
	t.Helper()
	o := options{url: dbURL, table: table}
	b, err := open(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.close() }()
	st, err := b.op.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return st.Dead
}

var tokenField = regexp.MustCompile(`name="csrf_token" value="([^"]+)"`)

// TestConsoleAuditLinesCannotBeForged re-drives a key, and skips a record
// with a reason, each holding a complete audit line after a newline, as a
// basic-auth user whose name holds one too: stderr gets exactly one line
// per action, and no forged one.
func TestConsoleAuditLinesCannotBeForged(t *testing.T) {
	forged := "\n[watermill] 2026/12/07 10:00:00.000000 console.go:1: \tlevel=INFO msg=\"txoutbox console: skip\" action=skip actor=alice id=1 reason=forged "
	for _, kind := range []string{"sqlite", "postgres", "mysql"} {
		t.Run(kind, func(t *testing.T) {
			t.Setenv(envConsolePassword, "s3cret-pass")
			dbURL, table := consoleDBWithKey(t, kind, "k"+forged+"key=")
			base, stderr, stop := startConsole(t, dbURL, "--actions", "--table", table)
			user := "mallory" + strings.ReplaceAll(forged, ":", ".") + "actor=" // a user name holds no colon
			do := func(method, path string, form url.Values, cookies []*http.Cookie) (*http.Response, string) {
				t.Helper()
				var body io.Reader
				if form != nil {
					body = strings.NewReader(form.Encode())
				}
				req, _ := http.NewRequest(method, base+path, body)
				req.SetBasicAuth(user, "s3cret-pass")
				if form != nil {
					req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
				}
				for _, c := range cookies {
					req.AddCookie(c)
				}
				c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
				res, err := c.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = res.Body.Close() }()
				b, _ := io.ReadAll(res.Body)
				return res, string(b)
			}
			key := "k" + forged + "key="
			res, body := do("GET", "/redrive?key="+url.QueryEscape(key), nil, nil)
			m := tokenField.FindStringSubmatch(body)
			if res.StatusCode != 200 || m == nil {
				t.Fatalf("GET /redrive?key=... = %d\n%s", res.StatusCode, cut(body))
			}
			cookies := res.Cookies()
			if res, body = do("POST", "/redrive", url.Values{"key": {key}, "csrf_token": {m[1]}}, cookies); res.StatusCode != http.StatusSeeOther {
				t.Fatalf("POST /redrive = %d\n%s", res.StatusCode, cut(body))
			}
			// Dead again, then skipped with a hostile reason.
			if n := deadCount(t, dbURL, table); n != 0 {
				t.Fatalf("%d dead after the re-drive, want 0", n)
			}
			redead(t, dbURL, table)
			if res, body = do("POST", "/skip", url.Values{"id": {"1"}, "reason": {"OPS-1" + forged + "reason="}, "csrf_token": {m[1]}}, cookies); res.StatusCode != http.StatusSeeOther {
				t.Fatalf("POST /skip = %d\n%s", res.StatusCode, cut(body))
			}
			stop()
			var audit []string
			for _, l := range strings.Split(stderr.String(), "\n") {
				if strings.Contains(l, "txoutbox console:") {
					audit = append(audit, l)
				}
				if strings.Contains(l, "actor=alice") && !strings.Contains(l, "mallory") {
					t.Errorf("a forged audit line: %q", l)
				}
			}
			if len(audit) != 2 || !strings.Contains(audit[0], "re-drive") || !strings.Contains(audit[1], "skip") {
				t.Fatalf("audit lines %q, want one re-drive and one skip\nstderr:\n%s", audit, stderr)
			}
			if c, bad := terminalUnsafe(stderr.String()); bad {
				t.Errorf("stderr has %U raw", c)
			}
		})
	}
}

// redead dead-letters record 1 again, through the storage.
func redead(t *testing.T, dbURL, table string) {
	t.Helper()
	b, err := open(context.Background(), options{url: dbURL, table: table, hold: true})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.close() }()
	s, ok := b.op.(redactingOperator).Operator.(storage.Storage)
	if !ok {
		t.Fatalf("%T is not a storage.Storage", b.op)
	}
	ctx := context.Background()
	recs, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 1, Lease: time.Minute, WorkerID: "w2"})
	if err != nil || len(recs) != 1 || recs[0].ID != 1 {
		t.Fatalf("claim = %v, %v; want record 1", recs, err)
	}
	if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: recs[0].Ref(), WorkerID: "w2", Error: "again"}); err != nil {
		t.Fatal(err)
	}
}
