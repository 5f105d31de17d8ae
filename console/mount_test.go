package console

import (
	"fmt"
	"html"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
)

// refRE finds the URLs a page makes the browser load or go to.
var refRE = regexp.MustCompile(`(href|src|action|data-src)="([^"]*)"`)

// TestMounted serves the console under /outbox/ in each way an application
// mounts a handler: under http.StripPrefix, with and without Prefix, and
// on the full path with Prefix. Every link, the stylesheet, the script,
// the live fragment and every form resolve under /outbox/ and answer; a
// re-drive posted from its confirmation page lands on a page under
// /outbox/ too.
func TestMounted(t *testing.T) {
	for _, m := range []struct {
		name   string
		prefix string
		mount  func(h http.Handler) http.Handler
	}{
		{"StripPrefix, no Prefix", "", func(h http.Handler) http.Handler { return http.StripPrefix("/outbox", h) }},
		{"StripPrefix and Prefix", "/outbox", func(h http.Handler) http.Handler { return http.StripPrefix("/outbox", h) }},
		{"full path and Prefix", "/outbox", func(h http.Handler) http.Handler { return h }},
	} {
		t.Run(m.name, func(t *testing.T) {
			base, ids := seed(t,
				deadRec{topic: "orders", key: "k1", payload: `{"a":1}`, dead: true, err: "boom"},
				deadRec{topic: "orders", key: "k1", payload: "behind"},
			)
			h := newHandler(t, base, Config{Prefix: m.prefix, EnableActions: true})
			mux := http.NewServeMux()
			mux.Handle("/outbox/", m.mount(h))
			mux.Handle("/outbox", m.mount(h))
			mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
				http.Error(w, "outside the console: "+r.URL.Path, http.StatusTeapot)
			})
			b := newBrowser(t, mux)
			root, _ := url.Parse(b.srv.URL + "/outbox/")

			res, _ := b.do("GET", "/outbox", nil, nil)
			if loc, err := res.Location(); res.StatusCode != http.StatusMovedPermanently || err != nil || loc.Path != "/outbox/" {
				t.Errorf("GET /outbox = %d to %v, want a redirect to /outbox/", res.StatusCode, loc)
			}
			seen := map[string]bool{}
			var forms []string
			pages := []string{"/outbox/", "/outbox/held", "/outbox/dead", fmt.Sprintf("/outbox/records/%d", ids[0]),
				fmt.Sprintf("/outbox/redrive?id=%d", ids[0]), fmt.Sprintf("/outbox/skip?id=%d", ids[0]), "/outbox/dead?key=k1"}
			for _, p := range pages {
				res, body := b.do("GET", p, nil, nil)
				if res.StatusCode != http.StatusOK {
					t.Fatalf("GET %s = %d\n%s", p, res.StatusCode, body)
				}
				pageURL, _ := url.Parse(b.srv.URL + p)
				for _, ref := range refRE.FindAllStringSubmatch(body, -1) {
					u, err := pageURL.Parse(html.UnescapeString(ref[2]))
					if err != nil {
						t.Fatalf("%s: %s=%q: %v", p, ref[1], ref[2], err)
					}
					if !strings.HasPrefix(u.Path, root.Path) && u.Path+"/" != root.Path {
						t.Errorf("%s: %s=%q resolves to %s, outside /outbox/", p, ref[1], ref[2], u)
						continue
					}
					if ref[1] == "action" {
						if strings.Contains(body, `method="post"`) {
							forms = append(forms, u.Path)
						}
						continue
					}
					seen[u.RequestURI()] = true
				}
			}
			for _, want := range []string{"/outbox/static/console.css", "/outbox/static/console.js", "/outbox/live", "/outbox/dead", "/outbox/held"} {
				found := false
				for u := range seen {
					if strings.HasPrefix(u, want) {
						found = true
					}
				}
				if !found {
					t.Errorf("no page refers to %s: %v", want, seen)
				}
			}
			for u := range seen {
				if res, body := b.do("GET", strings.TrimPrefix(u, b.srv.URL), nil, nil); res.StatusCode != http.StatusOK {
					t.Errorf("GET %s (linked) = %d\n%.200s", u, res.StatusCode, body)
				}
			}
			if len(forms) == 0 {
				t.Fatal("no form found")
			}
			// The confirmation's form, posted: the redirect lands under /outbox/.
			token := b.token(fmt.Sprintf("/outbox/redrive?id=%d", ids[0]))
			res, body := b.do("POST", "/outbox/redrive", url.Values{"id": {fmt.Sprint(ids[0])}, "csrf_token": {token}}, nil)
			loc, err := res.Location()
			if res.StatusCode != http.StatusSeeOther || err != nil || !strings.HasPrefix(loc.Path, "/outbox/records/") {
				t.Fatalf("POST /outbox/redrive = %d, Location %v (%v), want 303 to /outbox/records/...\n%s", res.StatusCode, loc, err, body)
			}
			if res, _ := b.do("GET", loc.RequestURI(), nil, nil); res.StatusCode != http.StatusOK {
				t.Fatalf("GET %s after the re-drive = %d", loc, res.StatusCode)
			}
			// The session cookie is scoped to the console.
			res, _ = newBrowser(t, mux).do("GET", fmt.Sprintf("/outbox/skip?id=%d", ids[0]), nil, nil)
			if c := res.Header.Get("Set-Cookie"); !strings.Contains(c, "Path=/outbox/") {
				t.Errorf("session cookie %q, want Path=/outbox/", c)
			}
		})
	}
}
