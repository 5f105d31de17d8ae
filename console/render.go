package console

import (
	"bytes"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"html/template"
	"io/fs"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// staticVersion changes with the embedded files, so their URLs can be
// cached for long.
var staticVersion = func() string {
	h := sha256.New()
	_ = fs.WalkDir(staticFS, "static", func(path string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			b, _ := staticFS.ReadFile(path)
			h.Write(b)
		}
		return nil
	})
	return hex.EncodeToString(h.Sum(nil))[:12]
}()

var pageNames = []string{"overview", "held", "dead", "record", "confirm", "error"}

var funcs = template.FuncMap{
	"time": func(t time.Time) string {
		if t.IsZero() {
			return "–"
		}
		return t.UTC().Format("2006-01-02 15:04:05Z")
	},
	"ago": func(t time.Time) string {
		if t.IsZero() {
			return ""
		}
		d := time.Since(t)
		if d < 0 {
			return "in " + formatDuration(-d)
		}
		return formatDuration(d) + " ago"
	},
	"dur":   formatDuration,
	"short": shorten,
}

// parsePages parses one template set per page: the layout plus the page.
func parsePages() (map[string]*template.Template, error) {
	base, err := template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html")
	if err != nil {
		return nil, err
	}
	pages := make(map[string]*template.Template, len(pageNames))
	for _, name := range pageNames {
		t, err := template.Must(base.Clone()).ParseFS(templateFS, "templates/"+name+".html")
		if err != nil {
			return nil, err
		}
		pages[name] = t
	}
	return pages, nil
}

// page is what every page template gets.
type page struct {
	Title   string
	P       string // the way to the console's root from this page ("." or ".."), for links
	Nav     string // the current section
	Actions bool
	CSRF    string
	Flash   string
	Static  string // the version of the static files
	Data    any
}

func (h *Handler) newPage(r *http.Request, nav string, data any) *page {
	return &page{Title: h.config.Title, P: root(r.URL.Path), Nav: nav, Actions: h.config.EnableActions && h.op != nil,
		Static: staticVersion, Data: data}
}

func (h *Handler) render(w http.ResponseWriter, status int, name string, p *page) {
	h.renderTemplate(w, status, name, "layout.html", p)
}

func (h *Handler) renderTemplate(w http.ResponseWriter, status int, name, tmpl string, data any) {
	var buf bytes.Buffer
	if err := h.pages[name].ExecuteTemplate(&buf, tmpl, data); err != nil {
		h.logger.Error("txoutbox console: render page", err, map[string]any{"page": name})
		http.Error(w, "500 internal error rendering the page", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

type errorData struct {
	Status  int
	Heading string
	Message string
}

func (h *Handler) renderError(w http.ResponseWriter, r *http.Request, status int, heading, message string) {
	h.render(w, status, "error", h.newPage(r, "", errorData{status, heading, message}))
}

// storageError answers a failed storage call with 500 and logs it.
func (h *Handler) storageError(w http.ResponseWriter, r *http.Request, what string, err error) {
	h.logger.Error("txoutbox console: "+what, err, map[string]any{"path": r.URL.Path})
	h.renderError(w, r, http.StatusInternalServerError, "Storage error", what+": "+err.Error())
}

func (h *Handler) static(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("file")
	var ctype string
	switch {
	case strings.HasSuffix(name, ".js"):
		ctype = "text/javascript; charset=utf-8"
	case strings.HasSuffix(name, ".css"):
		ctype = "text/css; charset=utf-8"
	case strings.HasSuffix(name, ".svg"):
		ctype = "image/svg+xml"
	}
	b, err := staticFS.ReadFile("static/" + name)
	if err != nil || ctype == "" || strings.Contains(name, "/") {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", ctype)
	w.Header().Set("Cache-Control", "private, max-age=86400") // the URL carries ?v=staticVersion
	_, _ = w.Write(b)
}

// payloadView is a payload as the record page shows it.
type payloadView struct {
	Kind      string // json, text, hex or empty
	Text      string
	Size      int
	Shown     int
	Truncated bool
}

// viewPayload formats p for display: indented JSON when it is JSON whose
// indented form stays small (see maxIndentGrowth), text when it is printable
// UTF-8, a hex dump otherwise; cut at limit bytes.
func viewPayload(p []byte, limit int) payloadView {
	v := payloadView{Size: len(p), Shown: len(p)}
	if len(p) == 0 {
		v.Kind = "empty"
		return v
	}
	if len(p) > limit {
		v.Truncated = true
		cut := p[:limit]
		// Do not split the last rune of text: back up to its start.
		for i := 0; i < utf8.UTFMax-1 && len(cut) > 1 && !utf8.Valid(cut); i++ {
			cut = cut[:len(cut)-1]
		}
		if !utf8.Valid(cut) {
			cut = p[:limit]
		}
		p, v.Shown = cut, len(cut)
	} else if json.Valid(p) && indentsWithin(p, maxIndentGrowth*len(p)+maxIndentSlack) {
		var buf bytes.Buffer
		if json.Indent(&buf, p, "", "  ") == nil {
			v.Kind, v.Text = "json", buf.String()
			return v
		}
	}
	if printable(p) {
		v.Kind, v.Text = "text", string(p)
		return v
	}
	v.Kind, v.Text = "hex", hex.Dump(p)
	return v
}

// A JSON payload is indented only when its indented form is at most
// maxIndentGrowth times its size plus maxIndentSlack bytes: indenting
// deeply nested JSON grows it quadratically (every level indents every line
// below it), so a few kilobytes of brackets would take hundreds of
// megabytes. Larger forms are shown as the text they are.
const (
	maxIndentGrowth = 4
	maxIndentSlack  = 4 << 10
)

// indentsWithin reports whether json.Indent(p, "", "  ") of valid JSON p
// takes at most limit bytes, by an upper bound counted in one pass: each
// bracket and comma may start a new line indented two spaces per open
// bracket, each colon gains a space.
func indentsWithin(p []byte, limit int) bool {
	n, depth, inString := len(p), 0, false
	for i := 0; i < len(p); i++ {
		c := p[i]
		if inString {
			switch c {
			case '\\':
				i++
			case '"':
				inString = false
			}
			continue
		}
		switch c {
		case '"':
			inString = true
		case '{', '[':
			depth++
			n += 1 + 2*depth
		case '}', ']':
			depth--
			n += 1 + 2*depth
		case ',':
			n += 1 + 2*depth
		case ':':
			n++
		}
		if n > limit {
			return false
		}
	}
	return true
}

func printable(p []byte) bool {
	if !utf8.Valid(p) {
		return false
	}
	for _, r := range string(p) {
		if !unicode.IsPrint(r) && !unicode.IsSpace(r) {
			return false
		}
	}
	return true
}

// shorten flattens s to one line cut to n runes, for table cells.
func shorten(n int, s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}

type kv struct{ K, V string }

func sortedMetadata(m map[string]string) []kv {
	out := make([]kv, 0, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, kv{k, m[k]})
	}
	return out
}

func plural(n int64, one, many string) string {
	if n == 1 {
		return fmt.Sprintf("%d %s", n, one)
	}
	return fmt.Sprintf("%d %s", n, many)
}
