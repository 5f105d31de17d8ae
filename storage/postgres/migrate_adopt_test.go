package postgres

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox/storage"
)

// shape reads what the migrations make, for comparing two schemas: the
// columns (type, default, nullability), indexes and constraints of the
// tables of s, with the schema's name taken out.
func shape(t *testing.T, s *Storage) []string {
	t.Helper()
	schema := s.ident[0]
	rows, err := s.pool.Query(t.Context(), `
SELECT format('column %s.%s %s %s default %s', c.relname, a.attname, format_type(a.atttypid, a.atttypmod),
    CASE WHEN a.attnotnull THEN 'not null' ELSE 'null' END, COALESCE(pg_get_expr(d.adbin, d.adrelid), '-'))
FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
WHERE c.relnamespace = $1::regnamespace AND c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped
UNION ALL
SELECT format('index %s %s valid %s', c.relname, pg_get_indexdef(i.indexrelid), i.indisvalid)
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relnamespace = $1::regnamespace
UNION ALL
SELECT format('constraint %s %s %s', conrelid::regclass, conname, pg_get_constraintdef(oid))
FROM pg_constraint WHERE connamespace = $1::regnamespace
UNION ALL
SELECT format('trigger %s %s', tgrelid::regclass, tgname) FROM pg_trigger WHERE tgrelid IN (SELECT oid FROM pg_class WHERE relnamespace = $1::regnamespace) AND NOT tgisinternal`,
		schema)
	must(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	must(t, err)
	for i := range got {
		got[i] = strings.ReplaceAll(got[i], schema+".", "")
	}
	slices.Sort(got)
	return got
}

// freshShape is the shape of a table Migrate made in an empty schema.
func freshShape(t *testing.T) []string {
	t.Helper()
	return shape(t, newStore(t, Config{}))
}

// bareStore is a storage on a table in a fresh, empty schema.
func bareStore(t *testing.T) *Storage {
	t.Helper()
	s, err := New(testPool(t), Config{Table: newSchema(t) + ".outbox"})
	must(t, err)
	return s
}

func execSQL(t *testing.T, s *Storage, sql string) {
	t.Helper()
	_, err := s.pool.Exec(t.Context(), sql, pgx.QueryExecModeSimpleProtocol)
	must(t, err)
}

// driftClean fails the test unless Diagnose finds the version and the
// schema as the migrations make them.
func driftClean(t *testing.T, s *Storage) {
	t.Helper()
	findings, err := s.Diagnose(t.Context())
	must(t, err)
	for _, f := range findings {
		if (f.Check == "schema drift" || f.Check == "schema version") && f.Severity != storage.SeverityOK {
			t.Errorf("doctor: %s: %s: %s", f.Check, f.Severity, f.Message)
		}
	}
}

// TestSchemaSQLIsRecorded: a schema made from SchemaSQL (as a DBA pastes it
// into psql or a migration tool) is recorded at the version it represents;
// Migrate then has nothing to do, and re-creates none of the indexes a
// later step dropped.
func TestSchemaSQLIsRecorded(t *testing.T) {
	t.Parallel()
	s := bareStore(t)
	execSQL(t, s, s.SchemaSQL())
	if v := version(t, s); v != LatestVersion() {
		t.Fatalf("a schema made from SchemaSQL is at version %d, want %d", v, LatestVersion())
	}
	must(t, s.Migrate(t.Context()))
	if got, want := shape(t, s), freshShape(t); !slices.Equal(got, want) {
		t.Fatalf("schema from SchemaSQL + Migrate differs from a fresh Migrate:\n%s", diffLines(got, want))
	}
	driftClean(t, s)
	// Run twice, as a migration tool may: the same.
	execSQL(t, s, s.SchemaSQL())
	if got, want := shape(t, s), freshShape(t); !slices.Equal(got, want) {
		t.Fatalf("SchemaSQL run twice differs:\n%s", diffLines(got, want))
	}
}

// TestMigrateAdoptsUnrecordedSchema: a table made without the version
// table by the DDL of every step (an older SchemaSQL) is adopted at the
// latest step, without running any step again: the indexes step 4 dropped
// stay dropped.
func TestMigrateAdoptsUnrecordedSchema(t *testing.T) {
	t.Parallel()
	s := bareStore(t)
	for _, st := range loadSteps() {
		execSQL(t, s, s.render(st.Up))
	}
	if v := version(t, s); v != 0 {
		t.Fatalf("version %d before Migrate, want 0 (nothing recorded)", v)
	}
	must(t, s.Migrate(t.Context()))
	if v := version(t, s); v != LatestVersion() {
		t.Fatalf("at version %d after Migrate, want %d", v, LatestVersion())
	}
	if got, want := shape(t, s), freshShape(t); !slices.Equal(got, want) {
		t.Fatalf("adopted schema differs from a fresh Migrate:\n%s", diffLines(got, want))
	}
	driftClean(t, s)
}

// TestMigrateLeftoverLaterTableIsNoOutbox: a later step's table left
// behind where the outbox was dropped (the inbox table) is not an outbox to
// adopt: Migrate creates the whole schema. It adopted at the inbox's step
// and created no outbox table.
func TestMigrateLeftoverLaterTableIsNoOutbox(t *testing.T) {
	t.Parallel()
	s := bareStore(t)
	must(t, s.Migrate(t.Context()))
	execSQL(t, s, fmt.Sprintf("DROP TABLE %s, %s, %s, %s, %s, %s", s.Table(), s.LeaseTable(), s.WorkerTable(), s.DeliveredTable(), s.MigrationTable(), s.SkippedTable()))
	must(t, s.Migrate(t.Context()))
	if v := version(t, s); v != LatestVersion() {
		t.Fatalf("at version %d after Migrate, want %d", v, LatestVersion())
	}
	if got, want := shape(t, s), freshShape(t); !slices.Equal(got, want) {
		t.Fatalf("schema after Migrate beside a leftover inbox table differs from a fresh Migrate:\n%s", diffLines(got, want))
	}
}

// indexStatements are the CREATE INDEX statements of a step's SQL.
var indexStatements = regexp.MustCompile(`CREATE INDEX IF NOT EXISTS [^;]*;`)

func onOutbox(createIndex string) bool { return strings.Contains(createIndex, " ON {table} ") }

// TestMigratePrebuiltIndexes: an operator builds a later step's indexes
// beforehand with CREATE INDEX CONCURRENTLY (and adds the columns they
// need), as docs/operations.md says; Migrate still applies the whole step
// (its other statements: a constraint, an update, the indexes it drops),
// decided by the recorded version, not by the indexes it finds.
func TestMigratePrebuiltIndexes(t *testing.T) {
	t.Parallel()
	for _, st := range loadSteps()[1:] {
		// Only the outbox table's indexes: a table the step creates has
		// none to build beforehand.
		if !slices.ContainsFunc(indexStatements.FindAllString(st.Up, -1), onOutbox) {
			continue
		}
		t.Run(fmt.Sprintf("step %d %s", st.Version, st.Name), func(t *testing.T) {
			t.Parallel()
			s := bareStore(t)
			atVersion(t, s, st.Version-1)
			if v := version(t, s); v != st.Version-1 {
				t.Fatalf("at version %d, want %d", v, st.Version-1)
			}
			insert(t, s, recs("a", "b", "")...)
			for _, add := range regexp.MustCompile(`ALTER TABLE \{table\} ADD COLUMN IF NOT EXISTS [^;]*;`).FindAllString(st.Up, -1) {
				execSQL(t, s, s.render(add))
			}
			for _, idx := range slices.DeleteFunc(indexStatements.FindAllString(st.Up, -1), func(s string) bool { return !onOutbox(s) }) {
				execSQL(t, s, strings.Replace(s.render(idx), "CREATE INDEX IF NOT EXISTS", "CREATE INDEX CONCURRENTLY IF NOT EXISTS", 1))
			}
			must(t, s.Migrate(t.Context()))
			if got, want := shape(t, s), freshShape(t); !slices.Equal(got, want) {
				t.Fatalf("schema with step %d's indexes built beforehand differs from a fresh Migrate:\n%s", st.Version, diffLines(got, want))
			}
			driftClean(t, s)
		})
	}
}

// TestMigrateRefusesInvalidIndex: an index left invalid by a CREATE INDEX
// CONCURRENTLY that failed is not taken for built.
func TestMigrateRefusesInvalidIndex(t *testing.T) {
	t.Parallel()
	s := bareStore(t)
	atVersion(t, s, 1)
	// Two rows with the same key: a unique index built concurrently fails
	// and stays, invalid, under the name step 2 gives its key index.
	insert(t, s, recs("a", "a")...)
	name := pgx.Identifier{derivedName(s.ident, "key_idx")}.Sanitize()
	_, err := s.pool.Exec(t.Context(), fmt.Sprintf(`CREATE UNIQUE INDEX CONCURRENTLY %s ON %s (key)`, name, s.table))
	if err == nil {
		t.Fatal("the unique index was built")
	}
	err = s.Migrate(t.Context())
	if err == nil || !strings.Contains(err.Error(), "not valid") {
		t.Fatalf("Migrate = %v, want a refusal naming the invalid index", err)
	}
	// doctor says so too.
	findings, ferr := s.Diagnose(t.Context())
	must(t, ferr)
	if !slices.ContainsFunc(findings, func(f storage.Finding) bool {
		return f.Check == "schema drift" && f.Severity == storage.SeverityProblem && strings.Contains(f.Message, "not valid")
	}) {
		t.Fatalf("Diagnose does not report the invalid index: %+v", findings)
	}
}

// atVersion brings the table of s to version v as an earlier release's
// Migrate left it: the steps' DDL, each recorded in the version table.
func atVersion(t *testing.T, s *Storage, v int) {
	t.Helper()
	execSQL(t, s, fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())`, s.MigrationTable()))
	for _, st := range loadSteps()[:v] {
		execSQL(t, s, s.render(st.Up))
		_, err := s.pool.Exec(t.Context(), fmt.Sprintf(`INSERT INTO %s (version, name) VALUES ($1, $2)`, s.MigrationTable()), st.Version, st.Name)
		must(t, err)
	}
}

func diffLines(got, want []string) string {
	var b strings.Builder
	for _, g := range got {
		if !slices.Contains(want, g) {
			b.WriteString("+ " + g + "\n")
		}
	}
	for _, w := range want {
		if !slices.Contains(got, w) {
			b.WriteString("- " + w + "\n")
		}
	}
	return b.String()
}

// TestMigrateRefusesAnotherTable: a table of the outbox's name (or of one
// of its side tables) without the columns Migrate would give it is
// refused, naming what it lacks, and nothing is created or recorded.
func TestMigrateRefusesAnotherTable(t *testing.T) {
	for _, side := range []string{"", "delivered", "skipped"} {
		s := bareStore(t)
		foreign := s.table
		if side != "" {
			execSQL(t, s, s.SchemaSQL()) // a real outbox whose side table is then replaced
			foreign = siblingName(s.ident, side)
			execSQL(t, s, "DROP TABLE "+foreign+"; DELETE FROM "+s.MigrationTable())
		}
		execSQL(t, s, "CREATE TABLE "+foreign+" (id BIGINT PRIMARY KEY, key TEXT, note TEXT)")
		before := shape(t, s)
		err := s.Migrate(t.Context())
		if !errors.Is(err, storage.ErrNotOutboxTable) || !strings.Contains(err.Error(), foreign+" exists but has no column uuid, ") {
			t.Fatalf("Migrate with another table as %q = %v, want ErrNotOutboxTable naming the missing columns", foreign, err)
		}
		if after := shape(t, s); !slices.Equal(before, after) {
			t.Fatalf("the refused Migrate changed the schema: %q -> %q", before, after)
		}
	}
}
