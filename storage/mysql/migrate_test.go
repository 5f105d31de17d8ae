package mysql

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// TestMigrateConcurrently starts eight Migrate calls on one fresh table at
// once: all succeed, and each step is applied and recorded once.
func TestMigrateConcurrently(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	name := newTable(t, db)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			s, err := New(db, Config{Table: name})
			if err == nil {
				err = s.Migrate(t.Context())
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	s, err := New(db, Config{Table: name})
	must(t, err)
	st, err := s.MigrationStatus(t.Context())
	must(t, err)
	if st.Current != LatestVersion() || st.Latest != LatestVersion() || len(st.Applied) != LatestVersion() {
		t.Fatalf("MigrationStatus = %+v, want every one of the %d steps applied once", st, LatestVersion())
	}
	for i, m := range st.Applied {
		if m.Version != i+1 || m.Name != loadSteps()[i].Name || m.AppliedAt.IsZero() || time.Since(m.AppliedAt) > time.Hour {
			t.Errorf("applied step %d = %+v", i, m)
		}
	}
}

// dump reads every row of the outbox table, in id order, as text.
func dump(t *testing.T, s *Storage) []string {
	t.Helper()
	rows, err := s.db.QueryContext(t.Context(), "SELECT CONCAT_WS('|', id, uuid, topic, `key`, HEX(payload), COALESCE(metadata, ''), attempts, status, parked, "+
		"COALESCE(leased_by, ''), COALESCE(leased_until, ''), due_at, COALESCE(last_error, ''), COALESCE(delivered_at, '')) FROM "+s.table+" ORDER BY id")
	must(t, err)
	defer func() { _ = rows.Close() }()
	var out []string
	for rows.Next() {
		var r string
		must(t, rows.Scan(&r))
		out = append(out, r)
	}
	must(t, rows.Err())
	return out
}

// TestMigrateUpgradeFromVersion1 brings a version-1 table holding rows in
// every state (pending, parked, leased, dead, delivered) to the latest
// version, from four processes at once: no row changes, and the rows are
// then claimed in key order as before.
func TestMigrateUpgradeFromVersion1(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	name := newTable(t, db)
	s, err := New(db, Config{Table: name})
	must(t, err)
	must(t, s.migrateTo(t.Context(), 1))
	if st, err := s.MigrationStatus(t.Context()); err != nil || st.Current != 1 {
		t.Fatalf("MigrationStatus after step 1 = %+v, %v", st, err)
	}
	if _, err := s.Record(t.Context(), 1); err == nil || !isNoSuchTable(err) {
		t.Fatalf("Record on a version-1 table = %v, want the skipped table missing", err)
	}
	// a1 dead, a2 a3 parked behind it; b1 leased, b2 parked behind it; c1
	// delivered; k keyless pending. (Inserted without key locks: their table
	// is step 3.)
	old, err := New(db, Config{Table: name, DisableKeyLocks: true})
	must(t, err)
	ids := insert(t, old, recs("a", "b", "c", "", "a", "a", "b")...)
	a1, b1, c1, k, a2, a3, b2 := ids[0], ids[1], ids[2], ids[3], ids[4], ids[5], ids[6]
	got := claim(t, s, "w1", 3, time.Hour) // a1 b1 c1; a2 a3 b2 parked
	if !slices.Equal(idsOf(got), []int64{a1, b1, c1}) {
		t.Fatalf("claimed %v", idsOf(got))
	}
	must(t, s.DeadLetter(t.Context(), storage.DeadLetterParams{Record: liveRef(t, s, a1), WorkerID: "w1", Error: "poison"}))
	must(t, s.Ack(t.Context(), storage.AckParams{Records: liveRefs(t, s, c1), WorkerID: "w1"}))
	before := dump(t, s)
	if len(before) != 7 {
		t.Fatalf("dump has %d rows", len(before))
	}

	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Go(func() {
			s, err := New(db, Config{Table: name})
			if err == nil {
				err = s.Migrate(t.Context())
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		must(t, err)
	}
	if st, err := s.MigrationStatus(t.Context()); err != nil || st.Current != LatestVersion() || len(st.Applied) != LatestVersion() {
		t.Fatalf("MigrationStatus after Migrate = %+v, %v", st, err)
	}
	if after := dump(t, s); !slices.Equal(before, after) {
		t.Fatalf("rows changed by the upgrade:\nbefore %q\nafter  %q", before, after)
	}

	// The rows go on as before: b1's lease holds b2; a2 a3 follow a1 once
	// it is re-driven; the dead row can now be skipped instead.
	got = claim(t, s, "w2", 10, time.Hour)
	if !slices.Equal(idsOf(got), []int64{k, a2, a3}) {
		t.Fatalf("claimed %v after the upgrade, want [%d %d %d]", idsOf(got), k, a2, a3)
	}
	must(t, s.Ack(t.Context(), storage.AckParams{Records: liveRefs(t, s, b1), WorkerID: "w1"}))
	if got := claim(t, s, "w2", 10, time.Hour); !slices.Equal(idsOf(got), []int64{b2}) {
		t.Fatalf("claimed %v after b1's ack, want [%d]", idsOf(got), b2)
	}
	insert(t, s, rec("a")) // with the key locks
	must(t, s.Skip(t.Context(), storage.SkipParams{ID: a1, Reason: "upgrade test"}))
	if info, err := s.Record(t.Context(), a1); err != nil || info.Status != storage.StatusSkipped || info.LastError != "poison" {
		t.Fatalf("Record of the skipped row = %+v, %v", info, err)
	}
}

// TestMigrateAdoptsHandMadeSchema: a table made from SchemaSQL by hand,
// statement by statement as a client runs a script, is at the latest
// version; Migrate has nothing to do and leaves its rows alone. Made from
// the steps' statements alone (an older SchemaSQL, no version table), it
// is at version 0 and Migrate records the steps.
func TestMigrateAdoptsHandMadeSchema(t *testing.T) {
	t.Parallel()
	for _, recorded := range []bool{true, false} {
		db := openDB(t)
		name := newTable(t, db)
		s, err := New(db, Config{Table: name})
		must(t, err)
		stmts := strings.Split(strings.TrimSpace(s.SchemaSQL()), ";\n")
		if len(stmts) != 3*LatestVersion() {
			t.Fatalf("SchemaSQL has %d statements, want 3 a step (the step, the version table, the version)", len(stmts))
		}
		for i, q := range stmts {
			if recorded || i%3 == 0 {
				must(t, exec(t, s, strings.TrimSuffix(q, ";")))
			}
		}
		want := 0
		if recorded {
			want = LatestVersion()
		}
		if st, err := s.MigrationStatus(t.Context()); err != nil || st.Current != want || st.Latest != LatestVersion() {
			t.Fatalf("MigrationStatus of a hand-made schema = %+v, %v, want version %d", st, err, want)
		}
		insert(t, s, recs("a", "b")...)
		before := dump(t, s)
		must(t, s.CreateSchema(t.Context()))
		if st, err := s.MigrationStatus(t.Context()); err != nil || st.Current != LatestVersion() {
			t.Fatalf("MigrationStatus after Migrate = %+v, %v", st, err)
		}
		if after := dump(t, s); !slices.Equal(before, after) {
			t.Fatalf("rows changed: %q -> %q", before, after)
		}
	}
}

func TestMigrateRefusesNewerSchema(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	must(t, exec(t, s, fmt.Sprintf("INSERT INTO %s (version, name, applied_at) VALUES (99, 'future', UTC_TIMESTAMP(6))", s.MigrationTable())))
	if err := s.Migrate(t.Context()); err == nil || !strings.Contains(err.Error(), "newer than this code") {
		t.Fatalf("Migrate on a version-99 schema = %v, want it refused", err)
	}
}

func TestMigrations(t *testing.T) {
	t.Parallel()
	s, err := New(openDB(t), Config{Table: "app.events"})
	must(t, err)
	ms := s.Migrations()
	if len(ms) != LatestVersion() || ms[0].Version != 1 || ms[0].Name != "create_outbox" {
		t.Fatalf("Migrations = %+v", ms)
	}
	if !strings.Contains(ms[0].Up, "CREATE TABLE IF NOT EXISTS `app`.`events` (") || !strings.Contains(ms[1].Up, "`app`.`events_skipped`") ||
		strings.Contains(s.SchemaSQL(), "{") {
		t.Fatalf("steps not rendered for `app`.`events`:\n%s", s.SchemaSQL())
	}
}

// TestMigrateRecreatesDroppedTable: the outbox table dropped alone (its
// version table left behind) is made again by the next Migrate.
func TestMigrateRecreatesDroppedTable(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	must(t, exec(t, s, "DROP TABLE "+s.table))
	must(t, s.Migrate(t.Context()))
	ids := insert(t, s, recs("a")...)
	if got := claim(t, s, "w", 10, time.Minute); !slices.Equal(idsOf(got), ids) {
		t.Fatalf("claimed %v from the table made again, want %v", idsOf(got), ids)
	}
}

// TestMigrateRefusesAnotherTable: a table of the outbox's name without the
// outbox's columns (or of the skipped table's name) is refused, naming
// what it lacks, and nothing is created or recorded.
func TestMigrateRefusesAnotherTable(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	for _, which := range []string{"outbox", "skipped"} {
		name := newTable(t, db)
		s, err := New(db, Config{Table: name})
		must(t, err)
		foreign := s.table
		if which == "skipped" {
			foreign = s.SkippedTable()
		}
		must(t, exec(t, s, "CREATE TABLE "+foreign+" (id BIGINT PRIMARY KEY, `key` TEXT, note TEXT)"))
		err = s.Migrate(t.Context())
		if !errors.Is(err, storage.ErrNotOutboxTable) || !strings.Contains(err.Error(), foreign+" exists but has no column uuid, topic,") {
			t.Fatalf("Migrate with another %s table = %v, want ErrNotOutboxTable naming the missing columns", which, err)
		}
		var n int
		must(t, db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE ?", name+"%").Scan(&n))
		if n != 1 {
			t.Fatalf("%d tables named after %s after the refused Migrate, want only the foreign one", n, name)
		}
	}
}

// TestSchemaLockName: the schema lock of a table is one lock whatever the
// spelling of the table ("t", "db.t"), and its name stays within MySQL 8's
// 64 characters for the longest table name allowed.
func TestSchemaLockName(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	ctx := t.Context()
	name := newTable(t, db)
	long := name + strings.Repeat("x", maxIdentifierLen-len(migrationsSuffix)-len(name))
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+long+"`, `"+long+"_skipped`, `"+long+"_migrations`, `"+long+"_keys`")
	})
	var dbName string
	must(t, db.QueryRowContext(ctx, "SELECT DATABASE()").Scan(&dbName))
	plain, err := New(db, Config{Table: long})
	must(t, err)
	qualified, err := New(db, Config{Table: dbName + "." + long})
	must(t, err)
	conn, err := db.Conn(ctx)
	must(t, err)
	defer conn.Close()
	lock, err := plain.lockName(ctx, conn)
	must(t, err)
	if other, err := qualified.lockName(ctx, conn); err != nil || other != lock {
		t.Fatalf("lock names %q and %q (%v), want one name for both spellings", lock, other, err)
	}
	if len(lock) > 64 {
		t.Fatalf("lock name %q is %d characters, more than MySQL 8's 64", lock, len(lock))
	}
	// While another session holds the lock, Migrate of either spelling
	// waits for it.
	var got int
	must(t, conn.QueryRowContext(ctx, "SELECT GET_LOCK(?, 0)", lock).Scan(&got))
	if got != 1 {
		t.Fatalf("GET_LOCK(%q) = %d", lock, got)
	}
	for _, s := range []*Storage{plain, qualified} {
		wait, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		err := s.Migrate(wait)
		cancel()
		if err == nil {
			t.Fatalf("Migrate of %s ran while another session held the schema lock", s.config.Table)
		}
	}
	must(t, conn.QueryRowContext(ctx, "SELECT RELEASE_LOCK(?)", lock).Scan(&got))
	must(t, qualified.Migrate(ctx))
	must(t, plain.Migrate(ctx))
}
