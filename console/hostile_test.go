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

// hostileJSON are JSON payloads whose indented form is many times their
// size: indenting grows with the nesting depth on every line.
var hostileJSON = map[string]string{
	"nested arrays":  strings.Repeat("[", 9000) + strings.Repeat("]", 9000),
	"nested objects": strings.Repeat(`{"a":`, 3000) + "1" + strings.Repeat("}", 3000),
	"wide and deep":  strings.Repeat("[", 60) + strings.Repeat("1,", 9000) + "1" + strings.Repeat("]", 60),
}

// TestPayloadViewBounded shows JSON payloads built to blow up when
// indented: the record page stays within a constant factor of the
// payload's size and shows the payload as the text it is.
func TestPayloadViewBounded(t *testing.T) {
	for name, p := range hostileJSON {
		v := viewPayload([]byte(p), PayloadLimitDefault)
		if len(v.Text) > maxIndentGrowth*len(p)+maxIndentSlack {
			t.Errorf("%s: %d-byte payload shown as %d bytes of %s", name, len(p), len(v.Text), v.Kind)
		}
		if v.Kind != "text" || v.Text != p {
			t.Errorf("%s: shown as %s, want the payload as text", name, v.Kind)
		}
	}
	// Moderately nested JSON is still indented.
	ordinary := `{"order":{"lines":[{"sku":"a","qty":1},{"sku":"b","qty":2}],"customer":{"id":7}}}`
	if v := viewPayload([]byte(ordinary), PayloadLimitDefault); v.Kind != "json" || !strings.Contains(v.Text, "\n      {\n        \"sku\": \"a\",") {
		t.Errorf("ordinary JSON shown as %s:\n%s", v.Kind, v.Text)
	}
	for _, sd := range seeders {
		t.Run(sd.name, func(t *testing.T) {
			var recs []deadRec
			for _, p := range hostileJSON {
				recs = append(recs, deadRec{topic: "t", payload: p, dead: true, err: "e"})
			}
			base, ids := sd.seed(t, recs...)
			h := newHandler(t, base, Config{})
			for i, id := range ids {
				res, body := get(t, h, "GET", fmt.Sprintf("/records/%d", id))
				// HTML escaping writes a quote as 5 bytes; the page around it is a few KiB.
				if p := recs[i].payload; res.StatusCode != 200 || len(body) > 5*len(p)+64<<10 {
					t.Errorf("GET /records/%d of a %d-byte payload: %d, %d bytes", id, len(p), res.StatusCode, len(body))
				}
			}
		})
	}
}
