package postgres

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/txoutbox/txoutbox/internal/migfiles"
	"github.com/txoutbox/txoutbox/storage"
)

// ListenProbeTimeout is how long [Storage.Diagnose] waits for its own
// notification before it concludes that LISTEN does not work on this
// connection (a transaction-mode pooler).
const ListenProbeTimeout = 3 * time.Second

// Diagnose implements [storage.Diagnoser]. Its checks:
//
//   - schema version: the version table against [LatestVersion];
//   - schema drift: the tables, their columns (name and type) and their
//     indexes (columns, order, predicate) against what the migrations make,
//     built in temporary tables in a transaction that is rolled back, so
//     the expectation follows the migration files: a missing table, column
//     or index, or an index defined otherwise, is a problem; an index the
//     migrations do not make, on one of their tables, is a warning;
//   - notify trigger: with [Config.NotifyChannel], the trigger exists and
//     notifies that channel; without it, whether a trigger is there at all;
//   - privileges, of the role the storage connects as: what a forwarder
//     needs (a problem when missing: SELECT, UPDATE and DELETE on the outbox
//     table; SELECT, INSERT, UPDATE and DELETE on the lease and worker
//     tables; SELECT and INSERT on the delivered table; SELECT on the
//     skipped table, which Stats counts), and what only Purge and Skip need
//     (a warning: DELETE on the delivered table, INSERT on the skipped one);
//   - LISTEN: a notification sent to a channel this connection listens on
//     comes back within [ListenProbeTimeout]. It does not behind a
//     transaction-mode pooler (PgBouncer pool_mode=transaction, Supavisor
//     port 6543), which hands the server connection to another client when
//     the LISTEN's transaction ends: the forwarders' Listen then never
//     wakes them, and they fall back to polling.
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

	drift, err := s.drift(ctx)
	if err != nil {
		return nil, err
	}
	out = append(out, drift)

	var hasTrigger bool
	if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = to_regclass($1) AND tgname = $2 AND NOT tgisinternal)`,
		s.table, derivedName(s.ident, "notify_trg")).Scan(&hasTrigger); err != nil {
		return nil, fmt.Errorf("diagnose %s: read the notify trigger: %w", s.table, err)
	}
	switch ch := s.config.NotifyChannel; {
	case ch != "":
		var ok bool
		if err := s.pool.QueryRow(ctx, `SELECT `+s.triggerOK()).Scan(&ok); err != nil {
			return nil, fmt.Errorf("diagnose %s: read the notify trigger: %w", s.table, err)
		}
		if ok {
			add("notify trigger", storage.SeverityOK, "notifies channel %s after every insert", ch)
		} else {
			add("notify trigger", storage.SeverityProblem, "missing, or not notifying channel %s: forwarders with Config.NotifyChannel %[1]s are never woken and only poll; run `txoutbox migrate up --notify-channel %[1]s`", ch)
		}
	case hasTrigger:
		add("notify trigger", storage.SeverityOK, "present (pass --notify-channel to check its channel)")
	default:
		add("notify trigger", storage.SeverityOK, "none: forwarders poll (set Config.NotifyChannel and run `txoutbox migrate up --notify-channel NAME` to wake them on insert)")
	}

	// What a forwarder needs (a problem when missing), then what only an
	// operator's Purge and Skip need (a warning).
	type need struct {
		table, priv string
		forwarder   bool
	}
	var needs []need
	for _, n := range []struct {
		table, privs string
		forwarder    bool
	}{
		{s.table, "SELECT, UPDATE, DELETE", true},
		{s.leases, "SELECT, INSERT, UPDATE, DELETE", true},
		{s.workers, "SELECT, INSERT, UPDATE, DELETE", true},
		{s.delivered, "SELECT, INSERT", true},
		{s.skipped, "SELECT", true},
		{s.delivered, "DELETE", false},
		{s.skipped, "INSERT", false},
	} {
		for _, p := range strings.Split(n.privs, ", ") {
			needs = append(needs, need{n.table, p, n.forwarder})
		}
	}
	var lacking, lackingOps []string
	for _, n := range needs {
		var ok *bool // NULL when the table is missing (reported as drift)
		if err := s.pool.QueryRow(ctx, `SELECT CASE WHEN to_regclass($1) IS NULL THEN NULL ELSE has_table_privilege(to_regclass($1), $2) END`,
			n.table, n.priv).Scan(&ok); err != nil {
			return nil, fmt.Errorf("diagnose %s: read privileges: %w", s.table, err)
		}
		if ok != nil && !*ok {
			what := n.priv + " on " + strings.ReplaceAll(n.table, `"`, "")
			if n.forwarder {
				lacking = append(lacking, what)
			} else {
				lackingOps = append(lackingOps, what)
			}
		}
	}
	var role string
	if err := s.pool.QueryRow(ctx, `SELECT current_user`).Scan(&role); err != nil {
		return nil, fmt.Errorf("diagnose %s: read the role: %w", s.table, err)
	}
	switch {
	case len(lacking) > 0:
		add("privileges", storage.SeverityProblem, "role %s lacks %s, which a forwarder needs: GRANT them to the forwarders' role", role, strings.Join(lacking, ", "))
	case len(lackingOps) > 0:
		add("privileges", storage.SeverityWarning, "role %s has what a forwarder needs, but lacks %s (Purge and Skip need them)", role, strings.Join(lackingOps, ", "))
	default:
		add("privileges", storage.SeverityOK, "role %s has what a forwarder needs on every table, and Purge and Skip too", role)
	}

	switch ok, err := s.listenWorks(ctx); {
	case err != nil:
		return nil, fmt.Errorf("diagnose %s: LISTEN probe: %w", s.table, err)
	case ok:
		add("LISTEN", storage.SeverityOK, "LISTEN works on this connection (direct, or a session-mode pooler)")
	default:
		add("LISTEN", storage.SeverityWarning,
			"a notification to a channel this connection listens on did not come back within %s: the URL points at a transaction-mode pooler (PgBouncer pool_mode=transaction, Supavisor port 6543), where LISTEN does not work. Forwarders still run, polling; to wake them on insert, give Storage.Listen a pool on a direct or session-mode URL (Supavisor port 5432), and keep the transaction-mode URL for Claim and the producers", ListenProbeTimeout)
	}
	return out, nil
}

// listenWorks listens on a fresh channel on one connection, notifies it
// from another and waits for the notification.
func (s *Storage) listenWorks(ctx context.Context) (bool, error) {
	var b [8]byte
	_, _ = rand.Read(b[:])
	channel := "txoutbox_probe_" + hex.EncodeToString(b[:])
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return false, err
	}
	// The connection may still listen (a pooler's server connection is
	// shared): it is closed rather than returned.
	defer func() { _ = conn.Hijack().Close(context.WithoutCancel(ctx)) }()
	if _, err := conn.Exec(ctx, "LISTEN "+channel); err != nil {
		return false, err
	}
	if _, err := s.pool.Exec(ctx, "SELECT pg_notify($1, 'probe')", channel); err != nil {
		return false, err
	}
	wctx, cancel := context.WithTimeout(ctx, ListenProbeTimeout)
	defer cancel()
	n, err := conn.Conn().WaitForNotification(wctx)
	switch {
	case err == nil:
		return n.Channel == channel, nil
	case errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil:
		return false, nil
	default:
		return false, err
	}
}

// pgCatalog is what the drift check compares: each table's columns in order
// and each index's definition, by name.
type pgCatalog struct {
	tables  []string
	columns map[string][]pgColumn // by table
	indexes map[string]pgIndex    // by index name
}

type pgColumn struct{ name, typ string }

type pgIndex struct {
	table string
	def   string // as a DBA reads it: "btree (key, id) WHERE status = 'dead'::text"
	valid bool   // false: left by a CREATE INDEX CONCURRENTLY that failed (or runs)
}

// drift compares the catalog of the outbox tables with the one the
// migrations make, which it builds in temporary tables (in a transaction
// it rolls back): the expectation is derived from the migration files
// themselves, whatever a step adds or drops.
func (s *Storage) drift(ctx context.Context) (storage.Finding, error) {
	finding := func(sev storage.Severity, format string, args ...any) storage.Finding {
		return storage.Finding{Check: "schema drift", Severity: sev, Message: fmt.Sprintf(format, args...)}
	}
	want, err := s.expectedCatalog(ctx)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" { // insufficient_privilege
		return finding(storage.SeverityWarning, "not checked: the expected schema could not be built in temporary tables (the role needs TEMPORARY on the database): %v", err), nil
	}
	if err != nil {
		return storage.Finding{}, fmt.Errorf("diagnose %s: build the expected schema: %w", s.table, err)
	}
	nsp := "(SELECT oid FROM pg_namespace WHERE nspname = current_schema())"
	if len(s.ident) == 2 {
		nsp = fmt.Sprintf("(SELECT oid FROM pg_namespace WHERE nspname = %s)", lit(s.ident[0]))
	} else {
		nsp = fmt.Sprintf("COALESCE((SELECT relnamespace FROM pg_class WHERE oid = to_regclass(%s)), %s)", lit(s.table), nsp)
	}
	got, err := readCatalog(ctx, s.pool, nsp, want.tables)
	if err != nil {
		return storage.Finding{}, fmt.Errorf("diagnose %s: read the catalog: %w", s.table, err)
	}

	var problems, warnings []string
	for _, table := range want.tables {
		cols, ok := got.columns[table]
		if !ok {
			problems = append(problems, "table "+table+" is missing")
			continue
		}
		for _, w := range want.columns[table] {
			i := slices.IndexFunc(cols, func(c pgColumn) bool { return c.name == w.name })
			switch {
			case i < 0:
				problems = append(problems, fmt.Sprintf("column %s of %s is missing", w.name, table))
			case cols[i].typ != w.typ:
				problems = append(problems, fmt.Sprintf("column %s of %s differs: found %s, expected %s", w.name, table, cols[i].typ, w.typ))
			}
		}
	}
	for _, name := range slices.Sorted(maps.Keys(want.indexes)) {
		w := want.indexes[name]
		if _, ok := got.columns[w.table]; !ok {
			continue // the table is missing, said above
		}
		switch g, ok := got.indexes[name]; {
		case !ok:
			problems = append(problems, fmt.Sprintf("index %s is missing (expected %q on %s)", name, w.def, w.table))
		case g.table != w.table:
			problems = append(problems, fmt.Sprintf("index %s differs: found %q on %s, expected %q on %s", name, g.def, g.table, w.def, w.table))
		case !g.valid:
			problems = append(problems, fmt.Sprintf("index %s is not valid (a CREATE INDEX CONCURRENTLY that failed, or is still running): queries do not use it, every write updates it; drop it and build it again", name))
		case g.def != w.def:
			problems = append(problems, fmt.Sprintf("index %s differs: found %q, expected %q", name, g.def, w.def))
		}
	}
	for _, name := range slices.Sorted(maps.Keys(got.indexes)) {
		if _, ok := want.indexes[name]; !ok {
			warnings = append(warnings, fmt.Sprintf("index %s on %s (%s) is not txoutbox's: every write updates it", name, got.indexes[name].table, got.indexes[name].def))
		}
	}
	switch {
	case len(problems) > 0:
		return finding(storage.SeverityProblem, "%s (`txoutbox migrate sql` prints the expected schema; `txoutbox migrate up` creates what is missing from a step not yet applied)",
			strings.Join(problems, "; ")), nil
	case len(warnings) > 0:
		return finding(storage.SeverityWarning, "%s", strings.Join(warnings, "; ")), nil
	}
	return finding(storage.SeverityOK, "%d tables and %d indexes as the migrations make them", len(want.tables), len(want.indexes)), nil
}

// expectedCatalog runs every up step on temporary tables named like the
// outbox tables (pg_temp.outbox, ...), reads their catalog and rolls back.
func (s *Storage) expectedCatalog(ctx context.Context) (pgCatalog, error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return pgCatalog{}, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // always rolled back: nothing is kept
	ident := pgx.Identifier{"pg_temp", s.ident[len(s.ident)-1]}
	scratch := &Storage{ident: ident, table: ident.Sanitize()}
	// Temporary tables the session had before are not the migrations'.
	var before []string
	if err := tx.QueryRow(ctx, `SELECT COALESCE(array_agg(relname::text), '{}') FROM pg_class WHERE relnamespace = pg_my_temp_schema()`).Scan(&before); err != nil {
		return pgCatalog{}, err
	}
	for _, st := range loadSteps() {
		if _, err := tx.Exec(ctx, scratch.render(st.Up), pgx.QueryExecModeSimpleProtocol); err != nil {
			return pgCatalog{}, fmt.Errorf("step %d (%s): %w", st.Version, st.Name, err)
		}
	}
	c, err := readCatalog(ctx, tx, "pg_my_temp_schema()", nil)
	if err != nil {
		return pgCatalog{}, err
	}
	c.tables = slices.DeleteFunc(c.tables, func(t string) bool { return slices.Contains(before, t) })
	return c, nil
}

// readCatalog reads the columns and indexes of the tables named (every
// table when names is nil) in the schema whose oid the SQL expression nsp
// gives.
func readCatalog(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, nsp string, names []string) (pgCatalog, error) {
	c := pgCatalog{columns: map[string][]pgColumn{}, indexes: map[string]pgIndex{}}
	columnsSQL := `SELECT c.relname::text, a.attname::text, format_type(a.atttypid, a.atttypmod)
FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
WHERE c.relnamespace = ` + nsp + ` AND c.relkind IN ('r', 'p') AND a.attnum > 0 AND NOT a.attisdropped
    AND ($1::text[] IS NULL OR c.relname = ANY($1::text[]))
ORDER BY c.relname, a.attnum`
	indexesSQL := `SELECT t.relname::text, c.relname::text, pg_get_indexdef(i.indexrelid, 0, true), i.indisvalid AND i.indisready
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_class t ON t.oid = i.indrelid
WHERE t.relnamespace = ` + nsp + ` AND t.relkind IN ('r', 'p') AND ($1::text[] IS NULL OR t.relname = ANY($1::text[]))`
	rows, err := q.Query(ctx, columnsSQL, names) //nolint:rowserrcheck // pgx.ForEachRow closes rows and returns rows.Err()
	if err != nil {
		return c, err
	}
	var table, name, def string
	_, err = pgx.ForEachRow(rows, []any{&table, &name, &def}, func() error {
		if _, ok := c.columns[table]; !ok {
			c.tables = append(c.tables, table)
		}
		c.columns[table] = append(c.columns[table], pgColumn{name, def})
		return nil
	})
	if err != nil {
		return c, err
	}
	rows, err = q.Query(ctx, indexesSQL, names) //nolint:rowserrcheck // pgx.ForEachRow closes rows and returns rows.Err()
	if err != nil {
		return c, err
	}
	var valid bool
	_, err = pgx.ForEachRow(rows, []any{&table, &name, &def, &valid}, func() error {
		c.indexes[name] = pgIndex{table, indexDef(def), valid}
		return nil
	})
	return c, err
}

// indexDef shortens CREATE [UNIQUE] INDEX name ON table USING btree (...)
// WHERE ... to what differs between indexes: "[UNIQUE ]btree (...) WHERE ...".
func indexDef(def string) string {
	unique := strings.HasPrefix(def, "CREATE UNIQUE INDEX ")
	if _, rest, ok := strings.Cut(def, " USING "); ok {
		def = rest
	}
	if unique {
		def = "UNIQUE " + def
	}
	return def
}
