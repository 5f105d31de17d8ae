package postgres

import (
	"context"
	"fmt"
	"hash/fnv"
	"strings"

	"github.com/jackc/pgx/v5"
)

// SchemaSQL returns the DDL of the outbox table, its indexes and, with
// [Config.NotifyChannel] set, its notify trigger. Every statement is idempotent
// (IF NOT EXISTS / OR REPLACE), so the text can go into a migration as is or be
// run at start-up. The schema of a qualified table must already exist.
func (s *Storage) SchemaSQL() string {
	t := s.table
	idx := func(suffix string) string { return pgx.Identifier{derivedName(s.ident, suffix)}.Sanitize() }
	var b strings.Builder
	fmt.Fprintf(&b, `CREATE TABLE IF NOT EXISTS %[1]s (
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
    -- Strict ordering: a row behind an earlier row of its key that waits for
    -- its retry. Claims do not walk parked rows; an ack of the key unparks
    -- the next ones.
    parked       BOOLEAN     NOT NULL DEFAULT false
);

-- Leases live in their own narrow table: a claim inserts one small row per
-- record instead of writing a new version of the wide outbox row and three
-- index entries; every write-back deletes the lease in the same statement.
-- attempts here is the attempt number of the live claim (it counts claims
-- whose lease ran out, which the outbox row learns at the next write-back).
CREATE TABLE IF NOT EXISTS %[2]s (
    id           BIGINT      PRIMARY KEY,
    key          TEXT        NOT NULL,
    leased_by    TEXT        NOT NULL,
    leased_until TIMESTAMPTZ NOT NULL,
    attempts     INTEGER     NOT NULL
);

-- Delivered records: an ack deletes the outbox row and adds a narrow row here
-- (no payload, no metadata), so that the ack writes no new version of the
-- wide row; Stats counts these rows and Purge deletes them by age. Appended
-- in delivery order, never updated.
CREATE TABLE IF NOT EXISTS %[9]s (
    id           BIGINT      NOT NULL,
    uuid         TEXT        NOT NULL,
    topic        TEXT        NOT NULL,
    key          TEXT        NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL,
    delivered_at TIMESTAMPTZ NOT NULL,
    attempts     INTEGER     NOT NULL,
    last_error   TEXT
);

-- Purge: delivered records by age.
CREATE INDEX IF NOT EXISTS %[10]s ON %[9]s (delivered_at);

-- The claim's walk: pending rows that are not parked, due first. Rows
-- waiting for their retry are due later and parked rows are not in it, so
-- a claim walks what it may take, and the rows behind heads in flight.
CREATE INDEX IF NOT EXISTS %[3]s ON %[1]s (due_at, id) WHERE status = 'pending' AND NOT parked;

-- Strict ordering: the pending rows of a key in id order (is there an
-- earlier one? which rows follow a head?).
CREATE INDEX IF NOT EXISTS %[4]s ON %[1]s (key, id) WHERE status = 'pending' AND key <> '';

-- Strict ordering: the parked rows of a key, to unpark them in id order.
CREATE INDEX IF NOT EXISTS %[7]s ON %[1]s (key, id) WHERE status = 'pending' AND parked;

-- Purge: outbox rows marked delivered in place (by hand, or by an earlier,
-- unreleased version whose ack updated the row; an ack now moves the record
-- to the delivered table, so this index stays empty).
CREATE INDEX IF NOT EXISTS %[5]s ON %[1]s (delivered_at) WHERE status = 'delivered';

-- Redrive and inspection of dead-lettered rows by topic.
CREATE INDEX IF NOT EXISTS %[6]s ON %[1]s (topic, id) WHERE status = 'dead';
`, t, s.leases,
		idx("walk_idx"), idx("key_idx"), idx("delivered_idx"), idx("dead_idx"),
		idx("parked_idx"), "", s.delivered, idx("delivered_at_idx"))

	if ch := s.config.NotifyChannel; ch != "" {
		fn := siblingName(s.ident, "notify")
		trg := pgx.Identifier{derivedName(s.ident, "notify_trg")}.Sanitize()
		// The channel passed checkIdentifier, so it is safe inside a string literal.
		fmt.Fprintf(&b, `
-- LISTEN/NOTIFY wake-up: one notification per INSERT statement, not per row.
CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS $txoutbox$
BEGIN
    PERFORM pg_notify('%s', '');
    RETURN NULL;
END
$txoutbox$;

DROP TRIGGER IF EXISTS %s ON %s;
CREATE TRIGGER %s AFTER INSERT ON %s
    FOR EACH STATEMENT EXECUTE FUNCTION %s();
`, fn, ch, trg, t, trg, t, fn)
	}
	return b.String()
}

// CreateSchema runs [Storage.SchemaSQL] in one transaction.
func (s *Storage) CreateSchema(ctx context.Context) error {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("create outbox schema: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	// Simple protocol: the DDL is several statements in one string.
	if _, err := tx.Exec(ctx, s.SchemaSQL(), pgx.QueryExecModeSimpleProtocol); err != nil {
		return fmt.Errorf("create outbox schema for %s: %w", s.table, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("create outbox schema for %s: commit: %w", s.table, err)
	}
	return nil
}

// siblingName is an object named after the table (derivedName) in the
// table's schema, quoted for SQL: "app"."outbox_leases".
func siblingName(table pgx.Identifier, suffix string) string {
	return append(table[:len(table)-1:len(table)-1], derivedName(table, suffix)).Sanitize()
}

// derivedName names an object after the table ("outbox_pending_idx"). Names
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
