package postgres

import (
	"context"
	"strings"
	"testing"
)

// TestMigratePrebuiltIndexesTakeNoTableLock: a step whose indexes were all
// built beforehand runs without locking the outbox table, next to an open
// producer transaction: its CREATE INDEX statements, which would wait for
// the producer (and make every later insert wait behind them), are not run.
func TestMigratePrebuiltIndexesTakeNoTableLock(t *testing.T) {
	t.Parallel()
	s := bareStore(t)
	atVersion(t, s, 1)
	step := loadSteps()[1] // step 2: a table and indexes, nothing else
	if strings.Contains(step.Up, "ALTER TABLE") {
		t.Fatalf("step 2 alters the table now; pick a step that only adds indexes")
	}
	for _, idx := range indexStatements.FindAllString(step.Up, -1) {
		execSQL(t, s, strings.Replace(s.render(idx), "CREATE INDEX IF NOT EXISTS", "CREATE INDEX CONCURRENTLY IF NOT EXISTS", 1))
	}
	ctx := t.Context()
	producer, err := s.pool.Begin(ctx)
	must(t, err)
	defer producer.Rollback(ctx) //nolint:errcheck // test
	_, err = s.insert(ctx, producer, recs("a"), false)
	must(t, err)
	cctx, cancel := context.WithTimeout(ctx, SchemaLockTimeout/2)
	defer cancel()
	_, err = s.migrate(cctx, 2)
	must(t, err)
	if v := version(t, s); v != 2 {
		t.Fatalf("at version %d, want 2", v)
	}
}

// TestMigrateReport: the steps a call applied, none for the next one.
func TestMigrateReport(t *testing.T) {
	t.Parallel()
	s := bareStore(t)
	atVersion(t, s, 1)
	applied, err := s.MigrateReport(t.Context())
	must(t, err)
	if len(applied) != LatestVersion()-1 || applied[0] != 2 || applied[len(applied)-1] != LatestVersion() {
		t.Fatalf("MigrateReport from version 1 = %v, want 2 to %d", applied, LatestVersion())
	}
	if applied, err = s.MigrateReport(t.Context()); err != nil || len(applied) > 0 {
		t.Fatalf("MigrateReport at the latest version = %v, %v; want nothing", applied, err)
	}
}
