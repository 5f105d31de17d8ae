package postgres

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox/internal/pgbouncertest"
	"github.com/txoutbox/txoutbox/storage"
)

func version(t *testing.T, s *Storage) int {
	t.Helper()
	st, err := s.MigrationStatus(t.Context())
	must(t, err)
	return st.Current
}

// TestConcurrentMigrate: 8 callers, 20 rounds each, with the notify trigger,
// next to an open producer transaction: no error (the CreateSchema that
// dropped and re-created the trigger at every call failed with 40P01 when
// four started at once), and none waits for the producer: an up-to-date
// schema takes no lock on the outbox table.
func TestConcurrentMigrate(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{NotifyChannel: "wake"})
	ctx := t.Context()
	producer, err := s.pool.Begin(ctx)
	must(t, err)
	defer producer.Rollback(ctx) //nolint:errcheck // test
	_, err = s.insert(ctx, producer, recs("a"), false)
	must(t, err)
	var wg sync.WaitGroup
	var failed atomic.Int64
	for range 8 {
		wg.Go(func() {
			for range 20 {
				cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				err := s.Migrate(cctx)
				cancel()
				if err != nil {
					failed.Add(1)
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	must(t, producer.Commit(ctx))
	if n := failed.Load(); n > 0 {
		t.Fatalf("%d of 160 Migrate calls failed", n)
	}
}

// TestConcurrentMigrateFresh: callers racing on an empty schema apply each
// step once.
func TestConcurrentMigrateFresh(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	s, err := New(testPool(t), Config{Table: schema + ".outbox", NotifyChannel: "wake"})
	must(t, err)
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for range 6 {
		wg.Go(func() { errs <- s.Migrate(t.Context()) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		must(t, err)
	}
	st, err := s.MigrationStatus(t.Context())
	must(t, err)
	if st.Current != LatestVersion() || len(st.Applied) != LatestVersion() {
		t.Fatalf("MigrationStatus = %+v, want each of the %d steps once", st, LatestVersion())
	}
}

// TestMigrateUpToDateTakesNoLock: with the outbox table locked by another
// transaction (ACCESS EXCLUSIVE, which conflicts with every lock), Migrate
// of an up-to-date database returns at once: it read the catalog only.
func TestMigrateUpToDateTakesNoLock(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{NotifyChannel: "wake"})
	ctx := t.Context()
	hold, err := s.pool.Begin(ctx)
	must(t, err)
	defer hold.Rollback(ctx) //nolint:errcheck // test
	_, err = hold.Exec(ctx, "LOCK TABLE "+s.table+" IN ACCESS EXCLUSIVE MODE")
	must(t, err)
	// Far below SchemaLockTimeout: a Migrate that waited for the table
	// would fail here.
	cctx, cancel := context.WithTimeout(ctx, SchemaLockTimeout/2)
	defer cancel()
	must(t, s.Migrate(cctx))
}

// TestMigrateLockTimeout: a change that needs a table lock held by a long
// transaction fails after the lock timeout with an error that says so.
func TestMigrateLockTimeout(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for SchemaLockTimeout")
	}
	t.Parallel()
	s := newStore(t, Config{})
	ctx := t.Context()
	hold, err := s.pool.Begin(ctx)
	must(t, err)
	defer hold.Rollback(ctx) //nolint:errcheck // test
	_, err = hold.Exec(ctx, "LOCK TABLE "+s.table+" IN ACCESS EXCLUSIVE MODE")
	must(t, err)
	s2, err := New(s.pool, Config{Table: s.ident[0] + ".outbox", NotifyChannel: "new"}) // needs a trigger
	must(t, err)
	if err := s2.Migrate(ctx); err == nil || !strings.Contains(err.Error(), "no lock within") {
		t.Fatalf("Migrate = %v, want a lock timeout", err)
	}
}

// TestMigrateTrigger: the trigger is created when missing, or when it
// notifies another channel, and left alone otherwise (same oid).
func TestMigrateTrigger(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	ctx := t.Context()
	trigger := func() (oid uint32) {
		t.Helper()
		err := s.pool.QueryRow(ctx, `SELECT oid FROM pg_trigger WHERE tgrelid = to_regclass($1) AND tgname = 'outbox_notify_trg'`, s.table).Scan(&oid)
		if errors.Is(err, pgx.ErrNoRows) {
			return 0
		}
		must(t, err)
		return oid
	}
	if trigger() != 0 {
		t.Fatal("a trigger without NotifyChannel")
	}
	withCh, err := New(s.pool, Config{Table: s.ident[0] + ".outbox", NotifyChannel: "wake"})
	must(t, err)
	must(t, withCh.Migrate(ctx))
	first := trigger()
	if first == 0 {
		t.Fatal("Migrate with NotifyChannel created no trigger on an up-to-date schema")
	}
	must(t, withCh.Migrate(ctx))
	if got := trigger(); got != first {
		t.Fatalf("second Migrate re-created the trigger (oid %d, was %d)", got, first)
	}
	other, err := New(s.pool, Config{Table: s.ident[0] + ".outbox", NotifyChannel: "other"})
	must(t, err)
	must(t, other.Migrate(ctx))
	var src string
	must(t, s.pool.QueryRow(ctx, `SELECT prosrc FROM pg_proc WHERE oid = to_regproc($1)`, siblingName(s.ident, "notify")).Scan(&src))
	if !strings.Contains(src, "pg_notify('other'") {
		t.Fatalf("trigger function after a Migrate with channel other: %s", src)
	}
}

func TestMigrateRefusesNewerDatabase(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{NotifyChannel: "wake"})
	_, err := s.pool.Exec(t.Context(), fmt.Sprintf(`INSERT INTO %s (version, name) VALUES (99, 'future')`, s.MigrationTable()))
	must(t, err)
	if err := s.Migrate(t.Context()); err == nil || !strings.Contains(err.Error(), "newer than this code") {
		t.Fatalf("Migrate = %v, want a refusal of version 99", err)
	}
}

// dumpRows reads every row of the outbox, lease and delivered tables, as
// text, in id order.
func dumpRows(t *testing.T, s *Storage) []string {
	t.Helper()
	var out []string
	// The outbox columns every version has (later steps add others).
	outbox := `(id, uuid, topic, key, payload, metadata, created_at, due_at, attempts, status, last_error, delivered_at)`
	for _, q := range []struct{ cols, table string }{{outbox, s.table}, {"r", s.leases}, {"r", s.delivered}} {
		rows, err := s.pool.Query(t.Context(), fmt.Sprintf(`SELECT %s::text FROM %s r ORDER BY id`, q.cols, q.table))
		must(t, err)
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		must(t, err)
		out = append(out, got...)
	}
	return out
}

// TestMigrateUpgradeFromVersion1 brings a database at version 1 (and 2) to the
// latest with records pending, leased, waiting for a retry, dead and
// delivered in it: every row is as it was, and the records then come out
// in per-key order. Version 1 comes two ways: recorded in the version table,
// and made by the CreateSchema of before versioning (no version table, the
// same DDL), which Migrate adopts without running step 1 again.
func TestMigrateUpgradeFromVersion1(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		from     int
		recorded bool
	}{{1, true}, {1, false}, {2, true}} {
		t.Run(fmt.Sprintf("from=%d/recorded=%v", c.from, c.recorded), func(t *testing.T) {
			t.Parallel()
			schema := newSchema(t)
			ctx := t.Context()
			s, err := New(testPool(t), Config{Table: schema + ".outbox"})
			must(t, err)
			for _, st := range loadSteps()[:c.from] {
				_, err = s.pool.Exec(ctx, s.render(st.Up), pgx.QueryExecModeSimpleProtocol)
				must(t, err)
			}
			if c.recorded {
				_, err = s.pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())`,
					s.MigrationTable()), pgx.QueryExecModeSimpleProtocol)
				must(t, err)
				for _, st := range loadSteps()[:c.from] {
					_, err = s.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (version, name) VALUES ($1, $2)`, s.MigrationTable()), st.Version, st.Name)
					must(t, err)
				}
				if v := version(t, s); v != c.from {
					t.Fatalf("version %d, want %d", v, c.from)
				}
			}
			// a1 delivered, a2 dead, a3 a4 pending; b1 leased, b2 b3
			// behind it; c1 waiting for a retry, c2 behind it; k keyless.
			ids := insert(t, s, recs("a", "a", "b", "c", "")...)
			a1, a2, b1, c1 := ids[0], ids[1], ids[2], ids[3]
			// Claims and write-backs as the old versions made them (this
			// code's need the columns of later steps).
			exec := func(q string, args ...any) {
				t.Helper()
				_, err := s.pool.Exec(ctx, q, args...)
				must(t, err)
			}
			exec(fmt.Sprintf(`INSERT INTO %s (id, key, leased_by, leased_until, attempts)
SELECT id, key, 'old', now() + interval '1 hour', 1 FROM %s`, s.leases, s.table))
			exec(fmt.Sprintf(`WITH l AS (DELETE FROM %s WHERE id = ANY($1) RETURNING id, attempts),
d AS (DELETE FROM %s o USING l WHERE o.id = l.id RETURNING o.id, o.uuid, o.topic, o.key, o.created_at, l.attempts)
INSERT INTO %s (id, uuid, topic, key, created_at, delivered_at, attempts) SELECT id, uuid, topic, key, created_at, now(), attempts FROM d`,
				s.leases, s.table, s.delivered), []int64{a1, ids[4]})
			// A dead-letter as version 1 wrote it (it had no dead_at).
			exec(fmt.Sprintf(`WITH l AS (DELETE FROM %s WHERE id = $1 RETURNING id, attempts)
UPDATE %s o SET status = 'dead', attempts = l.attempts, last_error = 'poison' FROM l WHERE o.id = l.id`, s.leases, s.table), a2)
			exec(fmt.Sprintf(`WITH l AS (DELETE FROM %s WHERE id = $1 RETURNING id, attempts)
UPDATE %s o SET attempts = l.attempts, last_error = 'later', due_at = clock_timestamp() + interval '300 milliseconds' FROM l WHERE o.id = l.id`,
				s.leases, s.table), c1)
			more := insert(t, s, recs("a", "a", "b", "b", "c", "")...)
			before := dumpRows(t, s)

			must(t, s.Migrate(ctx))
			if v := version(t, s); v != LatestVersion() {
				t.Fatalf("version %d after Migrate, want %d", v, LatestVersion())
			}
			if after := dumpRows(t, s); !slices.Equal(before, after) {
				t.Fatalf("rows changed by the upgrade:\nbefore %v\nafter  %v", before, after)
			}
			// Drain: b1's lease is live (held by "old", an hour), so only
			// after it is acked does key b go on. Every record comes out
			// once, each key in id order.
			must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, b1), WorkerID: "old"}))
			var order []storage.Record
			deadline := time.Now().Add(10 * time.Second)
			for len(order) < len(more)+1 && time.Now().Before(deadline) {
				got := claim(t, s, "new", 2, time.Minute)
				order = append(order, got...)
				var gotIDs []int64
				for _, r := range got {
					gotIDs = append(gotIDs, r.ID)
				}
				if len(gotIDs) > 0 {
					must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, gotIDs...), WorkerID: "new"}))
				} else {
					time.Sleep(20 * time.Millisecond)
				}
			}
			perKey := map[string][]int64{}
			for _, r := range order {
				perKey[r.Key] = append(perKey[r.Key], r.ID)
			}
			want := map[string][]int64{"a": more[0:2], "b": more[2:4], "c": {c1, more[4]}, "": more[5:6]}
			for k, w := range want {
				if !slices.Equal(perKey[k], w) {
					t.Errorf("key %q delivered %v after the upgrade, want %v", k, perKey[k], w)
				}
			}
			if st := inspect(t, s, a2); st.Status != storage.StatusDead || st.LastError != "poison" {
				t.Errorf("dead record after the upgrade: %+v", st)
			}
		})
	}
}

// TestDiagnose: an up-to-date table passes every check; a dropped index, a
// missing trigger and an old version are reported as problems.
func TestDiagnose(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{NotifyChannel: "wake"})
	ctx := t.Context()
	findings := func() map[string]storage.Finding {
		t.Helper()
		fs, err := s.Diagnose(ctx)
		must(t, err)
		m := map[string]storage.Finding{}
		for _, f := range fs {
			m[f.Check] = f
		}
		return m
	}
	for check, f := range findings() {
		if f.Severity != storage.SeverityOK {
			t.Errorf("%s: %s %s on a fresh table", check, f.Severity, f.Message)
		}
	}
	_, err := s.pool.Exec(ctx, fmt.Sprintf(`DROP INDEX %s; DROP TRIGGER outbox_notify_trg ON %s; UPDATE %s SET version = 99 WHERE version = 1`,
		siblingName(s.ident, "dead_key_idx"), s.table, s.MigrationTable()), pgx.QueryExecModeSimpleProtocol)
	must(t, err)
	got := findings()
	for check, want := range map[string]string{"schema drift": "outbox_dead_key_idx is missing", "notify trigger": "migrate up --notify-channel wake",
		"schema version": "newer than this build"} {
		if f := got[check]; f.Severity != storage.SeverityProblem || !strings.Contains(f.Message, want) {
			t.Errorf("%s: %+v, want a problem saying %q", check, f, want)
		}
	}
}

// TestDiagnoseDrift alters the schema the migrations made: an index
// re-created on other columns, one with another predicate, a column of
// another type and an extra index. The expectation comes from the
// migrations themselves (built in temporary tables).
func TestDiagnoseDrift(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	ctx := t.Context()
	drift := func() storage.Finding {
		t.Helper()
		fs, err := s.Diagnose(ctx)
		must(t, err)
		for _, f := range fs {
			if f.Check == "schema drift" {
				return f
			}
		}
		t.Fatalf("no schema drift finding in %+v", fs)
		return storage.Finding{}
	}
	if f := drift(); f.Severity != storage.SeverityOK {
		t.Fatalf("fresh table: %+v", f)
	}
	schema := s.ident[0]
	run := func(q string) {
		t.Helper()
		_, err := s.pool.Exec(ctx, strings.ReplaceAll(q, "{s}", schema), pgx.QueryExecModeSimpleProtocol)
		must(t, err)
	}
	run(`CREATE INDEX outbox_extra_idx ON {s}.outbox (topic)`)
	if f := drift(); f.Severity != storage.SeverityWarning || !strings.Contains(f.Message, "index outbox_extra_idx on outbox (btree (topic)) is not txoutbox's") {
		t.Errorf("extra index: %+v, want a warning naming it", f)
	}
	run(`DROP INDEX {s}.outbox_dead_key_idx; CREATE INDEX outbox_dead_key_idx ON {s}.outbox (topic, id) WHERE status = 'dead' AND key <> '';
DROP INDEX {s}.outbox_dead_idx; CREATE INDEX outbox_dead_idx ON {s}.outbox (topic, id) WHERE status = 'dead' OR status = 'pending';
ALTER TABLE {s}.outbox_skipped ALTER COLUMN attempts TYPE bigint`)
	f := drift()
	for _, want := range []string{
		`index outbox_dead_key_idx differs: found "btree (topic, id) WHERE status = 'dead'::text AND key <> ''::text", expected "btree (key, id) WHERE status = 'dead'::text AND key <> ''::text"`,
		`index outbox_dead_idx differs: found "btree (topic, id) WHERE status = 'dead'::text OR status = 'pending'::text", expected "btree (topic, id) WHERE status = 'dead'::text"`,
		"column attempts of outbox_skipped differs: found bigint, expected integer",
	} {
		if f.Severity != storage.SeverityProblem || !strings.Contains(f.Message, want) {
			t.Errorf("altered schema: %s %s\nwant a problem saying %s", f.Severity, f.Message, want)
		}
	}
	// An unqualified table, found through search_path, is compared the same way.
	cfg, err := pgxpool.ParseConfig(testDatabaseURL())
	must(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	must(t, err)
	t.Cleanup(p.Close)
	u, err := New(p, Config{})
	must(t, err)
	fs, err := u.Diagnose(ctx)
	must(t, err)
	for _, g := range fs {
		if g.Check == "schema drift" && (g.Message != f.Message || g.Severity != f.Severity) {
			t.Errorf("unqualified table: %+v, want %+v", g, f)
		}
	}
	run(`DROP TABLE {s}.outbox_leases; ALTER TABLE {s}.outbox DROP COLUMN last_error`)
	if f := drift(); !strings.Contains(f.Message, "table outbox_leases is missing") || !strings.Contains(f.Message, "column last_error of outbox is missing") {
		t.Errorf("dropped table and column: %+v", f)
	}
}

// TestDiagnoseDetectsTransactionPooler runs PgBouncer in transaction mode
// in front of the test database: through it the LISTEN probe gets no
// notification and Diagnose warns; directly it works (TestDiagnose).
func TestDiagnoseDetectsTransactionPooler(t *testing.T) {
	t.Parallel()
	direct := newStore(t, Config{})
	bouncerURL := pgbouncertest.Start(t, testDatabaseURL())
	cfg, err := pgxpool.ParseConfig(bouncerURL)
	must(t, err)
	// PgBouncer 1.18 keeps no prepared statement across transactions.
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	p, err := pgxpool.NewWithConfig(t.Context(), cfg)
	must(t, err)
	t.Cleanup(p.Close)
	s, err := New(p, Config{Table: direct.ident[0] + ".outbox"})
	must(t, err)
	fs, err := s.Diagnose(t.Context())
	must(t, err)
	var listen storage.Finding
	for _, f := range fs {
		if f.Check == "LISTEN" {
			listen = f
		} else if f.Severity != storage.SeverityOK {
			t.Errorf("%s: %s %s through PgBouncer", f.Check, f.Severity, f.Message)
		}
	}
	if listen.Severity != storage.SeverityWarning || !strings.Contains(listen.Message, "transaction-mode pooler") {
		t.Fatalf("LISTEN finding through PgBouncer in transaction mode: %+v, want a warning naming the pooler", listen)
	}
}

// TestSlotColumnMatchesSlotCount: the slot column of step 1 is the hash of
// the key modulo slotCount, as the claim assumes.
func TestSlotColumnMatchesSlotCount(t *testing.T) {
	want := fmt.Sprintf("(CASE WHEN key = '' THEN id %% %d ELSE hashtext(key) & %d END)", slotCount, slotCount-1)
	if !strings.Contains(loadSteps()[0].Up, want) {
		t.Fatalf("step 1's slot column is not %s", want)
	}
}
