package sqlite

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/txoutbox/txoutbox/internal/migfiles"
	"github.com/txoutbox/txoutbox/storage"
)

// The schema as numbered steps: NNN_name.up.sql, and NNN_name.down.sql where
// reverting is safe and every later step has one (see migfiles.Load).
// {table} stands for the outbox table's name.
//
//go:embed migrations/*.sql
var migrationFiles embed.FS

var loadSteps = sync.OnceValue(func() []migfiles.Step { return migfiles.Load(migrationFiles, "sqlite") })

// LatestVersion is the schema version this code needs and Migrate brings a
// database to.
func LatestVersion() int { return len(loadSteps()) }

// MigrationTable returns the version table's name: the outbox table's name
// with "_migrations" appended.
func (s *Storage) MigrationTable() string { return s.table + "_migrations" }

// SkippedTable returns the name of the table that keeps skipped records and
// their audit record: the outbox table's name with "_skipped" appended.
func (s *Storage) SkippedTable() string { return s.table + "_skipped" }

func (s *Storage) render(sqlText string) string {
	return strings.ReplaceAll(sqlText, "{table}", s.table)
}

// Migrations implements [storage.Migrator]: the steps with their SQL for
// this storage's table, to export to golang-migrate, goose or Atlas. Every
// up step is idempotent (IF NOT EXISTS) but step 3, which adds a column
// (SQLite has no ADD COLUMN IF NOT EXISTS).
//
// Each step ends by recording itself in [Storage.MigrationTable] (created
// when missing), and each down step by deleting its row, so that a schema
// made from this SQL by another tool, or by hand, is at the version it
// represents for Migrate, MigrationStatus and the txoutbox command.
func (s *Storage) Migrations() []storage.Migration {
	steps := loadSteps()
	vt := quote(s.MigrationTable())
	out := make([]storage.Migration, len(steps))
	for i, st := range steps {
		m := storage.Migration{Version: st.Version, Name: st.Name,
			Up: s.render(st.Up) + "\n-- Recorded in the version table, as Migrate records it.\n" + s.versionTableSQL() + ";\n" +
				fmt.Sprintf("INSERT OR IGNORE INTO %s (version, name, applied_at) VALUES (%d, '%s', CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) * 1000000);\n",
					vt, st.Version, st.Name)}
		if st.Down != "" {
			m.Down = s.render(st.Down) + fmt.Sprintf("DELETE FROM %s WHERE version = %d;\n", vt, st.Version)
		}
		out[i] = m
	}
	return out
}

// versionTableSQL creates the version table; applied_at is Unix
// nanoseconds, like every time of the outbox table.
func (s *Storage) versionTableSQL() string {
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
    version    INTEGER PRIMARY KEY,
    name       TEXT    NOT NULL,
    applied_at INTEGER NOT NULL
)`, quote(s.MigrationTable()))
}

// SchemaSQL returns the statements that create the outbox table, its
// indexes and the skipped table at the latest version: every up step of
// [Storage.Migrations] in order, each recording itself in the version
// table, for your migration tool. They are idempotent (IF NOT EXISTS, OR
// IGNORE) but step 3's ADD COLUMN; a database made from them is at the
// latest version for Migrate.
//
// Timestamps (created_at, due_at, leased_until, delivered_at) are INTEGER
// Unix nanoseconds from the application clock: comparisons are exact integer
// comparisons, and SQLite runs in the application's process, so its clock is
// the host clock anyway. A due_at of 0 means due at once; leased_by and
// leased_until are NULL when the record is not leased. A dead record's due_at
// is when it was dead-lettered.
//
// The hold column says why a pending record is set aside (NULL: it is
// not, claims walk it; 'retry': it waits for its due_at; 'behind': an
// earlier record of its key is pending, or dead and holding the key), and
// on a dead record whether it holds its key ('key'). The partial indexes
// serve: claims (pending records by hold, then id), a key's pending records
// in id order (the strict-ordering check, the next record to set free, the
// records a claim takes along), records waiting for their retry by due
// time, Purge (delivered records by delivery time), Redrive by topic, and a
// key's dead and failed records. Two triggers set the next record of a key
// free when one stops being pending or is deleted.
func (s *Storage) SchemaSQL() string {
	var b strings.Builder
	for _, m := range s.Migrations() {
		b.WriteString(m.Up)
	}
	return b.String()
}

// CreateSchema is Migrate, under the name it had before migrations were
// versioned.
func (s *Storage) CreateSchema(ctx context.Context) error { return s.Migrate(ctx) }

// Migrate implements [storage.Migrator]: it applies the steps the database
// lacks and records each in [Storage.MigrationTable], all in one
// transaction begun with BEGIN IMMEDIATE, which takes SQLite's write lock
// before reading the version. Concurrent callers, in this process or
// others, queue on that lock: the first applies the steps, the others find
// them applied. The steps only add tables and indexes, so records, their ids
// and their order are untouched.
func (s *Storage) Migrate(ctx context.Context) error {
	_, err := s.MigrateReport(ctx)
	return err
}

// MigrateReport implements [storage.MigrateReporter]: it is
// [Storage.Migrate], returning the versions of the steps this call applied.
func (s *Storage) MigrateReport(ctx context.Context) ([]int, error) {
	var applied []int
	err := s.write(ctx, func(ctx context.Context) error {
		applied = nil // write may retry
		conn, err := s.db.Conn(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = conn.Close() }()
		if _, err := conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
			return err
		}
		done := false
		defer func() {
			if !done {
				_, _ = conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
			}
		}()
		steps := loadSteps()
		if err := s.checkTables(ctx, conn, steps); err != nil {
			return err
		}
		vt := quote(s.MigrationTable())
		if _, err := conn.ExecContext(ctx, s.versionTableSQL()); err != nil {
			return err
		}
		var current int
		if err := conn.QueryRowContext(ctx, fmt.Sprintf(`SELECT ifnull(max(version), 0) FROM %s`, vt)).Scan(&current); err != nil {
			return err
		}
		if current > len(steps) {
			return fmt.Errorf("database schema is at version %d, newer than this code's %d: upgrade txoutbox", current, len(steps))
		}
		for _, st := range steps[current:] {
			if _, err := conn.ExecContext(ctx, s.render(st.Up)); err != nil {
				return fmt.Errorf("step %d (%s): %w", st.Version, st.Name, err)
			}
			if _, err := conn.ExecContext(ctx, fmt.Sprintf(`INSERT INTO %s (version, name, applied_at) VALUES (?, ?, ?)`, vt),
				st.Version, st.Name, nanos(s.now())); err != nil {
				return err
			}
			applied = append(applied, st.Version)
		}
		if _, err := conn.ExecContext(ctx, "COMMIT"); err != nil {
			return err
		}
		done = true
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("migrate outbox schema %q: %w", s.table, err)
	}
	return applied, nil
}

// tableColumns returns the columns of the table name, none when there is
// no such table.
func tableColumns(ctx context.Context, conn *sql.Conn, name string) ([]string, error) {
	rows, err := conn.QueryContext(ctx, `SELECT name FROM pragma_table_info(?)`, name)
	if err != nil {
		return nil, err
	}
	defer func() { _ = rows.Close() }()
	var have []string
	for rows.Next() {
		var c string
		if err := rows.Scan(&c); err != nil {
			return nil, err
		}
		have = append(have, c)
	}
	return have, rows.Err()
}

// checkTables refuses a table of a name the steps create that lacks a
// column they declare: another application's table, which CREATE TABLE IF
// NOT EXISTS would keep and Migrate record as the outbox's.
func (s *Storage) checkTables(ctx context.Context, conn *sql.Conn, steps []migfiles.Step) error {
	for _, t := range migfiles.Tables(steps) {
		name := strings.Trim(s.render(t.Name), `"`)
		have, err := tableColumns(ctx, conn, name)
		if err != nil {
			return fmt.Errorf("check %q: %w", name, err)
		}
		if len(have) == 0 { // no such table: a table has at least one column
			continue
		}
		if err := migfiles.CheckColumns(strconv.Quote(name), t.Columns, have); err != nil {
			return err
		}
	}
	return nil
}

// MigrationStatus implements [storage.Migrator].
func (s *Storage) MigrationStatus(ctx context.Context) (storage.MigrationStatus, error) {
	st := storage.MigrationStatus{Latest: LatestVersion()}
	exists, err := s.tableExists(ctx, s.MigrationTable())
	if err != nil || !exists {
		if err != nil {
			err = fmt.Errorf("read outbox schema version of %q: %w", s.table, err)
		}
		return st, err
	}
	rows, err := s.db.QueryContext(ctx, fmt.Sprintf(`SELECT version, name, applied_at FROM %s ORDER BY version`, quote(s.MigrationTable())))
	if err != nil {
		return st, fmt.Errorf("read outbox schema version of %q: %w", s.table, err)
	}
	defer func() { _ = rows.Close() }()
	for rows.Next() {
		var (
			m  storage.AppliedMigration
			at int64
		)
		if err := rows.Scan(&m.Version, &m.Name, &at); err != nil {
			return st, fmt.Errorf("read outbox schema version of %q: %w", s.table, err)
		}
		m.AppliedAt = fromNanos(at)
		st.Applied = append(st.Applied, m)
		st.Current = max(st.Current, m.Version)
	}
	if err := rows.Err(); err != nil {
		return st, fmt.Errorf("read outbox schema version of %q: %w", s.table, err)
	}
	return st, nil
}

func (s *Storage) tableExists(ctx context.Context, name string) (bool, error) {
	var n int
	err := s.db.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?`, name).Scan(&n)
	return n > 0, err
}

// schemaObjects reads the tables and indexes named after the outbox table,
// name -> normalised CREATE statement.
func schemaObjects(ctx context.Context, q interface {
	QueryContext(context.Context, string, ...any) (*sql.Rows, error)
}, table string) (map[string]string, error) {
	rows, err := q.QueryContext(ctx, `SELECT name, ifnull(sql, '') FROM sqlite_master
WHERE type IN ('table', 'index', 'trigger') AND (name = ?1 OR tbl_name = ?1 OR name = ?1 || '_skipped') AND name <> ?1 || '_migrations'`, table)
	if err != nil {
		return nil, err
	}
	defer func() { _ = rows.Close() }()
	out := make(map[string]string)
	for rows.Next() {
		var name, text string
		if err := rows.Scan(&name, &text); err != nil {
			return nil, err
		}
		out[name] = strings.Join(strings.Fields(text), " ")
	}
	return out, rows.Err()
}

func sortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
