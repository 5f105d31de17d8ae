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
// reverting is safe and every later step has one (see migfiles.Load).
// Placeholders: {table} is the outbox table as quoted in SQL; {rel:x} the
// object named after the table with suffix x, in the table's schema
// ("app"."outbox_leases"); {name:x} the same name unqualified (an index is
// created in its table's schema, so CREATE INDEX takes no schema).
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

var (
	createsRE    = regexp.MustCompile(`CREATE (?:TABLE|INDEX) IF NOT EXISTS \{(table|rel:[a-z_]+|name:[a-z_]+)\}`)
	addsColumnRE = regexp.MustCompile(`ALTER TABLE \{table\} ADD COLUMN IF NOT EXISTS ([a-z_]+)`)
	// createIndexRE is one CREATE INDEX statement of a step, up to its
	// semicolon (an index definition holds none).
	createIndexRE = regexp.MustCompile(`CREATE INDEX IF NOT EXISTS \{name:([a-z_]+)\} ON [^;]*;`)
)

// present is a SQL condition, true when every table, index and column the
// step creates is there; "" when the step creates nothing Migrate can look
// for. Only a table made without the version table is judged by it.
func (s *Storage) present(st migfiles.Step) string {
	var conds []string
	for _, m := range createsRE.FindAllStringSubmatch(st.Up, -1) {
		rel := s.table
		switch p := m[1]; {
		case strings.HasPrefix(p, "rel:"):
			rel = siblingName(s.ident, p[4:])
		case strings.HasPrefix(p, "name:"):
			rel = siblingName(s.ident, p[5:])
		}
		conds = append(conds, fmt.Sprintf("to_regclass(%s) IS NOT NULL", lit(rel)))
	}
	for _, m := range addsColumnRE.FindAllStringSubmatch(st.Up, -1) {
		conds = append(conds, fmt.Sprintf("EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = %s AND NOT attisdropped)",
			lit(s.table), lit(m[1])))
	}
	return strings.Join(conds, " AND ")
}

func lit(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// Migrations implements [storage.Migrator]: the steps with their SQL for
// this storage's table, to export to golang-migrate, goose or Atlas. Every
// up step is idempotent (IF NOT EXISTS). The notify trigger is not a step:
// it depends on [Config.NotifyChannel], not on a version (see
// [Storage.TriggerSQL]).
//
// Each step ends by recording itself in [Storage.MigrationTable] (creating
// it when missing), and each down step by deleting its row, so that a
// schema made from this SQL by another tool, or by hand, is at the version
// it represents for Migrate, MigrationStatus and the txoutbox command.
func (s *Storage) Migrations() []storage.Migration {
	steps := loadSteps()
	out := make([]storage.Migration, len(steps))
	for i, st := range steps {
		m := storage.Migration{Version: st.Version, Name: st.Name, Up: s.render(st.Up) + s.recordSQL(st)}
		if st.Down != "" {
			m.Down = s.render(st.Down) + fmt.Sprintf("\nDELETE FROM %s WHERE version = %d;\n", s.MigrationTable(), st.Version)
		}
		out[i] = m
	}
	return out
}

// versionTableSQL creates the version table.
func (s *Storage) versionTableSQL() string {
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
    version    INTEGER     PRIMARY KEY,
    name       TEXT        NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
)`, s.MigrationTable())
}

// recordSQL records step st in the version table, as Migrate does.
func (s *Storage) recordSQL(st migfiles.Step) string {
	return fmt.Sprintf("\n-- Recorded in the version table, as Migrate records it.\n%s;\nINSERT INTO %s (version, name) VALUES (%d, %s) ON CONFLICT (version) DO NOTHING;\n",
		s.versionTableSQL(), s.MigrationTable(), st.Version, lit(st.Name))
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
// [Storage.Migrations] in order, each recording itself in the version
// table, then, with [Config.NotifyChannel] set, the notify trigger
// ([Storage.TriggerSQL]). Every statement is idempotent (IF NOT EXISTS / OR
// REPLACE / ON CONFLICT DO NOTHING), so the text can go into a migration
// tool as is, and a schema made from it is at the latest version for
// [Storage.Migrate]. Run as a whole it locks the outbox table even when
// nothing changes; Migrate reads the catalog first and locks nothing when
// the database is up to date. The schema of a qualified table must already
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
//   - which steps run is decided by the recorded version alone: every step
//     after it runs, whole. A schema made from [Storage.SchemaSQL] or
//     [Storage.Migrations] records its own version. A table made without
//     the version table (by the CreateSchema of before versioning, or an
//     older SchemaSQL) is adopted at the latest step whose tables, columns
//     and indexes are all there: the steps up to it are recorded without
//     being run, so none re-creates what a later one dropped;
//   - a CREATE INDEX of a step is left out when a valid index of that name
//     exists (built beforehand with CREATE INDEX CONCURRENTLY, under the
//     name [Storage.Migrations] shows), so it neither builds nor waits for
//     a lock on the outbox table; an index of that name left invalid by a
//     failed concurrent build is an error;
//   - every lock is waited for at most [SchemaLockTimeout], then Migrate
//     fails with an error saying so (a long transaction holds the table).
//
// The steps add tables, columns and indexes (and drop indexes a later step
// replaced); records, their ids and their order are untouched. Creating a
// new index on a large table blocks inserts while it builds: build it
// first by hand with CREATE INDEX CONCURRENTLY.
func (s *Storage) Migrate(ctx context.Context) error {
	_, err := s.MigrateReport(ctx)
	return err
}

// MigrateReport implements [storage.MigrateReporter]: it is
// [Storage.Migrate], returning the versions of the steps this call applied
// (or recorded, adopting a table made without the version table).
func (s *Storage) MigrateReport(ctx context.Context) ([]int, error) {
	return s.migrate(ctx, LatestVersion())
}

// migrate brings the database to version target (tests start from older
// versions with it).
func (s *Storage) migrate(ctx context.Context, target int) (applied []int, err error) {
	steps := loadSteps()[:target]
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
	if err := s.checkTables(ctx, tx, steps); err != nil {
		return nil, fail("check the tables", err)
	}
	if _, err := tx.Exec(ctx, s.versionTableSQL()); err != nil {
		return nil, fail("create the version table", err)
	}
	var current int
	if err := tx.QueryRow(ctx, fmt.Sprintf(`SELECT COALESCE(max(version), 0) FROM %s`, s.MigrationTable())).Scan(&current); err != nil {
		return nil, fail("read the version", err)
	}
	if current > LatestVersion() {
		return nil, fmt.Errorf("migrate outbox schema %s: the database is at version %d, newer than this code's %d: upgrade txoutbox", s.table, current, LatestVersion())
	}
	record := func(st migfiles.Step) error {
		if _, err := tx.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (version, name) VALUES ($1, $2)`, s.MigrationTable()), st.Version, st.Name); err != nil {
			return fail(fmt.Sprintf("record step %d", st.Version), err)
		}
		applied = append(applied, st.Version)
		return nil
	}
	if current == 0 {
		adopt, err := s.adoptVersion(ctx, tx, steps)
		if err != nil {
			return nil, fail("read the catalog", err)
		}
		for _, st := range steps[:adopt] {
			if err := record(st); err != nil {
				return nil, err
			}
		}
		current = adopt
	}
	for _, st := range steps[min(current, len(steps)):] {
		up, err := s.withoutBuiltIndexes(ctx, tx, st)
		if err != nil {
			return nil, fail(fmt.Sprintf("step %d (%s)", st.Version, st.Name), err)
		}
		// Simple protocol: a step is several statements.
		if _, err := tx.Exec(ctx, s.render(up), pgx.QueryExecModeSimpleProtocol); err != nil {
			return nil, fail(fmt.Sprintf("step %d (%s)", st.Version, st.Name), err)
		}
		if err := record(st); err != nil {
			return nil, err
		}
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

// checkTables refuses a table of a name the steps create that lacks a
// column they declare: another application's table, which CREATE TABLE IF
// NOT EXISTS would keep and Migrate record as the outbox's.
func (s *Storage) checkTables(ctx context.Context, tx pgx.Tx, steps []migfiles.Step) error {
	for _, t := range migfiles.Tables(steps) {
		name := s.render(t.Name)
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, name).Scan(&exists); err != nil {
			return err
		}
		if !exists {
			continue
		}
		rows, err := tx.Query(ctx, "SELECT * FROM "+name+" LIMIT 0")
		if err != nil {
			return err
		}
		var have []string
		for _, f := range rows.FieldDescriptions() {
			have = append(have, f.Name)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		if err := migfiles.CheckColumns(name, t.Columns, have); err != nil {
			return err
		}
	}
	return nil
}

// adoptVersion is the version of an outbox table made without the version
// table: 0 when there is no outbox table, else the latest step whose
// tables, columns and indexes are all there (a step that creates nothing
// Migrate can look for cannot be the one).
func (s *Storage) adoptVersion(ctx context.Context, tx pgx.Tx, steps []migfiles.Step) (int, error) {
	// A later step's table alone (an inbox table left behind when the
	// outbox was dropped) is no outbox to adopt.
	var outbox bool
	if err := tx.QueryRow(ctx, "SELECT to_regclass("+lit(s.table)+") IS NOT NULL").Scan(&outbox); err != nil || !outbox {
		return 0, err
	}
	for v := len(steps); v >= 1; v-- {
		cond := s.present(steps[v-1])
		if cond == "" {
			continue
		}
		var ok bool
		if err := tx.QueryRow(ctx, "SELECT "+cond).Scan(&ok); err != nil {
			return 0, err
		}
		if ok {
			return v, nil
		}
	}
	return 0, nil
}

// withoutBuiltIndexes returns the SQL of step st (placeholders not yet
// replaced) without the CREATE INDEX statements whose index exists and is
// valid: even IF NOT EXISTS takes the lock on the table that blocks
// inserts, before it finds the index there. An index left invalid by a
// failed CREATE INDEX CONCURRENTLY is an error: IF NOT EXISTS would keep it.
func (s *Storage) withoutBuiltIndexes(ctx context.Context, tx pgx.Tx, st migfiles.Step) (string, error) {
	up := st.Up
	for _, m := range createIndexRE.FindAllStringSubmatch(st.Up, -1) {
		name := siblingName(s.ident, m[1])
		var found, valid bool
		if err := tx.QueryRow(ctx, `SELECT i.indexrelid IS NOT NULL, COALESCE(i.indisvalid AND i.indisready, false)
FROM (SELECT to_regclass($1) AS oid) r LEFT JOIN pg_index i ON i.indexrelid = r.oid`, name).Scan(&found, &valid); err != nil {
			return "", err
		}
		switch {
		case found && !valid:
			return "", fmt.Errorf("index %s exists but is not valid (a CREATE INDEX CONCURRENTLY that failed, or is still running): drop it (DROP INDEX CONCURRENTLY) and build it again, or let Migrate build it", name)
		case found:
			up = strings.Replace(up, m[0], "-- "+derivedName(s.ident, m[1])+" was built beforehand.", 1)
		}
	}
	return up, nil
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
