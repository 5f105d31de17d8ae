package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"strings"

	"github.com/txoutbox/txoutbox/internal/migfiles"
	"github.com/txoutbox/txoutbox/storage"
)

// Diagnose implements [storage.Diagnoser]. Its checks:
//
//   - schema version: the version table against [LatestVersion];
//   - schema drift: the tables and indexes named after the outbox table
//     against those the migrations create (built in a scratch in-memory
//     database and compared statement by statement): a missing or altered
//     one is a problem, an extra index a warning;
//   - journal mode: WAL, without which readers and the writer block each
//     other;
//   - busy timeout: without one a second writer fails at once.
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

	want, err := s.expectedSchema(ctx)
	if err != nil {
		return nil, fmt.Errorf("diagnose %q: build the expected schema: %w", s.table, err)
	}
	got, err := schemaObjects(ctx, s.db, s.table)
	if err != nil {
		return nil, fmt.Errorf("diagnose %q: read the schema: %w", s.table, err)
	}
	var problems, warnings []string
	for _, name := range sortedKeys(want) {
		switch g, ok := got[name]; {
		case !ok:
			problems = append(problems, fmt.Sprintf("%s is missing", name))
		case g != want[name]:
			problems = append(problems, fmt.Sprintf("%s differs: found %q, expected %q", name, g, want[name]))
		}
	}
	for _, name := range sortedKeys(got) {
		if _, ok := want[name]; !ok {
			warnings = append(warnings, fmt.Sprintf("%s is not txoutbox's", name))
		}
	}
	switch {
	case len(problems) > 0:
		add("schema drift", storage.SeverityProblem, "%s (`txoutbox migrate sql` prints the expected schema)", strings.Join(problems, "; "))
	case len(warnings) > 0:
		add("schema drift", storage.SeverityWarning, "%s", strings.Join(warnings, "; "))
	default:
		add("schema drift", storage.SeverityOK, "%d tables and indexes as the migrations made them", len(want))
	}

	var mode string
	if err := s.db.QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&mode); err != nil {
		return nil, fmt.Errorf("diagnose %q: read journal_mode: %w", s.table, err)
	}
	if strings.EqualFold(mode, "wal") {
		add("journal mode", storage.SeverityOK, "wal")
	} else {
		add("journal mode", storage.SeverityProblem, "%s: readers and the writer block each other; open the database with sqlite.Open or PRAGMA journal_mode=WAL", mode)
	}
	var busy int
	if err := s.db.QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&busy); err != nil {
		return nil, fmt.Errorf("diagnose %q: read busy_timeout: %w", s.table, err)
	}
	if busy > 0 {
		add("busy timeout", storage.SeverityOK, "%d ms", busy)
	} else {
		add("busy timeout", storage.SeverityWarning, "0: a second writer fails at once with SQLITE_BUSY; use sqlite.Open or sqlite.DSNParams")
	}
	return out, nil
}

// expectedSchema applies every step to a scratch in-memory database and
// reads back what they made.
func (s *Storage) expectedSchema(ctx context.Context) (map[string]string, error) {
	db, err := sql.Open(DriverName, "file:txoutbox-expected?mode=memory")
	if err != nil {
		return nil, err
	}
	defer func() { _ = db.Close() }()
	db.SetMaxOpenConns(1) // one connection, one in-memory database
	for _, m := range s.Migrations() {
		if _, err := db.ExecContext(ctx, m.Up); err != nil {
			return nil, fmt.Errorf("step %d: %w", m.Version, err)
		}
	}
	return schemaObjects(ctx, db, s.table)
}
