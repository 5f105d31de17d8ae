package main

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"strings"
	"time"

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
	url             string
	table           string
	hold            bool
	notifyChannel   string // PostgreSQL: the forwarders' Config.NotifyChannel
	create          bool   // the command may create the database (migrate up)
	skipSchemaCheck bool   // the command works on an old schema (migrate, doctor)
	jsonOut         bool
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
		return nil, redactErr(err)
	}
	s, err := sqlite.New(db, sqlite.Config{Table: o.table, HoldOnDeadLetter: o.hold})
	if err != nil {
		_ = db.Close()
		return nil, usageError{err.Error()}
	}
	b := newBackend(s, db.Close)
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
		return nil, nil, usageError{fmt.Sprintf("database URL: %v", redactErr(err))}
	}
	cfg.MaxConns = 4
	// The simple protocol (parameters interpolated by pgx, quoted): no
	// prepared statement outlives its statement, so the command works
	// through a transaction-mode pooler too, which doctor reports.
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	cfg.ConnConfig.RuntimeParams["application_name"] = "txoutbox"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, redactErr(err)
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
		return nil, fmt.Errorf("connect to PostgreSQL: %w", redactErr(err))
	}
	b := newBackend(s, func() error { pool.Close(); return nil })
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

// redacted replaces a password.
const redacted = "xxxxx"

var (
	// The password part of a URL (scheme://user:password@), up to the last
	// @ before the next slash or space: a password may hold an unescaped @.
	urlPasswordRE = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@]*:)([^\s/]*)@`)
	// The MySQL driver's DSN: user:password@tcp(host:3306)/db.
	dsnPasswordRE = regexp.MustCompile(`((?:^|[\s"'(\x60])[^\s:/@"'(\x60]*:)([^\s/]*)@((?:tcp|tcp4|tcp6|unix)\()`)
	// password=... in a key/value connection string or a query string.
	kvPasswordRE = regexp.MustCompile(`(?i)(password\s*=\s*)('[^']*'|[^\s&;]*)`)
)

// redact hides the passwords of the URLs and DSNs in s: the password part
// of any URL and of the MySQL driver's DSN form, and password=... settings.
// It is for text from outside the command (errors of drivers and storages,
// findings), where a URL or DSN can appear; the command's own text and the
// records' data are never rewritten, so a password that is also a word
// ("true", "dead", "postgres") changes nothing else.
func redact(s string) string {
	s = urlPasswordRE.ReplaceAllString(s, "${1}"+redacted+"@")
	s = dsnPasswordRE.ReplaceAllString(s, "${1}"+redacted+"@${3}")
	return kvPasswordRE.ReplaceAllString(s, "${1}"+redacted)
}

// redactedError is err with its text redacted; errors.Is and errors.As
// still see the error it wraps (a usageError, a storage sentinel).
type redactedError struct {
	msg string
	err error
}

func (e redactedError) Error() string { return e.msg }
func (e redactedError) Unwrap() error { return e.err }

// redactErr redacts the text of an error from outside the command.
func redactErr(err error) error {
	if err == nil {
		return nil
	}
	return redactedError{redact(err.Error()), err}
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

// The storages behind a backend, with the text of their errors redacted.

type redactingOperator struct{ storage.Operator }

func (o redactingOperator) Stats(ctx context.Context) (storage.Stats, error) {
	s, err := o.Operator.Stats(ctx)
	return s, redactErr(err)
}

func (o redactingOperator) HeldKeys(ctx context.Context, p storage.HeldKeysParams) ([]storage.HeldKey, error) {
	h, err := o.Operator.HeldKeys(ctx, p)
	return h, redactErr(err)
}

func (o redactingOperator) ListDead(ctx context.Context, p storage.ListDeadParams) ([]storage.RecordInfo, error) {
	r, err := o.Operator.ListDead(ctx, p)
	return r, redactErr(err)
}

func (o redactingOperator) Record(ctx context.Context, id int64) (storage.RecordInfo, error) {
	r, err := o.Operator.Record(ctx, id)
	return r, redactErr(err)
}

func (o redactingOperator) Redrive(ctx context.Context, p storage.RedriveParams) (int64, error) {
	n, err := o.Operator.Redrive(ctx, p)
	return n, redactErr(err)
}

func (o redactingOperator) Skip(ctx context.Context, p storage.SkipParams) error {
	return redactErr(o.Operator.Skip(ctx, p))
}

func (o redactingOperator) Purge(ctx context.Context, d time.Duration) (int64, error) {
	n, err := o.Operator.Purge(ctx, d)
	return n, redactErr(err)
}

type redactingMigrator struct{ storage.Migrator }

func (m redactingMigrator) Migrate(ctx context.Context) error {
	return redactErr(m.Migrator.Migrate(ctx))
}

func (m redactingMigrator) MigrationStatus(ctx context.Context) (storage.MigrationStatus, error) {
	st, err := m.Migrator.MigrationStatus(ctx)
	return st, redactErr(err)
}

type redactingDiagnoser struct{ storage.Diagnoser }

func (d redactingDiagnoser) Diagnose(ctx context.Context) ([]storage.Finding, error) {
	fs, err := d.Diagnoser.Diagnose(ctx)
	for i := range fs {
		fs[i].Message = redact(fs[i].Message)
	}
	return fs, redactErr(err)
}

// newBackend wraps the storage s, which implements what the command needs.
func newBackend(s interface {
	storage.Operator
	storage.Migrator
	storage.Diagnoser
}, closeFn func() error) *backend {
	return &backend{op: redactingOperator{s}, mig: redactingMigrator{s}, diag: redactingDiagnoser{s}, close: closeFn}
}
