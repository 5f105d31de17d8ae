-- The outbox table, its lease, worker and delivered tables and their
-- indexes, as CreateSchema made them before migrations were versioned.
-- {table} is the outbox table; {rel:x} an object named after it in its
-- schema; {name:x} the unqualified name of such an object (an index).
CREATE TABLE IF NOT EXISTS {table} (
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
    -- Key slot: claimers with strict ordering share the slots, so that they
    -- work on disjoint keys. Every row of a key has the same slot. 256 is
    -- slotCount in ops.go.
    slot         SMALLINT    NOT NULL GENERATED ALWAYS AS ((CASE WHEN key = '' THEN id % 256 ELSE hashtext(key) & 255 END)::smallint) STORED
);

-- Leases live in their own narrow table: a claim inserts one small row per
-- record instead of writing a new version of the wide outbox row and three
-- index entries; every write-back deletes the lease in the same statement.
-- attempts here is the attempt number of the live claim (it counts claims
-- whose lease ran out, which the outbox row learns at the next write-back).
CREATE TABLE IF NOT EXISTS {rel:leases} (
    id           BIGINT      PRIMARY KEY,
    key          TEXT        NOT NULL,
    leased_by    TEXT        NOT NULL,
    leased_until TIMESTAMPTZ NOT NULL,
    attempts     INTEGER     NOT NULL
);

-- The workers that claimed recently (strict ordering shares the key slots
-- among them); a claim refreshes its own row.
CREATE TABLE IF NOT EXISTS {rel:workers} (
    worker_id    TEXT        PRIMARY KEY,
    seen_until   TIMESTAMPTZ NOT NULL
);

-- Delivered records: an ack deletes the outbox row and adds a narrow row here
-- (no payload, no metadata), so that the ack writes no new version of the
-- wide row; Stats counts these rows and Purge deletes them by age. Appended
-- in delivery order, never updated.
CREATE TABLE IF NOT EXISTS {rel:delivered} (
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
CREATE INDEX IF NOT EXISTS {name:delivered_at_idx} ON {rel:delivered} (delivered_at);

-- Claim walks pending rows in id order, those of its own slots only (the
-- slot is checked in the index); delivered rows never enter this index.
CREATE INDEX IF NOT EXISTS {name:pending_idx} ON {table} (id, slot) WHERE status = 'pending';

-- Strict ordering: is there an earlier pending row of the same key that is
-- not claimable? Leased rows are in the lease table; the only other ones are
-- rows rescheduled for later, so only they are indexed here, by due time (the
-- claim reads those not yet due): the lookup stays cheap however long the
-- backlog.
CREATE INDEX IF NOT EXISTS {name:rescheduled_idx} ON {table} (due_at, key, id)
    WHERE status = 'pending' AND key <> '' AND due_at > created_at;

-- Purge: outbox rows marked delivered in place (by hand, or by an earlier,
-- unreleased version whose ack updated the row; an ack now moves the record
-- to the delivered table, so this index stays empty).
CREATE INDEX IF NOT EXISTS {name:delivered_idx} ON {table} (delivered_at) WHERE status = 'delivered';

-- Redrive and inspection of dead-lettered rows by topic.
CREATE INDEX IF NOT EXISTS {name:dead_idx} ON {table} (topic, id) WHERE status = 'dead';
