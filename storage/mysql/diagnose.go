package mysql

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/txoutbox/txoutbox/internal/migfiles"
	"github.com/txoutbox/txoutbox/storage"
)

// expectedColumns and expectedIndexes are the schema the migrations make,
// for the drift check: columns by table suffix ("" is the outbox table),
// indexes of the outbox table with their columns in order.
var (
	expectedColumns = map[string][]string{
		"": {"id", "uuid", "topic", "key", "payload", "metadata", "created_at", "due_at", "attempts", "status", "parked",
			"leased_by", "leased_until", "last_error", "delivered_at"},
		skippedSuffix: {"id", "uuid", "topic", "key", "payload", "metadata", "created_at", "attempts", "last_error",
			"dead_at", "skipped_at", "reason"},
		keysSuffix: {"key", "seq"},
	}
	expectedIndexes = map[string]string{
		"PRIMARY":   "id",
		"claim_idx": "status,parked,due_at,id",
		"key_idx":   "key,status,id",
		"done_idx":  "status,delivered_at",
	}
)

// Diagnose implements [storage.Diagnoser]. Its checks:
//
//   - schema version: the version table against [LatestVersion];
//   - schema drift: the columns of the outbox, skipped and key tables and the
//     outbox table's indexes, read from information_schema, against those
//     the migrations make: a missing column or index, or an index on other
//     columns, is a problem; an extra index a warning (it slows every
//     write);
//   - privileges: each kind of statement the forwarder and the operator
//     commands run (SELECT ... FOR UPDATE, INSERT, UPDATE and DELETE on the
//     outbox table, INSERT on the skipped table, INSERT ... ON DUPLICATE KEY
//     UPDATE on the key table), tried without
//     effect in a transaction that is rolled back;
//   - server: MySQL 8.0 or MariaDB 10.6 at least (SKIP LOCKED);
//   - binary log: with log_bin on, binlog_format STATEMENT is a problem
//     (InnoDB refuses READ COMMITTED writes under it, and SKIP LOCKED with
//     LIMIT is unsafe for statement replication); ROW and MIXED (which logs
//     those as rows) are fine.
func (s *Storage) Diagnose(ctx context.Context) ([]storage.Finding, error) {
	var out []storage.Finding
	add := func(check string, sev storage.Severity, format string, args ...any) {
		out = append(out, storage.Finding{Check: check, Severity: sev, Message: fmt.Sprintf(format, args...)})
	}

	ms, err := s.MigrationStatus(ctx)
	if err != nil {
		return nil, err
	}
	out = append(out, migfiles.VersionFinding(ms, s.MigrationTable()))

	problems, warnings, err := s.drift(ctx)
	if err != nil {
		return nil, fmt.Errorf("diagnose %s: read the schema: %w", s.table, err)
	}
	switch {
	case len(problems) > 0:
		add("schema drift", storage.SeverityProblem, "%s (`txoutbox migrate sql` prints the expected schema)", strings.Join(problems, "; "))
	case len(warnings) > 0:
		add("schema drift", storage.SeverityWarning, "%s", strings.Join(warnings, "; "))
	default:
		add("schema drift", storage.SeverityOK, "tables, columns and indexes as the migrations made them")
	}

	if denied := s.privileges(ctx); len(denied) > 0 {
		add("privileges", storage.SeverityProblem, "%s: grant SELECT, INSERT, UPDATE, DELETE on %s, %s and %s", strings.Join(denied, "; "), s.table, s.SkippedTable(), s.KeyTable())
	} else {
		add("privileges", storage.SeverityOK, "SELECT ... FOR UPDATE, INSERT, UPDATE and DELETE on %s, INSERT on %s, INSERT ... ON DUPLICATE KEY UPDATE on %s", s.table, s.SkippedTable(), s.KeyTable())
	}

	vars, err := s.variables(ctx, "version", "log_bin", "binlog_format")
	if err != nil {
		return nil, fmt.Errorf("diagnose %s: read server variables: %w", s.table, err)
	}
	if ok, why := versionOK(vars["version"]); ok {
		add("server version", storage.SeverityOK, "%s", vars["version"])
	} else {
		add("server version", storage.SeverityProblem, "%s: %s", vars["version"], why)
	}
	switch format := strings.ToUpper(vars["binlog_format"]); {
	case !strings.EqualFold(vars["log_bin"], "ON"):
		add("binary log", storage.SeverityOK, "off")
	case format == "STATEMENT":
		add("binary log", storage.SeverityProblem, "binlog_format STATEMENT: InnoDB refuses writes in READ COMMITTED transactions under it, and claims (LIMIT with SKIP LOCKED) are unsafe to replicate as statements; set binlog_format=ROW")
	case format == "MIXED":
		add("binary log", storage.SeverityOK, "binlog_format MIXED: claims and READ COMMITTED writes are logged as rows")
	default:
		add("binary log", storage.SeverityOK, "binlog_format %s", format)
	}
	return out, nil
}

// drift compares information_schema with the expected schema.
func (s *Storage) drift(ctx context.Context) (problems, warnings []string, err error) {
	db := "DATABASE()"
	if len(s.parts) == 2 {
		var b strings.Builder
		strLit(&b, s.parts[0])
		db = b.String()
	}
	name := s.parts[len(s.parts)-1]
	for _, suffix := range []string{"", skippedSuffix, keysSuffix} {
		var b strings.Builder
		b.WriteString("SELECT column_name FROM information_schema.columns WHERE table_schema = " + db + " AND table_name = ")
		strLit(&b, name+suffix)
		cols, err := queryStrings(ctx, s.db, b.String())
		if err != nil {
			return nil, nil, err
		}
		table := quoteIdent(append(s.parts[:len(s.parts)-1:len(s.parts)-1], name+suffix))
		if len(cols) == 0 {
			problems = append(problems, table+" is missing")
			continue
		}
		for _, c := range expectedColumns[suffix] {
			if !slices.ContainsFunc(cols, func(g string) bool { return strings.EqualFold(g, c) }) {
				problems = append(problems, fmt.Sprintf("column %s of %s is missing", c, table))
			}
		}
	}
	var b strings.Builder
	b.WriteString("SELECT index_name, GROUP_CONCAT(column_name ORDER BY seq_in_index SEPARATOR ',') FROM information_schema.statistics WHERE table_schema = " + db + " AND table_name = ")
	strLit(&b, name)
	b.WriteString(" GROUP BY index_name ORDER BY index_name")
	rows, err := s.db.QueryContext(ctx, b.String())
	if err != nil {
		return nil, nil, err
	}
	defer func() { _ = rows.Close() }()
	got := map[string]string{}
	for rows.Next() {
		var idx, cols string
		if err := rows.Scan(&idx, &cols); err != nil {
			return nil, nil, err
		}
		got[idx] = strings.ToLower(cols)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	if len(got) == 0 {
		return problems, warnings, nil // the table is missing, said above
	}
	for _, idx := range sortedKeys(expectedIndexes) {
		switch g, ok := got[idx]; {
		case !ok:
			problems = append(problems, fmt.Sprintf("index %s of %s is missing", idx, s.table))
		case g != expectedIndexes[idx]:
			problems = append(problems, fmt.Sprintf("index %s of %s differs: found (%s), expected (%s)", idx, s.table,
				strings.ReplaceAll(g, ",", ", "), strings.ReplaceAll(expectedIndexes[idx], ",", ", ")))
		}
	}
	for _, idx := range sortedKeys(got) {
		if _, ok := expectedIndexes[idx]; !ok {
			warnings = append(warnings, fmt.Sprintf("index %s of %s (%s) is not txoutbox's: every write updates it", idx, s.table, got[idx]))
		}
	}
	return problems, warnings, nil
}

// privileges tries each kind of statement txoutbox runs, matching no row,
// in a transaction it rolls back; it returns the refusals.
func (s *Storage) privileges(ctx context.Context) []string {
	checks := []struct{ what, q string }{
		{"SELECT ... FOR UPDATE on " + s.table, "SELECT id FROM " + s.table + " WHERE id = 0 FOR UPDATE"},
		{"INSERT on " + s.table, "INSERT INTO " + s.table + " (uuid, topic, created_at, due_at) SELECT 'u', 't', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) FROM DUAL WHERE FALSE"},
		{"UPDATE on " + s.table, "UPDATE " + s.table + " SET attempts = attempts WHERE id = 0"},
		{"DELETE on " + s.table, "DELETE FROM " + s.table + " WHERE id = 0"},
		{"INSERT on " + s.SkippedTable(), "INSERT INTO " + s.SkippedTable() + " SELECT * FROM " + s.SkippedTable() + " WHERE FALSE"},
		{"INSERT ... ON DUPLICATE KEY UPDATE on " + s.KeyTable(), "INSERT INTO " + s.KeyTable() + " (`key`, seq) SELECT '', 0 FROM DUAL WHERE FALSE ON DUPLICATE KEY UPDATE seq = seq + 1"},
	}
	var denied []string
	for _, c := range checks {
		err := s.tryTx(ctx, func(tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, c.q)
			if err == nil {
				err = errRollback
			}
			return err
		})
		switch {
		case err == errRollback: //nolint:errorlint // tryTx returns fn's error as is
		case mysqlErrNumber(err) == errTableAccessDenied:
			denied = append(denied, c.what+" denied")
		default:
			denied = append(denied, fmt.Sprintf("%s: %v", c.what, err))
		}
	}
	return denied
}

// errTableAccessDenied is ER_TABLEACCESS_DENIED_ERROR.
const errTableAccessDenied = 1142

// errRollback makes tryTx roll back a transaction that succeeded.
var errRollback = fmt.Errorf("rolled back on purpose")

// variables reads server variables by name.
func (s *Storage) variables(ctx context.Context, names ...string) (map[string]string, error) {
	rows, err := s.db.QueryContext(ctx, "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('"+strings.Join(names, "', '")+"')")
	if err != nil {
		return nil, err
	}
	defer func() { _ = rows.Close() }()
	out := map[string]string{}
	for rows.Next() {
		var k, v string
		if err := rows.Scan(&k, &v); err != nil {
			return nil, err
		}
		out[strings.ToLower(k)] = v
	}
	return out, rows.Err()
}

// versionOK checks a server version string for SKIP LOCKED: MySQL 8.0.1 or
// MariaDB 10.6.
func versionOK(v string) (bool, string) {
	num, _, _ := strings.Cut(v, "-")
	parts := strings.Split(num, ".")
	if len(parts) < 2 {
		return true, ""
	}
	major, _ := strconv.Atoi(parts[0])
	minor, _ := strconv.Atoi(parts[1])
	if strings.Contains(strings.ToLower(v), "mariadb") {
		if major < 10 || (major == 10 && minor < 6) {
			return false, "MariaDB 10.6 or later is needed (FOR UPDATE SKIP LOCKED)"
		}
		return true, ""
	}
	if major < 8 {
		return false, "MySQL 8.0 or later is needed (FOR UPDATE SKIP LOCKED)"
	}
	return true, ""
}

func queryStrings(ctx context.Context, db *sql.DB, q string) ([]string, error) {
	rows, err := db.QueryContext(ctx, q)
	if err != nil {
		return nil, err
	}
	defer func() { _ = rows.Close() }()
	var out []string
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			return nil, err
		}
		out = append(out, v)
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
