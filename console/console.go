package console

import (
	"cmp"
	"crypto/rand"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/txoutbox/txoutbox/storage"
)

// Defaults and bounds of [Config].
const (
	PageSizeDefault             = 50
	MaxPageSize                 = 500
	PayloadLimitDefault         = 64 << 10
	SampleIntervalDefault       = 5 * time.Second
	MinSampleInterval           = 100 * time.Millisecond
	SamplesDefault              = 120
	MaxSamples                  = 10_000
	SampleIdleDefault           = 5 * time.Minute
	FilteredRedriveLimitDefault = 10_000
	TitleDefault                = "txoutbox"
)

// Config configures a [Handler]. Only Authorize is required; every other
// zero field takes its default.
type Config struct {
	// Authorize decides whether a request may use the console at all. A
	// refused request gets 403 Forbidden and reaches no storage call.
	// Required: pass your application's own check (an admin session, a
	// role), or [AllowAll] when the handler already sits behind your
	// authentication middleware.
	Authorize func(*http.Request) bool

	// EnableActions turns on re-drive and skip. Defaults to false: the
	// console is read-only, renders no action buttons and answers every
	// action with 403 Forbidden.
	EnableActions bool

	// Prefix is the path the handler is mounted at, without a trailing
	// slash, for example "/admin/outbox" for mux.Handle("/admin/outbox/",
	// h), which hands the handler the full path. Under http.StripPrefix it
	// may be left empty: the handler then serves the paths it is given.
	// Links, forms and redirects are relative to the page, so they resolve
	// under the mount path either way; the session cookie is scoped to it.
	// Defaults to "" (mounted at the root, or under http.StripPrefix).
	Prefix string

	// Actor names the operator in audit lines, for example the user of your
	// session. Defaults to the request's remote address.
	Actor func(*http.Request) string

	// TrustedOrigins are origins ("https://admin.example.com") allowed to
	// post actions besides the console's own, for a proxy that rewrites the
	// Host header. See [http.CrossOriginProtection.AddTrustedOrigin].
	TrustedOrigins []string

	// CSRFKey signs the CSRF tokens; at least 32 bytes. Replicas behind a
	// load balancer must share it. Defaults to a random key per Handler, so
	// a form outlives neither the process nor another replica.
	CSRFKey []byte

	// PageSize is the number of rows a list shows unless the URL asks for
	// another (?limit=). Defaults to PageSizeDefault (50); 1 to MaxPageSize
	// (500), which also bounds ?limit=.
	PageSize int

	// PayloadLimit is how many bytes of a payload the record page shows; a
	// larger payload is cut there and offered as a download. Defaults to
	// PayloadLimitDefault (64 KiB).
	PayloadLimit int

	// SampleInterval is how often the overview samples Stats for its chart,
	// and how often an open overview refreshes. Defaults to
	// SampleIntervalDefault (5s); at least MinSampleInterval (100ms).
	SampleInterval time.Duration

	// Samples is how many samples the chart's ring buffer keeps: the chart
	// spans Samples × SampleInterval. Defaults to SamplesDefault (120: ten
	// minutes at 5s); at most MaxSamples.
	Samples int

	// SampleIdle stops the sampling this long after the overview was last
	// viewed; the next view starts it again. Defaults to SampleIdleDefault
	// (5m).
	SampleIdle time.Duration

	// FilteredRedriveLimit bounds the records a filtered re-drive (by error
	// text, or by topic and key together) lists and re-drives in one go, and
	// the count its confirmation page shows; the storage re-drives a whole
	// key, topic or table without listing. Defaults to
	// FilteredRedriveLimitDefault (10 000).
	FilteredRedriveLimit int

	// Title is shown in the header and the window title. Defaults to
	// TitleDefault ("txoutbox"); name the service or the table here.
	Title string
}

// AllowAll is an Authorize hook that lets every request in, for a handler
// mounted behind the application's own authentication middleware.
func AllowAll(*http.Request) bool { return true }

func (c *Config) setDefaults() {
	c.PageSize = cmp.Or(c.PageSize, PageSizeDefault)
	c.PayloadLimit = cmp.Or(c.PayloadLimit, PayloadLimitDefault)
	c.SampleInterval = cmp.Or(c.SampleInterval, SampleIntervalDefault)
	c.Samples = cmp.Or(c.Samples, SamplesDefault)
	c.SampleIdle = cmp.Or(c.SampleIdle, SampleIdleDefault)
	c.FilteredRedriveLimit = cmp.Or(c.FilteredRedriveLimit, FilteredRedriveLimitDefault)
	c.Title = cmp.Or(c.Title, TitleDefault)
}

// Validate reports every invalid field, after defaults are applied.
func (c Config) Validate() error {
	c.setDefaults()
	var errs []error
	if c.Authorize == nil {
		errs = append(errs, errors.New("Config.Authorize is nil: pass your application's check, or console.AllowAll when the handler sits behind your own auth middleware"))
	}
	if c.Prefix != "" && (!strings.HasPrefix(c.Prefix, "/") || strings.HasSuffix(c.Prefix, "/") || strings.ContainsAny(c.Prefix, "{}?#%\\ \t\r\n\"'<>")) {
		errs = append(errs, fmt.Errorf("Config.Prefix %q: want a plain path with a leading and no trailing slash, like /admin/outbox", c.Prefix))
	}
	if c.CSRFKey != nil && len(c.CSRFKey) < 32 {
		errs = append(errs, fmt.Errorf("Config.CSRFKey has %d bytes, want at least 32", len(c.CSRFKey)))
	}
	if c.PageSize < 1 || c.PageSize > MaxPageSize {
		errs = append(errs, fmt.Errorf("Config.PageSize must be 1 to %d, got %d", MaxPageSize, c.PageSize))
	}
	if c.PayloadLimit < 1 {
		errs = append(errs, fmt.Errorf("Config.PayloadLimit must be > 0, got %d", c.PayloadLimit))
	}
	if c.SampleInterval < MinSampleInterval {
		errs = append(errs, fmt.Errorf("Config.SampleInterval must be >= %s, got %s", MinSampleInterval, c.SampleInterval))
	}
	if c.Samples < 2 || c.Samples > MaxSamples {
		errs = append(errs, fmt.Errorf("Config.Samples must be 2 to %d, got %d", MaxSamples, c.Samples))
	}
	if c.SampleIdle <= 0 {
		errs = append(errs, fmt.Errorf("Config.SampleIdle must be > 0, got %s", c.SampleIdle))
	}
	if c.FilteredRedriveLimit < 1 {
		errs = append(errs, fmt.Errorf("Config.FilteredRedriveLimit must be > 0, got %d", c.FilteredRedriveLimit))
	}
	for _, o := range c.TrustedOrigins {
		if err := http.NewCrossOriginProtection().AddTrustedOrigin(o); err != nil {
			errs = append(errs, fmt.Errorf("Config.TrustedOrigins: %w", err))
		}
	}
	return errors.Join(errs...)
}

// Handler is the web console: an [http.Handler] serving the overview, the
// held keys, the dead letters and one record, and, with
// Config.EnableActions, re-drive and skip. Mount it on your admin mux under
// Config.Prefix. Close stops its sampler.
type Handler struct {
	config Config
	stats  storage.StatsReader
	op     storage.Operator   // nil: the storage does not implement storage.Operator
	opWhy  string             // why op is nil, for the page that says so
	inbox  storage.InboxStore // nil: the storage has no inbox table
	logger watermill.LoggerAdapter

	mux     *http.ServeMux
	cop     *http.CrossOriginProtection
	csrfKey []byte
	pages   map[string]*template.Template
	sampler *sampler
}

var _ http.Handler = (*Handler)(nil)

// New returns a console over store. Every page needs a store implementing
// [storage.Operator]; a store that only reports Stats gets the overview,
// and the other pages say that its storage does not support them. The
// overview shows the inbox table's size too when store has one (an Inbox
// method, as the SQL storages have). logger
// receives the audit line of every action (Info) and storage errors
// (Error); nil discards them.
func New(store storage.StatsReader, config Config, logger watermill.LoggerAdapter) (*Handler, error) {
	if store == nil {
		return nil, errors.New("new txoutbox console: store is nil")
	}
	config.setDefaults()
	if err := config.Validate(); err != nil {
		return nil, fmt.Errorf("new txoutbox console: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	h := &Handler{config: config, stats: store, logger: safeLogger{logger.With(watermill.LogFields{"component": "txoutbox-console"})}}
	if in, ok := store.(interface{ Inbox() storage.InboxStore }); ok {
		h.inbox = in.Inbox()
	}
	if op, ok := store.(storage.Operator); ok {
		h.op = op
	} else {
		h.opWhy = fmt.Sprintf("this storage (%T) does not implement storage.Operator, so the console can show its overview only", store)
	}
	h.csrfKey = config.CSRFKey
	if h.csrfKey == nil {
		h.csrfKey = make([]byte, 32)
		_, _ = rand.Read(h.csrfKey) // never fails (crypto/rand)
	}
	h.cop = http.NewCrossOriginProtection()
	for _, o := range config.TrustedOrigins {
		_ = h.cop.AddTrustedOrigin(o) // checked by Validate
	}
	var err error
	if h.pages, err = parsePages(); err != nil {
		return nil, fmt.Errorf("new txoutbox console: %w", err)
	}
	h.sampler = newSampler(store, config.SampleInterval, config.Samples, config.SampleIdle, h.logger)
	h.routes()
	return h, nil
}

// Close stops the Stats sampler and waits for it; the pages keep working
// (the chart no longer grows). It is safe to call more than once.
func (h *Handler) Close() error {
	h.sampler.close()
	return nil
}

// ServeHTTP sets the security headers, asks Config.Authorize, and serves
// the page.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hd := w.Header()
	hd.Set("Content-Security-Policy", "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
	hd.Set("X-Content-Type-Options", "nosniff")
	hd.Set("X-Frame-Options", "DENY")
	hd.Set("Referrer-Policy", "no-referrer")
	hd.Set("Cache-Control", "no-store")
	if !h.config.Authorize(r) {
		http.Error(w, "403 forbidden: not authorised to use the outbox console", http.StatusForbidden)
		return
	}
	// The path inside the console: under Config.Prefix when the mux hands
	// over the full path, or already without it under http.StripPrefix.
	path := r.URL.Path
	if p := h.config.Prefix; p != "" && (path == p || strings.HasPrefix(path, p+"/")) {
		path = path[len(p):]
	}
	if path == "" { // the console's root without its slash
		// "./" first: a segment with a colon must not read as a scheme.
		h.redirect(w, r, "./"+mountName(r, h.config.Prefix)+"/", http.StatusMovedPermanently)
		return
	}
	if !textValues(r.URL.Query()) {
		h.renderError(w, r, http.StatusBadRequest, "Bad request", notText)
		return
	}
	if path != r.URL.Path {
		r2 := new(http.Request)
		*r2 = *r
		r2.URL = new(url.URL)
		*r2.URL = *r.URL
		r2.URL.Path, r2.URL.RawPath = path, ""
		r = r2
	}
	h.mux.ServeHTTP(w, r)
}

// The console's links, forms and redirects are relative to the page they
// are on, so that they resolve under whatever path the console is mounted
// at: Config.Prefix on a mux, http.StripPrefix, a proxy that rewrites
// paths. root is the way from the page at the console's path p to the
// console's root: "." for the pages at the top, ".." one level down.
func root(p string) string {
	depth := strings.Count(p, "/") - 1
	if depth <= 0 {
		return "."
	}
	return strings.TrimSuffix(strings.Repeat("../", depth), "/")
}

// redirect answers with a redirect to target, relative to the request's
// URL as the browser sent it (http.Redirect would resolve it against the
// path inside the console, which lacks the mount path).
func (h *Handler) redirect(w http.ResponseWriter, _ *http.Request, target string, code int) {
	w.Header().Set("Location", target)
	w.WriteHeader(code)
}

// mountName is the last segment of the path the console is mounted at,
// for the redirect from it to its root.
func mountName(r *http.Request, prefix string) string {
	p := prefix
	if u, err := url.ParseRequestURI(r.RequestURI); err == nil && u.Path != "" {
		p = u.Path
	}
	p = strings.TrimSuffix(p, "/")
	return p[strings.LastIndex(p, "/")+1:]
}

// mountPath is the path the console is mounted at, as the browser sees it:
// Config.Prefix, or the request's path as sent less the path inside the
// console. "" when it cannot be told (a proxy rewrote the path).
func (h *Handler) mountPath(r *http.Request) string {
	if h.config.Prefix != "" {
		return h.config.Prefix
	}
	u, err := url.ParseRequestURI(r.RequestURI)
	if err != nil || !strings.HasSuffix(u.Path, r.URL.Path) {
		return ""
	}
	return strings.TrimSuffix(u.Path, r.URL.Path)
}

// notText says why a request with a value that is not text is refused.
const notText = "A value in the request is not text: it holds a NUL byte or bytes that are not UTF-8, which no key, topic, error or reason the console filters by or records can hold."

// textValues reports whether every name and value of v is UTF-8 without a
// NUL byte: PostgreSQL and MySQL refuse to compare anything else with
// text, and it would be a storage error (500, and an ERROR line) per
// request.
func textValues(v url.Values) bool {
	ok := func(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }
	for k, vs := range v {
		if !ok(k) {
			return false
		}
		for _, s := range vs {
			if !ok(s) {
				return false
			}
		}
	}
	return true
}

func (h *Handler) routes() {
	m := http.NewServeMux()
	m.HandleFunc("GET /{$}", h.overview)
	m.HandleFunc("GET /live", h.live)
	m.HandleFunc("GET /held", h.withOperator(h.held))
	m.HandleFunc("GET /dead", h.withOperator(h.dead))
	m.HandleFunc("GET /records/{id}", h.withOperator(h.record))
	m.HandleFunc("GET /records/{id}/payload", h.withOperator(h.payload))
	m.HandleFunc("GET /redrive", h.withActions(h.redriveConfirm))
	m.HandleFunc("POST /redrive", h.withActions(h.withCSRF(h.redrive)))
	m.HandleFunc("GET /skip", h.withActions(h.skipConfirm))
	m.HandleFunc("POST /skip", h.withActions(h.withCSRF(h.skip)))
	m.HandleFunc("GET /static/{file}", h.static)
	h.mux = m
}

// withOperator serves a page that needs storage.Operator, or a page saying
// the storage lacks it.
func (h *Handler) withOperator(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if h.op == nil {
			h.renderError(w, r, http.StatusNotImplemented, "Not supported by this storage", h.opWhy+". Re-drive and skip are not available either.")
			return
		}
		next(w, r)
	}
}

// withActions refuses actions and their confirmation pages in a read-only
// console.
func (h *Handler) withActions(next http.HandlerFunc) http.HandlerFunc {
	return h.withOperator(func(w http.ResponseWriter, r *http.Request) {
		if !h.config.EnableActions {
			h.renderError(w, r, http.StatusForbidden, "Read-only console", "This console is read-only: the application did not turn on actions (console.Config.EnableActions).")
			return
		}
		next(w, r)
	})
}

// actor names who did an action, for the audit line.
func (h *Handler) actor(r *http.Request) string {
	if h.config.Actor != nil {
		if a := h.config.Actor(r); a != "" {
			return a
		}
	}
	return r.RemoteAddr
}
