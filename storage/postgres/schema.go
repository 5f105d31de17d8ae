package postgres

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// SchemaLockTimeout bounds how long [Storage.CreateSchema] waits for a lock
// (its own advisory lock, or a table lock when something must change) before
// it gives up with an error naming the table.
const SchemaLockTimeout = 10 * time.Second

// schemaStep is one idempotent DDL statement and, for CreateSchema, a SQL
// condition that is true when the statement has something to do: CreateSchema
// runs only those, so that a start-up against an up-to-date schema takes no
// lock on the outbox table.
type schemaStep struct {
	needed string // SQL boolean expression, read from the catalog
	sql    string
}

func lit(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// schemaSteps is the DDL in order: the current shape, then the upgrade of a
// table created by an earlier version (slot column, workers table and their
// indexes go; parked and txid come, with no rewrite of the table).
func (s *Storage) schemaSteps() []schemaStep {
	t := s.table
	rel := lit(t)
	sib := func(suffix string) string { return siblingName(s.ident, suffix) }
	idx := func(suffix string) string { return pgx.Identifier{derivedName(s.ident, suffix)}.Sanitize() }
	// Indexes live in the table's schema.
	idxRel := func(suffix string) string { return lit(sib(suffix)) }
	hasColumn := func(col string) string {
		return fmt.Sprintf("EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = %s AND NOT attisdropped)", rel, lit(col))
	}
	exists := func(name string) string { return fmt.Sprintf("to_regclass(%s) IS NOT NULL", name) }
	steps := []schemaStep{
		{fmt.Sprintf("NOT (%s)", exists(rel)), fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %[1]s (
    id           BIGSERIAL PRIMARY KEY,
    uuid         TEXT        NOT NULL,
    topic        TEXT        NOT NULL,
    key          TEXT        NOT NULL DEFAULT '',
    payload      BYTEA,
    metadata     JSONB,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    due_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    attempts     INTEGER     NOT NULL DEFAULT 0,
    status       TEXT        NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'delivered', 'dead')),
    last_error   TEXT,
    delivered_at TIMESTAMPTZ,
    -- Strict ordering: true for a row known to be behind an earlier pending
    -- row of its key. The lowest pending row of a key is never parked; an
    -- ack or a dead-letter unparks the next one. Parked rows are not walked
    -- by claims, so a long queue behind a key costs a claim nothing.
    parked       BOOLEAN     NOT NULL DEFAULT false,
    -- Config.CommitOrderFence: the inserting transaction, so that a claim can
    -- wait until no earlier transaction is still running. NULL on rows
    -- inserted before the column existed.
    txid         XID8        DEFAULT pg_current_xact_id()
)`, t)},
		// Upgrade of a table created by an earlier version. ADD COLUMN with a
		// constant default, or with none, rewrites nothing; the txid default
		// is set afterwards so existing rows keep NULL (a volatile default in
		// ADD COLUMN would rewrite the table). Existing rows are unparked:
		// nothing is parked yet, which satisfies the invariant, and claims
		// park what they find behind a held head.
		{fmt.Sprintf("%s AND NOT %s", exists(rel), hasColumn("parked")),
			fmt.Sprintf(`ALTER TABLE %s ADD COLUMN IF NOT EXISTS parked BOOLEAN NOT NULL DEFAULT false`, t)},
		{fmt.Sprintf("%s AND NOT %s", exists(rel), hasColumn("txid")),
			fmt.Sprintf(`ALTER TABLE %[1]s ADD COLUMN IF NOT EXISTS txid XID8;
ALTER TABLE %[1]s ALTER COLUMN txid SET DEFAULT pg_current_xact_id()`, t)},

		// The claim's walk: pending rows that are not parked, by due time.
		// Rows waiting for a retry are not due and parked rows are not in
		// it, so a claim walks due heads, rows in flight, keyless rows and
		// fresh rows only.
		{fmt.Sprintf("NOT (%s)", exists(idxRel("walk_idx"))),
			fmt.Sprintf(`CREATE INDEX IF NOT EXISTS %s ON %s (due_at, id) WHERE status = 'pending' AND NOT parked`, idx("walk_idx"), t)},
		// Strict ordering: the pending rows of one key in id order (is there
		// an earlier one? which rows follow a head? which one is the next
		// head once a record is acked?).
		{fmt.Sprintf("NOT (%s)", exists(idxRel("key_idx"))),
			fmt.Sprintf(`CREATE INDEX IF NOT EXISTS %s ON %s (key, id) WHERE status = 'pending' AND key <> ''`, idx("key_idx"), t)},
		// Purge: outbox rows marked delivered in place (by hand, or by an
		// early version whose ack updated the row; an ack now moves the
		// record to the delivered table, so this index stays empty).
		{fmt.Sprintf("NOT (%s)", exists(idxRel("delivered_idx"))),
			fmt.Sprintf(`CREATE INDEX IF NOT EXISTS %s ON %s (delivered_at) WHERE status = 'delivered'`, idx("delivered_idx"), t)},
		// Redrive and inspection of dead-lettered rows by topic.
		{fmt.Sprintf("NOT (%s)", exists(idxRel("dead_idx"))),
			fmt.Sprintf(`CREATE INDEX IF NOT EXISTS %s ON %s (topic, id) WHERE status = 'dead'`, idx("dead_idx"), t)},

		// What an earlier version used and this one does not: the key slots
		// (a generated column and its index), the held-back index and the
		// workers table.
		{exists(idxRel("pending_idx")), fmt.Sprintf(`DROP INDEX IF EXISTS %s`, sib("pending_idx"))},
		{exists(idxRel("rescheduled_idx")), fmt.Sprintf(`DROP INDEX IF EXISTS %s`, sib("rescheduled_idx"))},
		{fmt.Sprintf("%s AND %s", exists(rel), hasColumn("slot")), fmt.Sprintf(`ALTER TABLE %s DROP COLUMN IF EXISTS slot`, t)},
		{exists(lit(sib("workers"))), fmt.Sprintf(`DROP TABLE IF EXISTS %s`, sib("workers"))},

		// Leases live in their own narrow table: a claim inserts one small
		// row per record instead of writing a new version of the wide outbox
		// row; every write-back deletes the lease in the same statement.
		// attempts here is the attempt number of the live claim (it counts
		// claims whose lease ran out, which the outbox row learns at the
		// next write-back).
		{fmt.Sprintf("NOT (%s)", exists(lit(s.leases))), fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
    id           BIGINT      PRIMARY KEY,
    key          TEXT        NOT NULL,
    leased_by    TEXT        NOT NULL,
    leased_until TIMESTAMPTZ NOT NULL,
    attempts     INTEGER     NOT NULL
)`, s.leases)},
		// Delivered records: an ack deletes the outbox row and adds a narrow
		// row here (no payload, no metadata); Stats counts these rows and
		// Purge deletes them by age. Appended in delivery order, never
		// updated.
		{fmt.Sprintf("NOT (%s)", exists(lit(s.delivered))), fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
    id           BIGINT      NOT NULL,
    uuid         TEXT        NOT NULL,
    topic        TEXT        NOT NULL,
    key          TEXT        NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL,
    delivered_at TIMESTAMPTZ NOT NULL,
    attempts     INTEGER     NOT NULL,
    last_error   TEXT
)`, s.delivered)},
		{fmt.Sprintf("NOT (%s)", exists(idxRel("delivered_at_idx"))),
			fmt.Sprintf(`CREATE INDEX IF NOT EXISTS %s ON %s (delivered_at)`, idx("delivered_at_idx"), s.delivered)},
	}
	if ch := s.config.NotifyChannel; ch != "" {
		fn := sib("notify")
		trgName := derivedName(s.ident, "notify_trg")
		// The channel passed checkIdentifier, so it is safe inside a string
		// literal. CREATE OR REPLACE FUNCTION takes no lock on the table.
		steps = append(steps, schemaStep{"true", fmt.Sprintf(`CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS $txoutbox$
BEGIN
    PERFORM pg_notify('%s', '');
    RETURN NULL;
END
$txoutbox$`, fn, ch)},
			// LISTEN/NOTIFY wake-up: one notification per INSERT statement,
			// not per row. CREATE OR REPLACE TRIGGER locks the table (SHARE
			// ROW EXCLUSIVE), so CreateSchema runs it only when the trigger
			// is missing.
			schemaStep{fmt.Sprintf("NOT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = to_regclass(%s) AND tgname = %s)", rel, lit(trgName)),
				fmt.Sprintf(`CREATE OR REPLACE TRIGGER %s AFTER INSERT ON %s
    FOR EACH STATEMENT EXECUTE FUNCTION %s()`, pgx.Identifier{trgName}.Sanitize(), t, fn)})
	}
	return steps
}

// SchemaSQL returns the DDL of the outbox table, its sibling tables, its
// indexes and, with [Config.NotifyChannel] set, its notify trigger, including
// the upgrade of a table created by an earlier version. Every statement is
// idempotent (IF NOT EXISTS / IF EXISTS / OR REPLACE), so the text can go
// into a migration as is. Run as a whole, it locks the outbox table even when
// nothing changes; [Storage.CreateSchema] reads the catalog first and runs
// only what is missing. The schema of a qualified table must already exist.
func (s *Storage) SchemaSQL() string {
	var b strings.Builder
	for _, st := range s.schemaSteps() {
		b.WriteString(st.sql)
		b.WriteString(";\n\n")
	}
	return b.String()
}

// CreateSchema creates or upgrades the schema ([Storage.SchemaSQL]) in one
// transaction. It is safe to run from many processes at once and next to live
// traffic: callers are serialised by an advisory lock derived from the table's
// resolved schema-qualified name (not its spelling), it reads the catalog and
// runs only the statements that have something to do (so an up-to-date schema
// costs no lock on the outbox table), and it waits at most
// [SchemaLockTimeout] for any lock, then fails with an error saying so.
// Creating the new indexes on a large table of an earlier version blocks
// inserts while they build: create them by hand first with CREATE INDEX
// CONCURRENTLY under the names SchemaSQL shows.
func (s *Storage) CreateSchema(ctx context.Context) error {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("create outbox schema: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	fail := func(what string, err error) error {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55P03" {
			return fmt.Errorf("create outbox schema for %s: %s: no lock within %s (a long transaction holds the table; retry later): %w", s.table, what, SchemaLockTimeout, err)
		}
		return fmt.Errorf("create outbox schema for %s: %s: %w", s.table, what, err)
	}
	if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL lock_timeout = %d", SchemaLockTimeout.Milliseconds())); err != nil {
		return fail("set lock_timeout", err)
	}
	if err := s.lockSchema(ctx, tx); err != nil {
		return fail("advisory lock", err)
	}

	steps := s.schemaSteps()
	conds := make([]string, len(steps))
	for i, st := range steps {
		conds[i] = st.needed
	}
	// One catalog read after the lock: whoever held it before has committed.
	needed := make([]bool, len(steps))
	if err := tx.QueryRow(ctx, "SELECT ARRAY["+strings.Join(conds, ",\n")+"]").Scan(&needed); err != nil {
		return fail("read the catalog", err)
	}
	for i, st := range steps {
		if !needed[i] {
			continue
		}
		// Simple protocol: a step may hold two statements.
		if _, err := tx.Exec(ctx, st.sql, pgx.QueryExecModeSimpleProtocol); err != nil {
			return fail(strings.SplitN(st.sql, "\n", 2)[0], err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fail("commit", err)
	}
	return nil
}

// lockSchema takes CreateSchema's advisory lock, keyed on a hash of the
// table's schema-qualified name as the server resolves it (the schema it is
// in, or the one it would be created in), so that "outbox" and
// "public.outbox" take the same lock.
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

// siblingName is an object named after the table (derivedName) in the
// table's schema, quoted for SQL: "app"."outbox_leases".
func siblingName(table pgx.Identifier, suffix string) string {
	return append(table[:len(table)-1:len(table)-1], derivedName(table, suffix)).Sanitize()
}

// derivedName names an object after the table ("outbox_walk_idx"). Names
// that would pass 63 bytes are shortened with a hash of the table name, because
// the server would truncate them and two indexes could end up with one name.
func derivedName(table pgx.Identifier, suffix string) string {
	base := table[len(table)-1]
	name := base + "_" + suffix
	if len(name) <= maxIdentifierLen {
		return name
	}
	h := fnv.New32a()
	h.Write([]byte(base))
	tag := fmt.Sprintf("%08x", h.Sum32())
	keep := maxIdentifierLen - len(suffix) - len(tag) - 2
	return base[:keep] + "_" + tag + "_" + suffix
}
