package main

import (
	"context"
	"errors"
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
// The errors of its storage come redacted.
type backend struct {
	op      storage.Operator
	mig     storage.Migrator
	migrate func(ctx context.Context) (applied []int, err error) // storage.MigrateReporter
	diag    storage.Diagnoser
	// inbox is the inbox table beside the outbox table.
	inbox storage.InboxStore
	// tableExists reports whether the outbox table is there.
	tableExists func(ctx context.Context) (bool, error)
	table       string // as the storage names it in SQL
	close       func() error
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
	if err := checkURL(o.url); err != nil {
		return nil, err
	}
	var (
		b   *backend
		err error
	)
	scheme, _, _ := strings.Cut(o.url, ":")
	switch strings.ToLower(scheme) {
	case "sqlite", "file":
		b, err = openSQLite(ctx, o)
	case "postgres", "postgresql":
		b, err = openPostgres(ctx, o)
	case "mysql":
		b, err = openMySQL(ctx, o)
	default:
		return nil, usageError{fmt.Sprintf("database URL scheme %q: want sqlite:///path/to.db, file:path/to.db, postgres:// or mysql://", scheme)}
	}
	if err != nil {
		return nil, err
	}
	if !o.skipSchemaCheck {
		if err := checkSchema(ctx, b); err != nil {
			_ = b.close()
			return nil, err
		}
	}
	return b, nil
}

var schemeRE = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.\-]*$`)

// checkURL refuses, before any driver parses it, a database URL a driver
// would misread into an error that quotes part of its password: one
// without a scheme (a key=value connection string), one whose user or
// password holds an unescaped @ (or a / that makes the rest of it a path),
// one that does not parse. Its errors never quote the URL.
func checkURL(raw string) error {
	scheme, rest, ok := strings.Cut(raw, ":")
	if !ok || !schemeRE.MatchString(scheme) {
		return usageError{"the database URL has no scheme: write sqlite:///path/to.db, postgres://user:password@host:5432/db or mysql://user:password@host:3306/db (a key=value connection string is not accepted)"}
	}
	if mysqlDSNForm.MatchString(strings.TrimPrefix(rest, "//")) {
		return nil // the MySQL driver's own DSN: it reads user:password up to the last @
	}
	if !strings.HasPrefix(rest, "//") {
		return nil // sqlite:path, file:path: no user or password
	}
	authority := rest[2:]
	if i := strings.IndexAny(authority, "/?#"); i >= 0 {
		// user:pa/ss@host parses as host "user", port "pa", path "/ss@host":
		// a port that is not a number, and an @ after it.
		head := authority[:i]
		_, port, hasPort := strings.Cut(head, ":")
		if hasPort && !strings.Contains(head, "@") && !strings.Contains(head, "[") && strings.Contains(authority[i:], "@") &&
			strings.Trim(port, "0123456789") != "" {
			return usageError{"the database URL's password holds an unescaped /, ? or #: percent-encode it (%2F, %3F, %23)"}
		}
		authority = authority[:i]
	}
	if strings.Count(authority, "@") > 1 {
		return usageError{"the database URL's user or password holds an unescaped @: percent-encode it as %40"}
	}
	if _, err := url.Parse(raw); err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // url.Error quotes the URL
		}
		return usageError{fmt.Sprintf("database URL: %v (percent-encode the special characters of the password)", err)}
	}
	return nil
}

// sqlitePath returns the file name of a sqlite:///path, sqlite:path or
// file:path URL; a query string is ignored (the command sets its own).
func sqlitePath(raw string) (string, error) {
	rest := raw[strings.Index(raw, ":")+1:]
	if strings.HasPrefix(rest, "//") {
		u, err := url.Parse(raw)
		if err != nil {
			var ue *url.Error
			if errors.As(err, &ue) {
				err = ue.Err // url.Error quotes the URL
			}
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
	b.tableExists = func(ctx context.Context) (bool, error) {
		var n int
		err := db.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?`, s.Table()).Scan(&n)
		return n > 0, redactErr(err)
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
	// pgbouncer=true is how Prisma, and many DATABASE_URLs after it, mark a
	// transaction-mode pooler: no prepared statement may outlive its
	// transaction. It is not a server setting (pgx would send it as one,
	// and the server refuse it); the command's simple protocol below is
	// what it asks for. doctor still reads it from the URL.
	delete(cfg.ConnConfig.RuntimeParams, "pgbouncer")
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
	b.tableExists = func(ctx context.Context) (bool, error) {
		var ok bool
		err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, s.Table()).Scan(&ok)
		return ok, redactErr(err)
	}
	return b, nil
}

// checkSchema refuses to work on a table that is not there, or whose
// schema is not the one this build works with.
func checkSchema(ctx context.Context, b *backend) error {
	ok, err := b.tableExists(ctx)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("outbox table %s does not exist in this database: check --table (the default is outbox) and the database URL", b.table)
	}
	st, err := b.mig.MigrationStatus(ctx)
	if err != nil {
		return err
	}
	switch {
	case st.Current > st.Latest:
		return fmt.Errorf("outbox schema is at version %d, newer than this build's %d: use the txoutbox release that migrated it, or a later one", st.Current, st.Latest)
	case st.Current == 0:
		return fmt.Errorf("outbox table %s has no schema version recorded (made by hand, or by a release before versioning): run `txoutbox migrate up` to record it and add what it lacks", b.table)
	case st.Current < st.Latest:
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
	storage.MigrateReporter
	storage.Diagnoser
	Table() string
	Inbox() storage.InboxStore
}, closeFn func() error) *backend {
	return &backend{op: redactingOperator{s}, mig: redactingMigrator{s}, diag: redactingDiagnoser{s}, close: closeFn, table: s.Table(),
		inbox: s.Inbox(),
		migrate: func(ctx context.Context) ([]int, error) {
			applied, err := s.MigrateReport(ctx)
			return applied, redactErr(err)
		}}
}
