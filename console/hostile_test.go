package console

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/txoutbox/txoutbox/storage"
)

// forgedLine is a complete audit line of Watermill's StdLogger after a
// newline: what a producer's key, an operator's reason or a user name
// would write into the log if the console logged them raw.
const forgedLine = "\n[watermill] 2026/12/07 10:00:00.000000 pages.go:1: \tlevel=INFO msg=\"txoutbox console: skip\" action=skip actor=alice id=1 reason=forged "

// TestAuditLinesCannotBeForged re-drives a key and skips a record, each
// carrying a forged audit line, through a logger that writes lines as they
// come (Watermill's StdLogger): every action writes exactly one line, and
// no control character reaches the log raw.
func TestAuditLinesCannotBeForged(t *testing.T) {
	for _, sd := range seeders {
		t.Run(sd.name, func(t *testing.T) {
			key := "k" + forgedLine + "\x1b[2K\u202e"
			base, ids := sd.seed(t,
				deadRec{topic: "orders" + forgedLine, key: key, payload: "p", dead: true, err: "boom" + forgedLine},
				deadRec{topic: "t", key: "other", payload: "p", dead: true, err: "e"},
			)
			var log strings.Builder
			logger := watermill.NewStdLoggerWithOut(&log, false, false)
			h, err := New(base, Config{Authorize: AllowAll, EnableActions: true,
				Actor: func(r *http.Request) string { return r.PostFormValue("user") }}, logger)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = h.Close() }()
			b := newBrowser(t, h)
			user := "mallory" + forgedLine // what an application's Actor might return, from a user name
			token := b.token("/redrive?key=" + url.QueryEscape(key))
			if res, body := b.do("POST", "/redrive", url.Values{"key": {key}, "csrf_token": {token}, "user": {user}}, nil); res.StatusCode != http.StatusSeeOther {
				t.Fatalf("POST /redrive = %d\n%s", res.StatusCode, body)
			}
			if res, body := b.do("POST", "/skip", url.Values{"id": {fmt.Sprint(ids[1])}, "reason": {"OPS-1" + forgedLine}, "csrf_token": {token}, "user": {user}}, nil); res.StatusCode != http.StatusSeeOther {
				t.Fatalf("POST /skip = %d\n%s", res.StatusCode, body)
			}
			// A refused post logs the request's path, decoded.
			if res, _ := b.do("POST", "/redrive?x="+url.QueryEscape(forgedLine), url.Values{"key": {key}, "user": {user}}, nil); res.StatusCode != http.StatusForbidden {
				t.Fatalf("POST /redrive without a token = %d, want 403", res.StatusCode)
			}
			lines := strings.Split(strings.TrimSuffix(log.String(), "\n"), "\n")
			if len(lines) != 3 || !strings.Contains(lines[0], "re-drive") || !strings.Contains(lines[1], "skip") || !strings.Contains(lines[2], "refused") {
				t.Fatalf("log lines %q, want a re-drive, a skip and a refusal", lines)
			}
			for _, l := range lines {
				for _, r := range l {
					if r != '\t' && (!unicode.IsGraphic(r) || r == utf8.RuneError) {
						t.Errorf("log line has %U raw: %q", r, l)
					}
				}
			}
			if r, _ := base.Record(t.Context(), ids[0]); r.Status != storage.StatusPending {
				t.Fatalf("the hostile key's record is %s after its re-drive, want pending", r.Status)
			}
		})
	}
}

// TestFilterNotText: a filter value PostgreSQL and MySQL cannot compare
// with text (a NUL byte, bytes that are not UTF-8) is a bad request,
// answered 400 without reaching the storage, and logs no error.
func TestFilterNotText(t *testing.T) {
	for _, sd := range seeders {
		t.Run(sd.name, func(t *testing.T) {
			base, _ := sd.seed(t, deadRec{topic: "t", key: "k", payload: "p", dead: true, err: "e"})
			sp := &spy{Operator: base}
			logger := watermill.NewCaptureLogger()
			h, err := New(sp, Config{Authorize: AllowAll, EnableActions: true}, logger)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = h.Close() }()
			b := newBrowser(t, h)
			token := b.token("/redrive?key=k")
			before := len(sp.Calls())
			for _, p := range []string{"/dead?topic=%00", "/dead?key=%ff", "/dead?error=a%00b", "/held?after=%00", "/held?after=%c3",
				"/redrive?topic=%00", "/redrive?key=%ff%fe", "/redrive?error=%00"} {
				res, body := b.do("GET", p, nil, nil)
				if res.StatusCode != http.StatusBadRequest || !strings.Contains(body, "not text") {
					t.Errorf("GET %s = %d, want 400 saying the value is not text\n%s", p, res.StatusCode, body)
				}
			}
			for _, form := range []url.Values{{"key": {"k\x00"}}, {"topic": {"\xff"}}, {"error": {"\x00"}}} {
				form.Set("csrf_token", token)
				if res, body := b.do("POST", "/redrive", form, nil); res.StatusCode != http.StatusBadRequest {
					t.Errorf("POST /redrive %v = %d, want 400\n%s", form, res.StatusCode, body)
				}
			}
			if res, body := b.do("POST", "/skip", url.Values{"id": {"1"}, "reason": {"a\x00b"}, "csrf_token": {token}}, nil); res.StatusCode != http.StatusBadRequest {
				t.Errorf("POST /skip with a NUL in the reason = %d, want 400\n%s", res.StatusCode, body)
			}
			if errs := logger.Captured()[watermill.ErrorLogLevel]; len(errs) > 0 {
				t.Fatalf("bad filters logged errors: %+v", errs)
			}
			if calls := sp.Calls(); len(calls) != before {
				t.Fatalf("bad filters reached the storage: %v", calls[before:])
			}
		})
	}
}
