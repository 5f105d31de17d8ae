package main

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/postgres"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// backend is an opened outbox table with what the command needs of it.
type backend struct {
	op    storage.Operator
	mig   storage.Migrator
	diag  storage.Diagnoser // nil when the storage has no checks
	close func() error
}

// options are the flags every command shares.
type options struct {
	url              string
	table            string
	hold             bool
	notifyChannel    string // PostgreSQL: the forwarders' Config.NotifyChannel
	create           bool   // the command may create the database (migrate up)
	skipSchemaCheck  bool   // the command works on an old schema (migrate, doctor)
	jsonOut          bool
	passwordRedactor *redactor
}

// open opens the outbox table the URL names. The storage comes from the
// scheme; wiring another storage is one case here once it implements
// storage.Operator and storage.Migrator. A PostgreSQL URL is handed to pgx
// as is (postgres://user:password@host:5432/db?sslmode=...).
func open(ctx context.Context, o options) (*backend, error) {
	if o.url == "" {
		return nil, usageError{"no database URL: set --database-url or TXOUTBOX_DATABASE_URL"}
	}
	scheme, _, _ := strings.Cut(o.url, ":")
	switch strings.ToLower(scheme) {
	case "sqlite", "file":
		return openSQLite(ctx, o)
	case "postgres", "postgresql":
		return openPostgres(ctx, o)
	case "mysql":
		return openMySQL(ctx, o)
	default:
		return nil, usageError{fmt.Sprintf("database URL scheme %q: want sqlite:///path/to.db, file:path/to.db, postgres:// or mysql://", scheme)}
	}
}

// sqlitePath returns the file name of a sqlite:///path, sqlite:path or
// file:path URL; a query string is ignored (the command sets its own).
func sqlitePath(raw string) (string, error) {
	rest := raw[strings.Index(raw, ":")+1:]
	if strings.HasPrefix(rest, "//") {
		u, err := url.Parse(raw)
		if err != nil {
			return "", usageError{fmt.Sprintf("database URL: %v", err)}
		}
		if u.Host != "" && u.Host != "localhost" {
			return "", usageError{fmt.Sprintf("sqlite URL with host %q: write sqlite:///absolute/path.db or sqlite:relative/path.db", u.Host)}
		}
		rest = u.Path
	} else if i := strings.IndexByte(rest, '?'); i >= 0 {
		rest = rest[:i]
	}
	if rest == "" || rest == ":memory:" {
		return "", usageError{"sqlite URL without a file name: write sqlite:///absolute/path.db"}
	}
	return rest, nil
}

func openSQLite(ctx context.Context, o options) (*backend, error) {
	path, err := sqlitePath(o.url)
	if err != nil {
		return nil, err
	}
	if !o.create {
		if _, err := os.Stat(path); err != nil {
			return nil, fmt.Errorf("sqlite database %s: %w (run `txoutbox migrate up` to create it)", path, err)
		}
	}
	db, err := sqlite.Open(path)
	if err != nil {
		return nil, err
	}
	s, err := sqlite.New(db, sqlite.Config{Table: o.table, HoldOnDeadLetter: o.hold})
	if err != nil {
		_ = db.Close()
		return nil, usageError{err.Error()}
	}
	b := &backend{op: s, mig: s, diag: s, close: db.Close}
	if !o.skipSchemaCheck {
		if err := checkSchema(ctx, b.mig); err != nil {
			_ = db.Close()
			return nil, err
		}
	}
	return b, nil
}

// postgresStorage returns a storage over a pool for the URL; the pool
// connects on first use only.
func postgresStorage(ctx context.Context, o options) (*postgres.Storage, *pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(o.url)
	if err != nil {
		return nil, nil, usageError{fmt.Sprintf("database URL: %v", err)}
	}
	cfg.MaxConns = 4
	// The simple protocol (parameters interpolated by pgx, quoted): no
	// prepared statement outlives its statement, so the command works
	// through a transaction-mode pooler too, which doctor reports.
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	cfg.ConnConfig.RuntimeParams["application_name"] = "txoutbox"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, err
	}
	s, err := postgres.New(pool, postgres.Config{Table: o.table, HoldOnDeadLetter: o.hold, NotifyChannel: o.notifyChannel})
	if err != nil {
		pool.Close()
		return nil, nil, usageError{err.Error()}
	}
	return s, pool, nil
}

func openPostgres(ctx context.Context, o options) (*backend, error) {
	s, pool, err := postgresStorage(ctx, o)
	if err != nil {
		return nil, err
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	b := &backend{op: s, mig: s, diag: s, close: func() error { pool.Close(); return nil }}
	if !o.skipSchemaCheck {
		if err := checkSchema(ctx, b.mig); err != nil {
			pool.Close()
			return nil, err
		}
	}
	return b, nil
}

// checkSchema refuses to work on a table whose schema is not the latest.
func checkSchema(ctx context.Context, m storage.Migrator) error {
	st, err := m.MigrationStatus(ctx)
	if err != nil {
		return err
	}
	if st.Current != st.Latest {
		return fmt.Errorf("outbox schema is at version %d, this build works with version %d: run `txoutbox migrate up` (or `txoutbox doctor`)", st.Current, st.Latest)
	}
	return nil
}

// redactor hides the password of the database URL, and of any URL or
// password=... setting, in text the command writes.
type redactor struct {
	secrets []string
}

const redacted = "xxxxx"

var (
	urlPasswordRE = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@]*:)([^\s@/]*)@`)
	kvPasswordRE  = regexp.MustCompile(`(?i)(password\s*=\s*)('[^']*'|[^\s&;]*)`)
)

func newRedactor(rawURL string) *redactor {
	r := &redactor{}
	if u, err := url.Parse(rawURL); err == nil && u.User != nil {
		if p, ok := u.User.Password(); ok && p != "" {
			r.secrets = append(r.secrets, p, url.QueryEscape(p), url.PathEscape(p))
		}
	}
	if scheme, _, _ := strings.Cut(rawURL, ":"); strings.EqualFold(scheme, "mysql") {
		if cfg, err := mysqlConfig(rawURL); err == nil && cfg.Passwd != "" {
			r.secrets = append(r.secrets, cfg.Passwd, url.QueryEscape(cfg.Passwd), url.PathEscape(cfg.Passwd))
		}
	}
	if u, err := url.Parse(rawURL); err == nil {
		if p := u.Query().Get("password"); p != "" {
			r.secrets = append(r.secrets, p, url.QueryEscape(p))
		}
	}
	return r
}

// redact returns s with every password replaced by xxxxx.
func (r *redactor) redact(s string) string {
	s = urlPasswordRE.ReplaceAllString(s, "${1}"+redacted+"@")
	s = kvPasswordRE.ReplaceAllString(s, "${1}"+redacted)
	if r != nil {
		for _, secret := range r.secrets {
			if len(secret) >= 3 { // a one- or two-letter password would blank out ordinary text
				s = strings.ReplaceAll(s, secret, redacted)
			}
		}
	}
	return s
}

// redactingWriter redacts everything written through it. The command writes
// whole lines or whole tables at a time, so a URL is never split between
// two writes.
type redactingWriter struct {
	w interface{ Write([]byte) (int, error) }
	r *redactor
}

func (w redactingWriter) Write(p []byte) (int, error) {
	if _, err := w.w.Write([]byte(w.r.redact(string(p)))); err != nil {
		return 0, err
	}
	return len(p), nil
}

// displayURL is the URL as shown to the operator, without its password.
func displayURL(raw string, r *redactor) string {
	if u, err := url.Parse(raw); err == nil && u.User != nil {
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), redacted)
			return r.redact(u.String())
		}
	}
	return r.redact(raw)
}

// urlFindings are the doctor's checks of the URL alone, before connecting:
// for PostgreSQL, whether it points at a transaction-mode pooler (PgBouncer,
// Supavisor), where LISTEN does not work and session state does not last.
// The storages' own checks come from storage.Diagnoser.
func urlFindings(raw string) []storage.Finding {
	u, err := url.Parse(raw)
	if err != nil {
		return nil
	}
	switch strings.ToLower(u.Scheme) {
	case "postgres", "postgresql":
		host := strings.ToLower(u.Hostname())
		q := u.Query()
		var why []string
		if u.Port() == "6543" {
			why = append(why, "port 6543 is the transaction-mode port of Supavisor and of many PgBouncer set-ups")
		}
		if strings.Contains(host, "pooler") || strings.Contains(host, "pgbouncer") {
			why = append(why, fmt.Sprintf("host %s names a pooler", host))
		}
		if strings.EqualFold(q.Get("pgbouncer"), "true") {
			why = append(why, "pgbouncer=true is set")
		}
		if len(why) > 0 {
			return []storage.Finding{{Check: "connection pooler", Severity: storage.SeverityWarning,
				Message: strings.Join(why, "; ") + ": LISTEN/NOTIFY needs a direct (session) connection; give the listener the direct URL"}}
		}
		return []storage.Finding{{Check: "connection pooler", Severity: storage.SeverityOK, Message: "the URL does not look like a transaction-mode pooler"}}
	}
	return nil
}
