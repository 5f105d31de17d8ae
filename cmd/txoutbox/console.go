package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/txoutbox/txoutbox/console"
)

// envConsolePassword turns on HTTP basic auth for `txoutbox console`.
const envConsolePassword = "TXOUTBOX_CONSOLE_PASSWORD" //nolint:gosec // the name of an environment variable, not a credential

var cmdConsole = &command{
	name:    "console",
	summary: "serve the web console: overview, held keys, dead letters; re-drive and skip with --actions",
	details: "Serves the same pages a service gets by mounting console.New (see docs/console.md) until\n" +
		"interrupted. Read-only unless --actions is given; every action asks for a confirmation\n" +
		"and writes an audit line to stderr.\n\n" +
		"Without $" + envConsolePassword + " only clients on the loopback interface are served\n" +
		"(reach it through an SSH tunnel), and --listen must be a loopback address. With it set,\n" +
		"every request needs HTTP basic auth with that password (any user name, which the audit\n" +
		"lines record); put TLS in front when it leaves the host.",
	example:  "txoutbox console --listen 127.0.0.1:8080 --actions --hold-on-dead-letter",
	withHold: true,
	flags: func(fs *flag.FlagSet) {
		fs.String("listen", "127.0.0.1:8080", "address to serve on (host:port)")
		fs.Bool("actions", false, "turn on re-drive and skip (default: read-only)")
		fs.String("prefix", "", "serve under this path, e.g. /outbox (default: the root)")
		fs.Duration("sample-interval", console.SampleIntervalDefault, "how often the overview samples the stats for its chart")
	},
	run: runConsole,
}

func runConsole(ctx context.Context, e *env) error {
	fs := e.flagSet()
	addr, prefix, actions := fs.string("listen"), fs.string("prefix"), fs.bool("actions")
	password := os.Getenv(envConsolePassword)
	if password == "" && !loopbackAddr(addr) {
		return usageError{fmt.Sprintf("console: --listen %s serves other hosts: set %s to require a password, or listen on 127.0.0.1 and use an SSH tunnel", addr, envConsolePassword)}
	}
	b, err := e.open(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = b.close() }()

	// Audit lines on stderr, as slog's text lines: it quotes any value with
	// a space, a quote or an equals sign, so a value cannot pass for another
	// field (Watermill's StdLogger only wraps values with spaces in quotes),
	// and the console escapes control characters before.
	logger := auditLogger{slog.New(slog.NewTextHandler(e.errOut, nil)), nil}
	cfg := console.Config{
		Authorize:      loopbackClient,
		EnableActions:  actions,
		Prefix:         prefix,
		SampleInterval: fs.duration("sample-interval"),
		Title:          "txoutbox: " + e.opts.table,
		Actor: func(r *http.Request) string {
			if user, _, ok := r.BasicAuth(); ok {
				return user + "@" + r.RemoteAddr
			}
			return r.RemoteAddr
		},
	}
	if password != "" {
		cfg.Authorize = console.AllowAll // behind basicAuth below
	}
	h, err := console.New(b.op, cfg, logger)
	if err != nil {
		return usageError{err.Error()}
	}
	defer func() { _ = h.Close() }()
	handler := loopbackOnly(h)
	if password != "" {
		handler = basicAuth(password, h)
	}

	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("console: %w", err)
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: time.Minute,
		WriteTimeout: 2 * time.Minute, IdleTimeout: 2 * time.Minute}
	mode := "read-only"
	if actions {
		mode = "actions on"
	}
	serving := fmt.Sprintf("http://%s%s/", ln.Addr(), prefix)
	if err := e.emit(map[string]any{"url": serving, "actions": actions}, func(w io.Writer) {
		fmt.Fprintf(w, "txoutbox console: serving %s (%s); interrupt to stop\n", serving, mode)
	}); err != nil {
		_ = ln.Close()
		return err
	}

	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err = <-served:
		return fmt.Errorf("console: %w", err)
	case <-ctx.Done():
	}
	// ctx is done: the shutdown gets a few seconds of its own.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
	}
	if err := <-served; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("console: %w", err)
	}
	return nil
}

// loopbackAddr reports whether a listen address serves this host only.
func loopbackAddr(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// loopbackClient is the console's Authorize without a password: clients on
// this host only (an SSH tunnel arrives from the loopback interface).
func loopbackClient(r *http.Request) bool {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// forwardingHeaders are what a reverse proxy adds to the requests it passes
// on (Caddy, Apache, Traefik and most nginx set-ups add one or more).
var forwardingHeaders = []string{"Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto", "X-Real-Ip", "Via"}

// loopbackOnly is the gate of a console without a password, which trusts
// the client's address. It serves only requests that come straight from
// this host and name it: a client address on the loopback interface is not
// enough on its own.
//
//   - A web page the operator opens can rebind its own name to 127.0.0.1
//     (DNS rebinding): the browser then connects to the console, sends the
//     page's cookies-free requests with Host set to the attacker's name, and
//     lets the page read the answers, since for the browser they come from
//     the page's own origin. The console therefore answers only a Host that
//     is a loopback address or "localhost" (on any port: an SSH tunnel's
//     local port may differ from --listen's).
//   - A reverse proxy on the same host connects from 127.0.0.1 on behalf of
//     every client it serves. A request carrying a forwarding header is
//     refused; a proxy that adds none (nginx's default proxy_pass) cannot
//     be told apart, which docs/console.md warns about.
func loopbackOnly(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		refuse := func(why string) {
			w.Header().Set("X-Content-Type-Options", "nosniff")
			w.Header().Set("Cache-Control", "no-store")
			http.Error(w, "403 forbidden: "+why, http.StatusForbidden)
		}
		if !loopbackClient(r) {
			refuse("without " + envConsolePassword + " the console serves clients on this host only (use an SSH tunnel)")
			return
		}
		for _, h := range forwardingHeaders {
			if r.Header.Get(h) != "" {
				refuse("this request came through a proxy (it has a " + h + " header). Without " + envConsolePassword +
					" the console trusts the client's address, which a proxy on this host makes 127.0.0.1 for everyone: set " +
					envConsolePassword + " to serve it behind a proxy")
				return
			}
		}
		if !loopbackHost(r.Host) {
			refuse("the Host header does not name this host. Open the console at http://127.0.0.1:PORT/ or http://localhost:PORT/; " +
				"another name is what a web page uses to reach a console on your machine (DNS rebinding)")
			return
		}
		next.ServeHTTP(w, r)
	})
}

// loopbackHost reports whether a Host header names this host: "localhost"
// or a loopback address, with or without a port.
func loopbackHost(host string) bool {
	name := host
	if h, _, err := net.SplitHostPort(host); err == nil {
		name = h
	} else if strings.HasPrefix(host, "[") && strings.HasSuffix(host, "]") {
		name = host[1 : len(host)-1]
	}
	if strings.EqualFold(name, "localhost") {
		return true
	}
	ip := net.ParseIP(name)
	return ip != nil && ip.IsLoopback()
}

// basicAuth asks for the password with HTTP basic auth, compared in
// constant time.
func basicAuth(password string, next http.Handler) http.Handler {
	want := sha256.Sum256([]byte(password))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, got, ok := r.BasicAuth()
		sum := sha256.Sum256([]byte(got))
		if !ok || subtle.ConstantTimeCompare(sum[:], want[:]) != 1 {
			w.Header().Set("WWW-Authenticate", `Basic realm="txoutbox console", charset="UTF-8"`)
			http.Error(w, "401 unauthorised", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// auditLogger is the console's logger: slog's text lines on stderr, with
// the fields in the order of their names (Watermill's slog adapter passes
// them in map order, which changes from line to line).
type auditLogger struct {
	l      *slog.Logger
	fields watermill.LogFields
}

func (a auditLogger) log(level slog.Level, msg string, err error, fields watermill.LogFields) {
	all := a.fields.Add(fields)
	args := make([]any, 0, 2*len(all)+2)
	for _, k := range slices.Sorted(maps.Keys(all)) {
		args = append(args, k, all[k])
	}
	if err != nil {
		args = append(args, "error", err)
	}
	a.l.Log(context.Background(), level, msg, args...)
}

func (a auditLogger) Error(msg string, err error, fields watermill.LogFields) {
	a.log(slog.LevelError, msg, err, fields)
}
func (a auditLogger) Info(msg string, fields watermill.LogFields) {
	a.log(slog.LevelInfo, msg, nil, fields)
}
func (a auditLogger) Debug(string, watermill.LogFields) {}
func (a auditLogger) Trace(string, watermill.LogFields) {}
func (a auditLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return auditLogger{a.l, a.fields.Add(fields)}
}
