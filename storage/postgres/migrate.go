package postgres

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/txoutbox/txoutbox/internal/migfiles"
	"github.com/txoutbox/txoutbox/storage"
)

// The schema as numbered steps: NNN_name.up.sql, and NNN_name.down.sql where
// reverting is safe. Placeholders: {table} is the outbox table as quoted in
// SQL; {rel:x} the object named after the table with suffix x, in the
// table's schema ("app"."outbox_leases"); {name:x} the same name unqualified
// (an index is created in its table's schema, so CREATE INDEX takes no
// schema).
//
//go:embed migrations/*.sql
var migrationFiles embed.FS

var loadSteps = sync.OnceValue(func() []migfiles.Step { return migfiles.Load(migrationFiles, "postgres") })

// SchemaLockTimeout bounds how long [Storage.Migrate] waits for a lock (its
// own advisory lock, or a table lock when a step or the notify trigger must
// be created) before it gives up with an error naming the table.
const SchemaLockTimeout = 10 * time.Second

// LatestVersion is the schema version this code needs and Migrate brings a
// database to.
func LatestVersion() int { return len(loadSteps()) }

// MigrationTable returns the version table, as quoted in SQL: the outbox
// table's name with the suffix "_migrations", in the same schema.
func (s *Storage) MigrationTable() string { return siblingName(s.ident, "migrations") }

// SkippedTable returns the table that keeps skipped records with their audit
// record ([Storage.Skip]), as quoted in SQL: the outbox table's name with the
// suffix "_skipped", in the same schema.
func (s *Storage) SkippedTable() string { return s.skipped }

var placeholderRE = regexp.MustCompile(`\{(table|rel:[a-z_]+|name:[a-z_]+)\}`)

// render fills the placeholders of a step for this storage's table.
func (s *Storage) render(text string) string {
	return placeholderRE.ReplaceAllStringFunc(text, func(m string) string {
		p := m[1 : len(m)-1]
		switch {
		case p == "table":
			return s.table
		case strings.HasPrefix(p, "rel:"):
			return siblingName(s.ident, p[4:])
		default:
			return pgx.Identifier{derivedName(s.ident, p[5:])}.Sanitize()
		}
	})
}

var createsRE = regexp.MustCompile(`CREATE (?:TABLE|INDEX) IF NOT EXISTS \{(table|rel:[a-z_]+|name:[a-z_]+)\}`)

// creates lists, as SQL string literals for to_regclass, the tables and
// indexes a step creates.
func (s *Storage) creates(st migfiles.Step) []string {
	var out []string
	for _, m := range createsRE.FindAllStringSubmatch(st.Up, -1) {
		p := m[1]
		switch {
		case p == "table":
			out = append(out, lit(s.table))
		case strings.HasPrefix(p, "rel:"):
			out = append(out, lit(siblingName(s.ident, p[4:])))
		default:
			out = append(out, lit(siblingName(s.ident, p[5:])))
		}
	}
	return out
}

func lit(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// Migrations implements [storage.Migrator]: the steps with their SQL for
// this storage's table, to export to golang-migrate, goose or Atlas. Every
// up step is idempotent (IF NOT EXISTS). The notify trigger is not a step:
// it depends on [Config.NotifyChannel], not on a version (see
// [Storage.TriggerSQL]).
func (s *Storage) Migrations() []storage.Migration {
	steps := loadSteps()
	out := make([]storage.Migration, len(steps))
	for i, st := range steps {
		out[i] = storage.Migration{Version: st.Version, Name: st.Name, Up: s.render(st.Up), Down: s.render(st.Down)}
	}
	return out
}

// TriggerSQL returns the DDL of the notify trigger for [Config.NotifyChannel]
// (empty without one): a function that sends one notification per INSERT
// statement, and the trigger that calls it. CREATE OR REPLACE TRIGGER needs
// PostgreSQL 14 or later.
func (s *Storage) TriggerSQL() string {
	ch := s.config.NotifyChannel
	if ch == "" {
		return ""
	}
	// The channel passed checkIdentifier, so it is safe inside a string literal.
	return fmt.Sprintf(`
-- LISTEN/NOTIFY wake-up: one notification per INSERT statement, not per row.
CREATE OR REPLACE FUNCTION %[1]s() RETURNS trigger LANGUAGE plpgsql AS $txoutbox$
BEGIN
    PERFORM pg_notify('%[2]s', '');
    RETURN NULL;
END
$txoutbox$;

CREATE OR REPLACE TRIGGER %[3]s AFTER INSERT ON %[4]s
    FOR EACH STATEMENT EXECUTE FUNCTION %[1]s();
`, siblingName(s.ident, "notify"), ch, pgx.Identifier{derivedName(s.ident, "notify_trg")}.Sanitize(), s.table)
}

// triggerOK is a SQL condition, true when the notify trigger is in place
// and its function notifies the configured channel (true without one).
func (s *Storage) triggerOK() string {
	ch := s.config.NotifyChannel
	if ch == "" {
		return "true"
	}
	return fmt.Sprintf(`(EXISTS (SELECT FROM pg_trigger WHERE tgrelid = to_regclass(%s) AND tgname = %s AND NOT tgisinternal)
    AND EXISTS (SELECT FROM pg_proc WHERE oid = to_regproc(%s) AND strpos(prosrc, %s) > 0))`,
		lit(s.table), lit(derivedName(s.ident, "notify_trg")), lit(siblingName(s.ident, "notify")), lit("pg_notify('"+ch+"'"))
}

// SchemaSQL returns the DDL of the latest schema: every up step of
// [Storage.Migrations] in order, then, with [Config.NotifyChannel] set, the
// notify trigger ([Storage.TriggerSQL]). Every statement is idempotent (IF
// NOT EXISTS / OR REPLACE), so the text can go into a migration tool as is.
// Run as a whole it locks the outbox table even when nothing changes;
// [Storage.Migrate] reads the catalog first and locks nothing when the
// database is up to date. The schema of a qualified table must already
// exist.
func (s *Storage) SchemaSQL() string {
	var b strings.Builder
	for _, m := range s.Migrations() {
		b.WriteString(m.Up)
		b.WriteString("\n")
	}
	b.WriteString(s.TriggerSQL())
	return b.String()
}

// CreateSchema is [Storage.Migrate], under the name it had before migrations
// were versioned.
func (s *Storage) CreateSchema(ctx context.Context) error { return s.Migrate(ctx) }

// Migrate implements [storage.Migrator]. It brings the database to
// [LatestVersion], recording each step in [Storage.MigrationTable], and
// creates the notify trigger when [Config.NotifyChannel] is set and the
// trigger is missing. It is safe to run from many processes at once, at
// every start, next to live traffic:
//
//   - a database at the latest version, with its trigger, is recognised
//     from the catalog and the version table alone: no DDL, no lock on the
//     outbox table;
//   - otherwise callers are serialised by a transaction-scoped advisory lock
//     keyed on the table's resolved schema-qualified name; the one holding it
//     re-reads the version and applies the missing steps in one
//     transaction, the others then find them applied;
//   - a step whose tables and indexes all exist already (a database made by
//     the CreateSchema of an earlier release, or from SchemaSQL) is recorded
//     without being run, so adopting such a database takes no table lock;
//   - every lock is waited for at most [SchemaLockTimeout], then Migrate
//     fails with an error saying so (a long transaction holds the table).
//
// The steps add tables, columns and indexes only; records, their ids and
// their order are untouched. Creating a new index on a large table blocks
// inserts while it builds: create it first by hand with CREATE INDEX
// CONCURRENTLY under the name [Storage.Migrations] shows, and Migrate then
// finds it and only records the step.
func (s *Storage) Migrate(ctx context.Context) error {
	_, err := s.MigrateReport(ctx)
	return err
}

// MigrateReport implements [storage.MigrateReporter]: it is
// [Storage.Migrate], returning the versions of the steps this call applied.
func (s *Storage) MigrateReport(ctx context.Context) (applied []int, err error) {
	steps := loadSteps()
	upToDate := fmt.Sprintf(`SELECT (SELECT max(version) FROM %s) IS NOT DISTINCT FROM %d AND %s`,
		s.MigrationTable(), len(steps), s.triggerOK())
	// The fast path: catalog reads and the version table only, when it
	// exists (a query naming a missing table fails to plan).
	var exists bool
	if err := s.pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, s.MigrationTable()).Scan(&exists); err != nil {
		return nil, fmt.Errorf("migrate outbox schema %s: read the catalog: %w", s.table, err)
	}
	if exists {
		var ok bool
		if err := s.pool.QueryRow(ctx, upToDate).Scan(&ok); err != nil {
			return nil, fmt.Errorf("migrate outbox schema %s: read the version: %w", s.table, err)
		}
		if ok {
			return nil, nil
		}
	}

	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrate outbox schema %s: %w", s.table, err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	fail := func(what string, err error) error {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55P03" {
			return fmt.Errorf("migrate outbox schema %s: %s: no lock within %s (a long transaction holds the table; retry later): %w", s.table, what, SchemaLockTimeout, err)
		}
		return fmt.Errorf("migrate outbox schema %s: %s: %w", s.table, what, err)
	}
	if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL lock_timeout = %d", SchemaLockTimeout.Milliseconds())); err != nil {
		return nil, fail("set lock_timeout", err)
	}
	if err := s.lockSchema(ctx, tx); err != nil {
		return nil, fail("advisory lock", err)
	}
	if _, err := tx.Exec(ctx, fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
    version    INTEGER     PRIMARY KEY,
    name       TEXT        NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
)`, s.MigrationTable())); err != nil {
		return nil, fail("create the version table", err)
	}
	var current int
	if err := tx.QueryRow(ctx, fmt.Sprintf(`SELECT COALESCE(max(version), 0) FROM %s`, s.MigrationTable())).Scan(&current); err != nil {
		return nil, fail("read the version", err)
	}
	if current > len(steps) {
		return nil, fmt.Errorf("migrate outbox schema %s: the database is at version %d, newer than this code's %d: upgrade txoutbox", s.table, current, len(steps))
	}
	for _, st := range steps[current:] {
		objs := s.creates(st)
		present := false
		if len(objs) > 0 {
			if err := tx.QueryRow(ctx, fmt.Sprintf(`SELECT %s`, notNull(objs))).Scan(&present); err != nil {
				return nil, fail(fmt.Sprintf("step %d (%s): read the catalog", st.Version, st.Name), err)
			}
		}
		if !present {
			// Simple protocol: a step is several statements.
			if _, err := tx.Exec(ctx, s.render(st.Up), pgx.QueryExecModeSimpleProtocol); err != nil {
				return nil, fail(fmt.Sprintf("step %d (%s)", st.Version, st.Name), err)
			}
		}
		if _, err := tx.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (version, name) VALUES ($1, $2)`, s.MigrationTable()), st.Version, st.Name); err != nil {
			return nil, fail(fmt.Sprintf("record step %d", st.Version), err)
		}
		applied = append(applied, st.Version)
	}
	if s.config.NotifyChannel != "" {
		var ok bool
		if err := tx.QueryRow(ctx, `SELECT `+s.triggerOK()).Scan(&ok); err != nil {
			return nil, fail("read the notify trigger", err)
		}
		// Only when missing (or notifying another channel): creating a
		// trigger locks the outbox table (SHARE ROW EXCLUSIVE), which at
		// every start, next to an open producer transaction and a
		// concurrent CREATE INDEX, deadlocked.
		if !ok {
			if _, err := tx.Exec(ctx, s.TriggerSQL(), pgx.QueryExecModeSimpleProtocol); err != nil {
				return nil, fail("create the notify trigger", err)
			}
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fail("commit", err)
	}
	return applied, nil
}

// notNull is a SQL condition true when every named relation exists.
func notNull(rels []string) string {
	conds := make([]string, len(rels))
	for i, r := range rels {
		conds[i] = fmt.Sprintf("to_regclass(%s) IS NOT NULL", r)
	}
	return strings.Join(conds, " AND ")
}

// lockSchema takes Migrate's advisory lock, keyed on a hash of the table's
// schema-qualified name as the server resolves it (the schema it is in, or
// the one it would be created in), so that "outbox" and "public.outbox"
// take the same lock.
func (s *Storage) lockSchema(ctx context.Context, tx pgx.Tx) error {
	var schema *string
	if len(s.ident) == 2 {
		schema = &s.ident[0]
	}
	_, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('txoutbox schema ' || COALESCE($1::text,
    (SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($3::text)),
    current_schema()::text, '') || '.' || $2::text, 0))`, schema, s.ident[len(s.ident)-1], s.table)
	return err
}

// MigrationStatus implements [storage.Migrator]. A database without the
// version table is at version 0.
func (s *Storage) MigrationStatus(ctx context.Context) (storage.MigrationStatus, error) {
	st := storage.MigrationStatus{Latest: LatestVersion()}
	var exists bool
	if err := s.pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, s.MigrationTable()).Scan(&exists); err != nil {
		return st, fmt.Errorf("read outbox schema version of %s: %w", s.table, err)
	}
	if !exists {
		return st, nil
	}
	rows, err := s.pool.Query(ctx, fmt.Sprintf(`SELECT version, name, applied_at FROM %s ORDER BY version`, s.MigrationTable()))
	if err != nil {
		return st, fmt.Errorf("read outbox schema version of %s: %w", s.table, err)
	}
	applied, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (storage.AppliedMigration, error) {
		var m storage.AppliedMigration
		err := r.Scan(&m.Version, &m.Name, &m.AppliedAt)
		return m, err
	})
	if err != nil {
		return st, fmt.Errorf("read outbox schema version of %s: %w", s.table, err)
	}
	st.Applied = applied
	for _, m := range applied {
		st.Current = max(st.Current, m.Version)
	}
	return st, nil
}
