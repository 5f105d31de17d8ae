package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/txoutbox/txoutbox/storage"
)

func TestNewValidates(t *testing.T) {
	s, _ := seed(t)
	for _, tc := range []struct {
		name string
		c    Config
		want string
	}{
		{"no authorize", Config{}, "Config.Authorize is nil"},
		{"prefix without slash", Config{Authorize: AllowAll, Prefix: "admin"}, "Config.Prefix"},
		{"prefix with trailing slash", Config{Authorize: AllowAll, Prefix: "/admin/"}, "Config.Prefix"},
		{"prefix with a wildcard", Config{Authorize: AllowAll, Prefix: "/{x}"}, "Config.Prefix"},
		{"short csrf key", Config{Authorize: AllowAll, CSRFKey: []byte("short")}, "Config.CSRFKey"},
		{"page size", Config{Authorize: AllowAll, PageSize: MaxPageSize + 1}, "Config.PageSize"},
		{"sample interval", Config{Authorize: AllowAll, SampleInterval: time.Millisecond}, "Config.SampleInterval"},
		{"trusted origin", Config{Authorize: AllowAll, TrustedOrigins: []string{"not an origin"}}, "Config.TrustedOrigins"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(s, tc.c, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New(%+v) = %v, want an error naming %s", tc.c, err, tc.want)
			}
		})
	}
	if _, err := New(nil, Config{Authorize: AllowAll}, nil); err == nil {
		t.Fatal("New(nil store) succeeded")
	}
}

// TestPages checks the status code, content type and security headers of
// every page, under a prefix.
func TestPages(t *testing.T) {
	for _, sd := range seeders {
		t.Run(sd.name, func(t *testing.T) {
			s, ids := sd.seed(t,
				deadRec{topic: "orders", key: "k1", payload: `{"a":1}`, dead: true, err: "boom"},
				deadRec{topic: "orders", key: "k1", payload: "behind"},
			)
			for _, actions := range []bool{false, true} {
				h := newHandler(t, s, Config{Prefix: "/admin/outbox", EnableActions: actions})
				for _, tc := range []struct {
					method, path string
					status       int
					ctype        string
				}{
					{"GET", "/admin/outbox/", 200, "text/html"},
					{"GET", "/admin/outbox", 301, ""},
					{"GET", "/admin/outbox/live", 200, "text/html"},
					{"GET", "/admin/outbox/held", 200, "text/html"},
					{"GET", "/admin/outbox/held?limit=1&after=a", 200, "text/html"},
					{"GET", "/admin/outbox/dead", 200, "text/html"},
					{"GET", "/admin/outbox/dead?topic=orders&key=k1&error=bo&limit=5&after=0", 200, "text/html"},
					{"GET", fmt.Sprintf("/admin/outbox/records/%d", ids[0]), 200, "text/html"},
					{"GET", fmt.Sprintf("/admin/outbox/records/%d", ids[1]), 200, "text/html"},
					{"GET", fmt.Sprintf("/admin/outbox/records/%d/payload", ids[0]), 200, "application/octet-stream"},
					{"GET", "/admin/outbox/records/999", 404, "text/html"},
					{"GET", "/admin/outbox/records/abc", 404, "text/html"},
					{"GET", "/admin/outbox/records/-1", 404, "text/html"},
					{"GET", "/admin/outbox/static/console.js", 200, "text/javascript"},
					{"GET", "/admin/outbox/static/console.css", 200, "text/css"},
					{"GET", "/admin/outbox/static/missing.js", 404, ""},
					{"GET", "/admin/outbox/nope", 404, ""},
					{"GET", "/elsewhere/", 404, ""},
					{"DELETE", "/admin/outbox/dead", 405, ""},
					{"POST", "/admin/outbox/dead", 405, ""},
				} {
					res, body := get(t, h, tc.method, tc.path)
					if res.StatusCode != tc.status {
						t.Errorf("actions=%v %s %s = %d, want %d\n%s", actions, tc.method, tc.path, res.StatusCode, tc.status, body)
						continue
					}
					if tc.ctype != "" && !strings.HasPrefix(res.Header.Get("Content-Type"), tc.ctype) {
						t.Errorf("%s %s: Content-Type %q, want %s", tc.method, tc.path, res.Header.Get("Content-Type"), tc.ctype)
					}
					csp := res.Header.Get("Content-Security-Policy")
					for _, want := range []string{"default-src 'self'", "script-src 'self'", "frame-ancestors 'none'"} {
						if !strings.Contains(csp, want) {
							t.Errorf("%s %s: CSP %q lacks %s", tc.method, tc.path, csp, want)
						}
					}
					if res.Header.Get("X-Content-Type-Options") != "nosniff" {
						t.Errorf("%s %s: no X-Content-Type-Options: nosniff", tc.method, tc.path)
					}
					if strings.Contains(body, "<script>") || regexp.MustCompile(`<script[^>]*>[^<]`).MatchString(body) {
						t.Errorf("%s %s: inline script in the page", tc.method, tc.path)
					}
				}
			}
		})
	}
}

func TestAuthorizeRefusesBeforeAnyStorageCall(t *testing.T) {
	base, ids := seed(t, deadRec{topic: "t", key: "k", payload: "p", dead: true, err: "e"})
	sp := &spy{Operator: base}
	var asked atomic.Int32
	h := newHandler(t, sp, Config{EnableActions: true, Authorize: func(r *http.Request) bool {
		asked.Add(1)
		return r.Header.Get("X-Admin") == "yes"
	}})
	b := newBrowser(t, h)
	paths := []string{"/", "/live", "/held", "/dead", fmt.Sprintf("/records/%d", ids[0]), fmt.Sprintf("/records/%d/payload", ids[0]),
		fmt.Sprintf("/redrive?id=%d", ids[0]), fmt.Sprintf("/skip?id=%d", ids[0]), "/static/console.js"}
	for _, p := range paths {
		if res, body := b.do("GET", p, nil, nil); res.StatusCode != http.StatusForbidden {
			t.Errorf("GET %s without authorisation = %d, want 403\n%s", p, res.StatusCode, body)
		}
	}
	for _, p := range []string{"/redrive", "/skip"} {
		if res, _ := b.do("POST", p, url.Values{"id": {fmt.Sprint(ids[0])}, "reason": {"x"}}, nil); res.StatusCode != http.StatusForbidden {
			t.Errorf("POST %s without authorisation = %d, want 403", p, res.StatusCode)
		}
	}
	if calls := sp.Calls(); len(calls) != 0 {
		t.Fatalf("refused requests reached the storage: %v", calls)
	}
	if asked.Load() == 0 {
		t.Fatal("Authorize was never asked")
	}
	time.Sleep(50 * time.Millisecond) // a sampler (wrongly) started would call Stats by now
	if calls := sp.Calls(); len(calls) != 0 || h.sampler.isRunning() {
		t.Fatalf("refused requests started the sampler: %v", calls)
	}
	if res, _ := b.do("GET", "/dead", nil, map[string]string{"X-Admin": "yes"}); res.StatusCode != http.StatusOK {
		t.Fatalf("authorised GET /dead = %d, want 200", res.StatusCode)
	}
}

func TestReadOnly(t *testing.T) {
	base, ids := seed(t,
		deadRec{topic: "t", key: "k", payload: "p", dead: true, err: "e"},
		deadRec{topic: "t", key: "k", payload: "behind"},
	)
	sp := &spy{Operator: base}
	h := newHandler(t, sp, Config{}) // actions off by default
	b := newBrowser(t, h)
	for _, p := range []string{"/", "/held", "/dead", fmt.Sprintf("/records/%d", ids[0])} {
		res, body := b.do("GET", p, nil, nil)
		if res.StatusCode != 200 {
			t.Fatalf("GET %s = %d", p, res.StatusCode)
		}
		for _, bad := range []string{"/redrive", "/skip", `method="post"`, "csrf_token", "Re-drive", "Skip"} {
			if strings.Contains(body, bad) {
				t.Errorf("read-only GET %s renders %q", p, bad)
			}
		}
		if !strings.Contains(body, "read-only") {
			t.Errorf("read-only GET %s does not say read-only", p)
		}
		if res.Header.Get("Set-Cookie") != "" {
			t.Errorf("read-only GET %s sets a cookie", p)
		}
	}
	for _, tc := range []struct {
		method, path string
		status       int
	}{
		{"GET", fmt.Sprintf("/redrive?id=%d", ids[0]), 403},
		{"GET", fmt.Sprintf("/skip?id=%d", ids[0]), 403},
		{"POST", "/redrive", 403},
		{"POST", "/skip", 403},
		{"PUT", "/redrive", 405},
		{"DELETE", "/skip", 405},
	} {
		res, _ := b.do(tc.method, tc.path, url.Values{"id": {fmt.Sprint(ids[0])}, "reason": {"r"}}, nil)
		if res.StatusCode != tc.status {
			t.Errorf("read-only %s %s = %d, want %d", tc.method, tc.path, res.StatusCode, tc.status)
		}
	}
	if slices.Contains(sp.Calls(), "Redrive") || slices.Contains(sp.Calls(), "Skip") {
		t.Fatalf("read-only console changed the storage: %v", sp.Calls())
	}
	if r, _ := base.Record(context.Background(), ids[0]); r.Status != storage.StatusDead {
		t.Fatalf("record %d is %s after read-only requests, want dead", ids[0], r.Status)
	}
}

func TestCSRF(t *testing.T) {
	base, ids := seed(t, deadRec{topic: "t", key: "k", payload: "p", dead: true, err: "e"})
	sp := &spy{Operator: base}
	h := newHandler(t, sp, Config{EnableActions: true})
	b := newBrowser(t, h)
	id := fmt.Sprint(ids[0])
	token := b.token("/redrive?id=" + id)

	other := newBrowser(t, h) // another session, with its own cookie and token
	otherToken := other.token("/redrive?id=" + id)

	for _, tc := range []struct {
		name   string
		b      *browser
		form   url.Values
		header map[string]string
	}{
		{"no token", b, url.Values{"id": {id}}, nil},
		{"empty token", b, url.Values{"id": {id}, "csrf_token": {""}}, nil},
		{"wrong token", b, url.Values{"id": {id}, "csrf_token": {strings.Repeat("A", len(token))}}, nil},
		{"another session's token", b, url.Values{"id": {id}, "csrf_token": {otherToken}}, nil},
		{"token without its cookie", newBrowser(t, h), url.Values{"id": {id}, "csrf_token": {token}}, nil},
		{"cross-site (Sec-Fetch-Site)", b, url.Values{"id": {id}, "csrf_token": {token}}, map[string]string{"Sec-Fetch-Site": "cross-site"}},
		{"cross-origin (Origin)", b, url.Values{"id": {id}, "csrf_token": {token}}, map[string]string{"Origin": "https://evil.example"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tb := tc.b
			if tb.srv != b.srv && tc.name == "token without its cookie" {
				tb = &browser{t: t, srv: b.srv, client: tc.b.client} // same server, empty jar
			}
			res, body := tb.do("POST", "/redrive", tc.form, tc.header)
			if res.StatusCode != http.StatusForbidden {
				t.Fatalf("POST /redrive with %s = %d, want 403\n%s", tc.name, res.StatusCode, body)
			}
		})
	}
	if slices.Contains(sp.Calls(), "Redrive") {
		t.Fatalf("a refused POST reached Redrive: %v", sp.Calls())
	}
	// The same form, same-origin, with its token: accepted.
	res, body := b.do("POST", "/redrive", url.Values{"id": {id}, "csrf_token": {token}},
		map[string]string{"Sec-Fetch-Site": "same-origin", "Origin": b.srv.URL})
	if res.StatusCode != http.StatusSeeOther || res.Header.Get("Location") != "./records/"+id+"?redriven=1" {
		t.Fatalf("POST /redrive with its token = %d Location %q, want 303 to the record\n%s", res.StatusCode, res.Header.Get("Location"), body)
	}
	if r, _ := base.Record(context.Background(), ids[0]); r.Status != storage.StatusPending {
		t.Fatalf("record is %s after the re-drive, want pending", r.Status)
	}
	// The cookie is HttpOnly, SameSite=Strict and scoped to the console.
	res, _ = newBrowser(t, h).do("GET", "/skip?id="+id, nil, nil)
	c := res.Header.Get("Set-Cookie")
	for _, want := range []string{"HttpOnly", "SameSite=Strict", "Path=/"} {
		if !strings.Contains(c, want) {
			t.Errorf("session cookie %q lacks %s", c, want)
		}
	}
}

func TestEscaping(t *testing.T) {
	for _, sd := range seeders {
		t.Run(sd.name, func(t *testing.T) {
			const x = `<script>alert(1)</script>"'><img src=x onerror=alert(2)>`
			base, ids := sd.seed(t,
				deadRec{topic: "topic" + x, key: "key" + x, payload: `{"html":"` + strings.ReplaceAll(x, `"`, `\"`) + `"}`,
					meta: map[string]string{"meta" + x: "value" + x}, dead: true, err: "error" + x},
				deadRec{topic: "t", key: "key" + x, payload: "text payload " + x},
			)
			h := newHandler(t, base, Config{EnableActions: true})
			b := newBrowser(t, h)
			id := fmt.Sprint(ids[0])
			for _, p := range []string{"/dead", "/held", "/records/" + id, "/records/" + fmt.Sprint(ids[1]),
				"/redrive?id=" + id, "/redrive?key=" + url.QueryEscape("key"+x), "/skip?id=" + id,
				"/dead?key=" + url.QueryEscape("key"+x) + "&error=" + url.QueryEscape(x)} {
				res, body := b.do("GET", p, nil, nil)
				if res.StatusCode != 200 {
					t.Fatalf("GET %s = %d\n%s", p, res.StatusCode, body)
				}
				for _, raw := range []string{"<script>alert", "<img src=x", `"'><img`} {
					if strings.Contains(body, raw) {
						t.Errorf("GET %s: %q appears unescaped", p, raw)
					}
				}
				if !strings.Contains(body, "&lt;script&gt;alert(1)&lt;/script&gt;") && !strings.Contains(body, "%3cscript%3e") {
					t.Errorf("GET %s: the hostile text is not shown escaped", p)
				}
			}
			_, body := b.do("GET", "/records/"+id, nil, nil)
			for _, want := range []string{"topic&lt;script&gt;", "key&lt;script&gt;", "meta&lt;script&gt;", "value&lt;script&gt;", "error&lt;script&gt;",
				"&#34;html&#34;: &#34;&lt;script&gt;alert(1)" /* JSON indented, escaped */} {
				if !strings.Contains(body, want) {
					t.Errorf("record page lacks %s", want)
				}
			}
		})
	}
}

func TestPaging(t *testing.T) {
	for _, sd := range seeders {
		t.Run(sd.name, func(t *testing.T) {
			var recs []deadRec
			for i := range 7 {
				recs = append(recs, deadRec{topic: "t", key: fmt.Sprintf("k%d", i), payload: "p", dead: true, err: "e"})
			}
			base, ids := sd.seed(t, recs...)
			sp := &spy{Operator: base}
			h := newHandler(t, sp, Config{PageSize: 3})
			rowRE := regexp.MustCompile(`href="\./records/(\d+)">#`)
			nextRE := regexp.MustCompile(`id="next-page" href="([^"]+)"`)
			var seen []string
			path := "/dead"
			for pages := 0; path != ""; pages++ {
				if pages > 3 {
					t.Fatal("more than 3 pages for 7 records at 3 a page")
				}
				res, body := get(t, h, "GET", path)
				if res.StatusCode != 200 {
					t.Fatalf("GET %s = %d", path, res.StatusCode)
				}
				rows := rowRE.FindAllStringSubmatch(body, -1)
				if len(rows) > 3 {
					t.Fatalf("GET %s: %d rows, want at most the page size 3", path, len(rows))
				}
				for _, r := range rows {
					seen = append(seen, r[1])
				}
				path = ""
				if m := nextRE.FindStringSubmatch(body); m != nil {
					path = strings.TrimPrefix(strings.ReplaceAll(m[1], "&amp;", "&"), ".")
				}
			}
			var want []string
			for _, id := range ids {
				want = append(want, fmt.Sprint(id))
			}
			if !slices.Equal(seen, want) {
				t.Fatalf("pages listed %v, want every dead record once in id order %v", seen, want)
			}
			// The same for held keys (each of the 7 keys is held by its dead head).
			res, body := get(t, h, "GET", "/held?limit=2")
			if res.StatusCode != 200 || strings.Count(body, `href="./records/`) != 2 || !strings.Contains(body, "./held?after=k1&limit=2") {
				t.Fatalf("GET /held?limit=2: want 2 keys and a next link after k1:\n%s", body)
			}
			// A huge limit is bounded.
			get(t, h, "GET", "/dead?limit=100000000")
			for _, l := range sp.limits {
				if l <= 0 || l > MaxPageSize+1 {
					t.Fatalf("the storage was asked for a page of %d, want 1 to %d", l, MaxPageSize+1)
				}
			}
		})
	}
}

func TestPayloadViews(t *testing.T) {
	for _, sd := range seeders {
		t.Run(sd.name, func(t *testing.T) {
			big := strings.Repeat("x", 1000)
			base, ids := sd.seed(t,
				deadRec{topic: "t", payload: `{"b":[1,2],"a":"x"}`, dead: true, err: "e"},
				deadRec{topic: "t", payload: "\x00\x01\xffbinary", dead: true, err: "e"},
				deadRec{topic: "t", payload: big + "END", dead: true, err: "e"},
				deadRec{topic: "t", payload: "plain text", dead: true, err: "e"},
				deadRec{topic: "t", payload: "", dead: true, err: "e"},
			)
			h := newHandler(t, base, Config{PayloadLimit: 100})
			payloadRE := regexp.MustCompile(`(?s)<pre class="payload payload-(\w+)" id="payload">(.*?)</pre>`)
			view := func(id int64) (kind, text, body string) {
				_, body = get(t, h, "GET", fmt.Sprintf("/records/%d", id))
				if m := payloadRE.FindStringSubmatch(body); m != nil {
					return m[1], m[2], body
				}
				return "", "", body
			}
			if kind, text, _ := view(ids[0]); kind != "json" || !strings.Contains(text, "\n  &#34;b&#34;: [\n    1,") {
				t.Errorf("JSON payload shown as %s:\n%s", kind, text)
			}
			if kind, text, _ := view(ids[1]); kind != "hex" || !strings.Contains(text, "00 01 ff 62") {
				t.Errorf("binary payload shown as %s:\n%s", kind, text)
			}
			if kind, text, _ := view(ids[3]); kind != "text" || text != "plain text" {
				t.Errorf("text payload shown as %s: %q", kind, text)
			}
			if _, _, body := view(ids[4]); !strings.Contains(body, "Empty payload") {
				t.Errorf("empty payload not said so")
			}
			kind, text, body := view(ids[2])
			if kind != "text" || len(text) != 100 || strings.Contains(text, "END") {
				t.Errorf("1003-byte payload with limit 100 shown as %s, %d bytes", kind, len(text))
			}
			link := fmt.Sprintf(`id="download" href="../records/%d/payload"`, ids[2])
			if !strings.Contains(body, link) || !strings.Contains(body, "The payload is 1003 bytes; the first 100 are shown") {
				t.Errorf("truncated payload without its notice and download link:\n%s", body)
			}
			res, got := get(t, h, "GET", fmt.Sprintf("/records/%d/payload", ids[2]))
			if res.StatusCode != 200 || got != big+"END" || res.Header.Get("Content-Type") != "application/octet-stream" ||
				!strings.HasPrefix(res.Header.Get("Content-Disposition"), "attachment;") {
				t.Fatalf("download = %d %q %q, %d bytes; want the whole payload as an attachment", res.StatusCode,
					res.Header.Get("Content-Type"), res.Header.Get("Content-Disposition"), len(got))
			}
		})
	}
}

func TestViewPayloadCutsWholeRunes(t *testing.T) {
	v := viewPayload([]byte(strings.Repeat("é", 10)), 5) // 2 bytes each: the cut falls inside the third
	if v.Kind != "text" || v.Text != "éé" || v.Shown != 4 || !v.Truncated {
		t.Fatalf("viewPayload = %+v, want the two whole runes as text", v)
	}
}

func TestActions(t *testing.T) {
	for _, sd := range seeders {
		t.Run(sd.name, func(t *testing.T) {
			base, ids := sd.seed(t,
				deadRec{topic: "orders", key: "a", payload: "a1", dead: true, err: "timeout talking to broker"},
				deadRec{topic: "orders", key: "a", payload: "a2"},
				deadRec{topic: "orders", key: "b", payload: "b1", dead: true, err: "schema mismatch"},
				deadRec{topic: "payments", key: "c", payload: "c1", dead: true, err: "timeout again"},
				deadRec{topic: "payments", key: "d", payload: "d1", dead: true, err: "bad"},
				deadRec{topic: "payments", key: "e", payload: "e1", dead: true, err: "bad"},
			)
			sp := &spy{Operator: base}
			logger := watermill.NewCaptureLogger()
			h, err := New(sp, Config{Authorize: AllowAll, EnableActions: true, Actor: func(r *http.Request) string { return "alice" }}, logger)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = h.Close() }()
			b := newBrowser(t, h)
			ctx := context.Background()
			status := func(id int64) storage.Status {
				r, err := base.Record(ctx, id)
				if err != nil {
					t.Fatal(err)
				}
				return r.Status
			}
			token := b.token(fmt.Sprintf("/skip?id=%d", ids[0])) // one token per session, on every form
			post := func(confirmPath, action string, form url.Values) (*http.Response, string) {
				if got := b.token(confirmPath); got != token {
					t.Fatalf("the form of %s has token %q, want the session's %q", confirmPath, got, token)
				}
				form.Set("csrf_token", token)
				return b.do("POST", action, form, nil)
			}

			// A key: its confirmation counts, the post re-drives through RedriveParams.Key.
			_, body := b.do("GET", "/redrive?key=a", nil, nil)
			if !strings.Contains(body, `<strong id="count">1</strong>`) {
				t.Fatalf("confirmation of key a does not count 1 record:\n%s", body)
			}
			res, _ := post("/redrive?key=a", "/redrive", url.Values{"key": {"a"}})
			if res.StatusCode != 303 || res.Header.Get("Location") != "./dead?key=a&redriven=1" || status(ids[0]) != storage.StatusPending {
				t.Fatalf("re-drive key a: %d %q, record %s", res.StatusCode, res.Header.Get("Location"), status(ids[0]))
			}
			// A filtered set (error text): listed, then re-driven by ids.
			res, _ = post("/redrive?error=timeout", "/redrive", url.Values{"error": {"timeout"}})
			if res.StatusCode != 303 || status(ids[3]) != storage.StatusPending || status(ids[2]) != storage.StatusDead {
				t.Fatalf("re-drive error~timeout: %d; c %s (want pending), b %s (want dead)", res.StatusCode, status(ids[3]), status(ids[2]))
			}
			// A topic.
			res, _ = post("/redrive?topic=payments", "/redrive", url.Values{"topic": {"payments"}})
			if res.StatusCode != 303 || status(ids[4]) != storage.StatusPending || status(ids[5]) != storage.StatusPending {
				t.Fatalf("re-drive topic payments: %d", res.StatusCode)
			}
			// Skip: a reason is required; then the dead head is skipped.
			res, body = post(fmt.Sprintf("/skip?id=%d", ids[2]), "/skip", url.Values{"id": {fmt.Sprint(ids[2])}, "reason": {"  "}})
			if res.StatusCode != 400 || status(ids[2]) != storage.StatusDead || !strings.Contains(body, "Give a reason") {
				t.Fatalf("skip without a reason = %d, record %s", res.StatusCode, status(ids[2]))
			}
			res, _ = post(fmt.Sprintf("/skip?id=%d", ids[2]), "/skip", url.Values{"id": {fmt.Sprint(ids[2])}, "reason": {"OPS-1"}})
			if res.StatusCode != 303 || status(ids[2]) != storage.StatusSkipped {
				t.Fatalf("skip = %d, record %s", res.StatusCode, status(ids[2]))
			}
			// Skipping a record that is not dead: the confirmation says so and the post is refused.
			if _, body = b.do("GET", fmt.Sprintf("/skip?id=%d", ids[1]), nil, nil); strings.Contains(body, `id="confirm"`) {
				t.Fatalf("skip confirmation of a pending record offers to confirm")
			}
			res, _ = b.do("POST", "/skip", url.Values{"id": {fmt.Sprint(ids[1])}, "reason": {"x"}, "csrf_token": {token}}, nil)
			if res.StatusCode != http.StatusConflict {
				t.Fatalf("skip of a pending record = %d, want 409", res.StatusCode)
			}
			// Nothing selected, or two selections: refused.
			if res, _ = b.do("POST", "/redrive", url.Values{"csrf_token": {token}}, nil); res.StatusCode != 400 {
				t.Fatalf("re-drive with nothing selected = %d, want 400", res.StatusCode)
			}
			if res, _ = b.do("POST", "/redrive", url.Values{"id": {"1"}, "key": {"a"}, "csrf_token": {token}}, nil); res.StatusCode != 400 {
				t.Fatalf("re-drive of an id and a key = %d, want 400", res.StatusCode)
			}

			wantRedrives := []storage.RedriveParams{{Key: "a"}, {IDs: []int64{ids[3]}}, {Topic: "payments"}}
			if fmt.Sprint(sp.redrives) != fmt.Sprint(wantRedrives) {
				t.Fatalf("Redrive calls %+v, want %+v", sp.redrives, wantRedrives)
			}
			audit := captured(logger, watermill.InfoLogLevel, "txoutbox console: re-drive")
			if len(audit) != 3 || audit[0].Fields["by"] != "key" || audit[0].Fields["key"] != "a" || audit[0].Fields["count"] != int64(1) ||
				audit[0].Fields["actor"] != "alice" || audit[1].Fields["by"] != "filter" || audit[2].Fields["by"] != "topic" {
				t.Fatalf("audit lines %+v", audit)
			}
			if skips := captured(logger, watermill.InfoLogLevel, "txoutbox console: skip"); len(skips) != 1 || skips[0].Fields["reason"] != "OPS-1" {
				t.Fatalf("skip audit lines %+v", skips)
			}
		})
	}
}

// statsOnly is a storage that reports Stats and nothing else.
type statsOnly struct{}

func (statsOnly) Stats(context.Context) (storage.Stats, error) {
	return storage.Stats{Pending: 42}, nil
}

func TestStorageWithoutOperator(t *testing.T) {
	h := newHandler(t, statsOnly{}, Config{EnableActions: true})
	res, body := get(t, h, "GET", "/")
	if res.StatusCode != 200 || !strings.Contains(body, ">42<") || !strings.Contains(body, "does not implement storage.Operator") {
		t.Fatalf("overview of a Stats-only storage = %d:\n%s", res.StatusCode, body)
	}
	if strings.Contains(body, "actions on") {
		t.Errorf("a storage without Operator is shown with actions on")
	}
	for _, p := range []string{"/held", "/dead", "/records/1", "/redrive?id=1"} {
		res, body := get(t, h, "GET", p)
		if res.StatusCode != http.StatusNotImplemented || !strings.Contains(body, "console.statsOnly) does not implement storage.Operator") {
			t.Errorf("GET %s = %d, want 501 saying the storage lacks storage.Operator\n%s", p, res.StatusCode, body)
		}
	}
}

func TestSampler(t *testing.T) {
	base, _ := seed(t, deadRec{topic: "t", payload: "p"})
	sp := &spy{Operator: base}
	h := newHandler(t, sp, Config{SampleInterval: 100 * time.Millisecond, Samples: 20, SampleIdle: 400 * time.Millisecond})
	if h.sampler.isRunning() {
		t.Fatal("the sampler runs before anyone viewed the overview")
	}
	get(t, h, "GET", "/")
	waitFor(t, 10*time.Second, "3 samples", func() bool { return len(h.sampler.samples()) >= 3 })
	_, body := get(t, h, "GET", "/live")
	if !strings.Contains(body, "<polyline points=") || !strings.Contains(body, "Throughput") || !strings.Contains(body, "Lag") {
		t.Fatalf("the live fragment has no chart lines:\n%s", body)
	}
	// Unviewed, it stops by itself.
	waitFor(t, 10*time.Second, "the idle sampler to stop", func() bool { return !h.sampler.isRunning() })
	n := len(sp.Calls())
	time.Sleep(300 * time.Millisecond)
	if len(sp.Calls()) != n {
		t.Fatalf("the storage is still sampled after the sampler stopped")
	}
	// The ring is bounded.
	get(t, h, "GET", "/")
	waitFor(t, 20*time.Second, "the ring to fill", func() bool { h.sampler.viewed(); return len(h.sampler.samples()) == 20 })
	time.Sleep(250 * time.Millisecond)
	if got := len(h.sampler.samples()); got != 20 {
		t.Fatalf("ring holds %d samples, want the bound 20", got)
	}
	// Close stops it for good (goleak in TestMain checks the goroutine is gone).
	_ = h.Close()
	if h.sampler.isRunning() {
		t.Fatal("the sampler runs after Close")
	}
	get(t, h, "GET", "/")
	if h.sampler.isRunning() {
		t.Fatal("a view after Close started the sampler")
	}
}

func TestCharts(t *testing.T) {
	now := time.Now()
	var ss []sample
	for i := range 10 {
		ss = append(ss, sample{at: now.Add(time.Duration(i-9) * time.Second), ok: true,
			stats: storage.Stats{Delivered: int64(i * 10), OldestPendingAge: time.Duration(i) * time.Second}})
	}
	ss[5].ok = false // a failed sample breaks the lines
	tp, lag := charts(ss, 20*time.Second, time.Second, now)
	if len(tp.Lines) != 2 || tp.Now != "10/s" || tp.Max != "10/s" {
		t.Fatalf("throughput chart %+v, want two runs at 10/s", tp)
	}
	if len(lag.Lines) != 2 || lag.Now != "9s" || lag.Max != "10s" {
		t.Fatalf("lag chart %+v", lag)
	}
	// Many samples: at most about a point a pixel.
	ss = ss[:0]
	for i := range MaxSamples {
		ss = append(ss, sample{at: now.Add(time.Duration(i-MaxSamples) * 100 * time.Millisecond), ok: true,
			stats: storage.Stats{Delivered: int64(i * (i % 7)), OldestPendingAge: time.Duration(i%13) * time.Second}})
	}
	if _, lag := charts(ss, MaxSamples*100*time.Millisecond, 100*time.Millisecond, now); len(lag.Lines) != 1 || strings.Count(lag.Lines[0], " ")+1 > chartW {
		t.Fatalf("a chart of %d samples has %d lines, the first of %d points; want one of at most %d", MaxSamples, len(lag.Lines), strings.Count(lag.Lines[0], " ")+1, chartW)
	}
	if empty, _ := charts(nil, time.Minute, time.Second, now); !empty.Empty {
		t.Fatal("chart of no samples is not empty")
	}
}

// failingStats is a storage whose Stats fails.
type failingStats struct{}

func (failingStats) Stats(context.Context) (storage.Stats, error) {
	return storage.Stats{}, errors.New("connection refused <b>db</b>")
}

func TestStatsFailure(t *testing.T) {
	logger := watermill.NewCaptureLogger()
	h, err := New(failingStats{}, Config{Authorize: AllowAll, SampleInterval: 100 * time.Millisecond}, logger)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = h.Close() }()
	res, body := get(t, h, "GET", "/")
	if res.StatusCode != 200 || !strings.Contains(body, "Reading the stats failed: connection refused &lt;b&gt;db&lt;/b&gt;") {
		t.Fatalf("overview over failing stats = %d:\n%s", res.StatusCode, body)
	}
	waitFor(t, 10*time.Second, "5 failed samples", func() bool { return len(h.sampler.samples()) >= 5 })
	if n := len(captured(logger, watermill.ErrorLogLevel, "txoutbox console: sample stats")); n != 1 {
		t.Fatalf("%d error lines for a run of failed samples, want 1", n)
	}
}
