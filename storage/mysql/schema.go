package mysql

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"embed"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"

	"github.com/txoutbox/txoutbox/internal/migfiles"
	"github.com/txoutbox/txoutbox/storage"
)

// SchemaLockTimeout is how long [Storage.Migrate] waits for another process
// migrating the same table, in seconds.
const SchemaLockTimeout = 30

// The schema as numbered steps: NNN_name.up.sql, and NNN_name.down.sql where
// reverting is safe and every later step has one (see migfiles.Load); one
// statement each. {table}, {skipped} and {inbox} stand for the quoted
// outbox, skipped and inbox tables.
//
//go:embed migrations/*.sql
var migrationFiles embed.FS

var loadSteps = sync.OnceValue(func() []migfiles.Step {
	steps := migfiles.Load(migrationFiles, "mysql")
	for i := range steps {
		steps[i].Up, steps[i].Down = strings.TrimSpace(steps[i].Up), strings.TrimSpace(steps[i].Down)
	}
	return steps
})

// LatestVersion is the schema version this code needs and Migrate brings a
// database to.
func LatestVersion() int { return len(loadSteps()) }

// tableSuffixes are appended to the outbox table's name for the tables that
// go with it; the longest bounds the outbox table's name.
const (
	migrationsSuffix = "_migrations"
	skippedSuffix    = "_skipped"
	keysSuffix       = "_keys"
)

// MigrationTable returns the version table, quoted: the outbox table's name
// with "_migrations" appended, in the same database.
func (s *Storage) MigrationTable() string { return s.sibling(migrationsSuffix) }

// SkippedTable returns the table that keeps skipped records and their audit
// record, quoted: the outbox table's name with "_skipped" appended, in the
// same database.
func (s *Storage) SkippedTable() string { return s.sibling(skippedSuffix) }

// KeyTable returns the table of key locks, quoted: the outbox table's name
// with "_keys" appended, in the same database. Insert takes a lock on each
// of its records' keys there (see [Config.DisableKeyLocks]).
func (s *Storage) KeyTable() string { return s.sibling(keysSuffix) }

func (s *Storage) sibling(suffix string) string {
	parts := append([]string(nil), s.parts...)
	parts[len(parts)-1] += suffix
	return quoteIdent(parts)
}

func (s *Storage) render(sqlText string) string {
	return strings.NewReplacer("{table}", s.table, "{skipped}", s.SkippedTable(), "{keys}", s.KeyTable(), "{inbox}", s.InboxTable()).Replace(sqlText)
}

// Migrations implements [storage.Migrator]: the steps with their SQL for
// this storage's tables, to export to golang-migrate, goose or Atlas. Every
// up step is idempotent (CREATE TABLE IF NOT EXISTS). No step has a down:
// each would drop a table with records in it.
//
// Each step's SQL is a script: its statement, then the two that record it
// in [Storage.MigrationTable] (created when missing), each ending with a
// semicolon, so that a schema made from it by the mysql client, another
// migration tool (golang-migrate runs a file as one multi-statement
// query), or by hand is at the version it represents for Migrate,
// MigrationStatus and the txoutbox command.
func (s *Storage) Migrations() []storage.Migration {
	steps := loadSteps()
	out := make([]storage.Migration, len(steps))
	for i, st := range steps {
		out[i] = storage.Migration{Version: st.Version, Name: st.Name, Down: s.render(st.Down),
			Up: s.render(st.Up) + ";\n\n-- Recorded in the version table, as Migrate records it.\n" + s.versionTableSQL() + ";\n" +
				fmt.Sprintf("INSERT INTO %s (version, name, applied_at) VALUES (%d, '%s', UTC_TIMESTAMP(6)) ON DUPLICATE KEY UPDATE version = version;\n",
					s.MigrationTable(), st.Version, st.Name)}
	}
	return out
}

// versionTableSQL creates the version table.
func (s *Storage) versionTableSQL() string {
	return `CREATE TABLE IF NOT EXISTS ` + s.MigrationTable() + ` (
    version    INT          NOT NULL,
    name       VARCHAR(255) NOT NULL,
    applied_at DATETIME(6)  NOT NULL,
    PRIMARY KEY (version)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin`
}

// SchemaSQL returns the DDL of the outbox table, its indexes included, and
// of the skipped table ([Storage.SkippedTable]) at the latest version: every
// up step of [Storage.Migrations], each an idempotent statement (CREATE
// TABLE IF NOT EXISTS) and the two that record it in the version table,
// every statement ending with a semicolon. It runs as a script: pipe it
// into the mysql or mariadb client, or run it through a connection with
// the DSN's multiStatements=true. The database of a qualified table must
// already exist. [Storage.Migrate] runs the same steps and records the
// version.
//
// Times are DATETIME(6) in UTC, written and compared with UTC_TIMESTAMP(6),
// so the session time zone does not matter. Keys, topics and uuids compare
// by code point (utf8mb4_bin); see the package documentation for trailing
// spaces.
func (s *Storage) SchemaSQL() string {
	var b strings.Builder
	for _, m := range s.Migrations() {
		b.WriteString(m.Up)
		b.WriteString("\n")
	}
	return b.String()
}

// CreateSchema is [Storage.Migrate], under the name it had before the schema
// was versioned.
func (s *Storage) CreateSchema(ctx context.Context) error { return s.Migrate(ctx) }

// Migrate implements [storage.Migrator]: it applies the steps the database
// lacks and records each in [Storage.MigrationTable]. MySQL commits each DDL
// statement on its own, so the steps are serialised by a named lock instead
// of a transaction: GET_LOCK, up to [SchemaLockTimeout] seconds, taken and
// released on one connection. Processes that start together may all call
// it: one applies the steps, the others wait, then find them applied. Every
// step is idempotent, so a step whose version row was lost to a crash runs
// again harmlessly, and an outbox table dropped alone (its version table
// left behind) is made again. The steps only add tables, so rows, their ids
// and their order are untouched.
func (s *Storage) Migrate(ctx context.Context) error {
	_, err := s.MigrateReport(ctx)
	return err
}

// MigrateReport implements [storage.MigrateReporter]: it is
// [Storage.Migrate], returning the versions of the steps this call applied.
func (s *Storage) MigrateReport(ctx context.Context) ([]int, error) {
	applied, err := s.migrateSteps(ctx, LatestVersion())
	if err != nil {
		return nil, fmt.Errorf("migrate outbox schema %s: %w", s.table, err)
	}
	return applied, nil
}

// migrateTo applies the steps up to version target (tests start from older
// versions with it).
func (s *Storage) migrateTo(ctx context.Context, target int) error {
	_, err := s.migrateSteps(ctx, target)
	return err
}

// migrateSteps is migrateTo, returning the versions it applied.
func (s *Storage) migrateSteps(ctx context.Context, target int) (applied []int, err error) {
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = conn.Close() }()
	lock, err := s.lockName(ctx, conn)
	if err != nil {
		return nil, fmt.Errorf("lock: %w", err)
	}
	var got sql.NullInt64
	// GET_LOCK is held by the session: take and release it on one connection.
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK(?, ?)", lock, SchemaLockTimeout).Scan(&got); err != nil {
		return nil, fmt.Errorf("lock: %w", err)
	}
	if got.Int64 != 1 {
		return nil, fmt.Errorf("another process held the schema lock %q for %ds", lock, SchemaLockTimeout)
	}
	defer conn.ExecContext(context.WithoutCancel(ctx), "SELECT RELEASE_LOCK(?)", lock) //nolint:errcheck // the lock also ends with the session
	steps := loadSteps()
	if err := s.checkTables(ctx, conn, steps); err != nil {
		return nil, err
	}
	vt := s.MigrationTable()
	if _, err := conn.ExecContext(ctx, s.versionTableSQL()); err != nil {
		return nil, fmt.Errorf("create %s: %w", vt, err)
	}
	var current int
	if err := conn.QueryRowContext(ctx, "SELECT COALESCE(MAX(version), 0) FROM "+vt).Scan(&current); err != nil {
		return nil, fmt.Errorf("read %s: %w", vt, err)
	}
	if current > len(steps) {
		return nil, fmt.Errorf("database schema is at version %d, newer than this code's %d: upgrade txoutbox", current, len(steps))
	}
	// A version table left behind by a dropped outbox table (tests and
	// resets often drop the table alone): the applied steps run again; each
	// is idempotent.
	if current > 0 {
		if _, err := conn.ExecContext(ctx, "SELECT 1 FROM "+s.table+" LIMIT 0"); isNoSuchTable(err) {
			for _, st := range steps[:current] {
				if _, err := conn.ExecContext(ctx, s.render(st.Up)); err != nil {
					return nil, fmt.Errorf("step %d (%s) again, the outbox table being gone: %w", st.Version, st.Name, err)
				}
			}
		} else if err != nil {
			return nil, fmt.Errorf("check %s: %w", s.table, err)
		}
	}
	for _, st := range steps[current:min(target, len(steps))] {
		if _, err := conn.ExecContext(ctx, s.render(st.Up)); err != nil {
			return nil, fmt.Errorf("step %d (%s): %w", st.Version, st.Name, err)
		}
		if _, err := conn.ExecContext(ctx, "INSERT INTO "+vt+" (version, name, applied_at) VALUES (?, ?, UTC_TIMESTAMP(6))",
			st.Version, st.Name); err != nil {
			return nil, fmt.Errorf("record step %d in %s: %w", st.Version, vt, err)
		}
		applied = append(applied, st.Version)
	}
	return applied, nil
}

// tableColumns returns the columns of the table name (rendered and quoted).
func tableColumns(ctx context.Context, conn *sql.Conn, name string) ([]string, error) {
	rows, err := conn.QueryContext(ctx, "SELECT * FROM "+name+" LIMIT 0")
	if err != nil {
		return nil, err
	}
	defer func() { _ = rows.Close() }()
	have, err := rows.Columns()
	if err != nil {
		return nil, err
	}
	return have, rows.Err()
}

// checkTables refuses, before anything is written, a table of a name the
// steps create that lacks a column they declare: another application's
// table, which CREATE TABLE IF NOT EXISTS would keep and Migrate record as
// the outbox.
func (s *Storage) checkTables(ctx context.Context, conn *sql.Conn, steps []migfiles.Step) error {
	for _, t := range migfiles.Tables(steps) {
		name := s.render(t.Name)
		have, err := tableColumns(ctx, conn, name)
		if isNoSuchTable(err) {
			continue
		}
		if err != nil {
			return fmt.Errorf("check %s: %w", name, err)
		}
		if err := migfiles.CheckColumns(name, t.Columns, have); err != nil {
			return err
		}
	}
	return nil
}

// MigrationStatus implements [storage.Migrator]. A database without the
// version table reports version 0.
func (s *Storage) MigrationStatus(ctx context.Context) (storage.MigrationStatus, error) {
	st := storage.MigrationStatus{Latest: LatestVersion()}
	rows, err := s.db.QueryContext(ctx, "SELECT version, name, "+micros("applied_at")+" FROM "+s.MigrationTable()+" ORDER BY version")
	if isNoSuchTable(err) {
		return st, nil
	}
	if err != nil {
		return st, fmt.Errorf("read outbox schema version of %s: %w", s.table, err)
	}
	defer func() { _ = rows.Close() }()
	for rows.Next() {
		var (
			m  storage.AppliedMigration
			at int64
		)
		if err := rows.Scan(&m.Version, &m.Name, &at); err != nil {
			return st, fmt.Errorf("read outbox schema version of %s: %w", s.table, err)
		}
		m.AppliedAt = fromMicros(at).UTC()
		st.Applied = append(st.Applied, m)
		st.Current = max(st.Current, m.Version)
	}
	if err := rows.Err(); err != nil {
		return st, fmt.Errorf("read outbox schema version of %s: %w", s.table, err)
	}
	return st, nil
}

// lockName is the name of the schema lock of the table: a hash of its
// database and name, so that every spelling of one table ("outbox",
// "app.outbox") takes one lock, and the name stays within MySQL 8's 64
// characters for any table. An unqualified table is in the connection's
// current database.
func (s *Storage) lockName(ctx context.Context, conn *sql.Conn) (string, error) {
	db := ""
	if len(s.parts) == 2 {
		db = s.parts[0]
	} else {
		var cur sql.NullString
		if err := conn.QueryRowContext(ctx, "SELECT DATABASE()").Scan(&cur); err != nil {
			return "", fmt.Errorf("current database: %w", err)
		}
		db = cur.String
	}
	sum := sha256.Sum256([]byte(db + "." + s.parts[len(s.parts)-1]))
	return "txoutbox schema " + hex.EncodeToString(sum[:16]), nil
}

// isNoSuchTable reports ER_NO_SUCH_TABLE.
func isNoSuchTable(err error) bool { return mysqlErrNumber(err) == errNoSuchTable }
