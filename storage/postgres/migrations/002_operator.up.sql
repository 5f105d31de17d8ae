-- The operator's work: skipped records with their audit record, and the
-- indexes that keep the operator's queries and hold-on-dead-letter bounded.
-- It adds a table and four partial indexes; no row is rewritten or moved.

-- Skip: a dead record an operator gave up on moves here, with the
-- operator's reason and the time (skipped_at), so that its key moves on and
-- the audit record stays. Never updated.
CREATE TABLE IF NOT EXISTS {rel:skipped} (
    id           BIGINT      PRIMARY KEY,
    uuid         TEXT        NOT NULL,
    topic        TEXT        NOT NULL,
    key          TEXT        NOT NULL,
    payload      BYTEA,
    metadata     JSONB,
    created_at   TIMESTAMPTZ NOT NULL,
    attempts     INTEGER     NOT NULL,
    last_error   TEXT,
    skipped_at   TIMESTAMPTZ NOT NULL,
    reason       TEXT        NOT NULL
);

-- The pending rows of one key in id order: what is behind a held key's head
-- (HeldKeys, the held-keys count of Stats).
CREATE INDEX IF NOT EXISTS {name:key_idx} ON {table} (key, id) WHERE status = 'pending' AND key <> '';

-- Dead rows by key: ListDead and Redrive by key, and with
-- HoldOnDeadLetter the claim's check for a dead earlier record of a key.
CREATE INDEX IF NOT EXISTS {name:dead_key_idx} ON {table} (key, id) WHERE status = 'dead' AND key <> '';

-- Dead rows in id order: ListDead's pages, without walking the pending rows
-- (a filter on the error text or the age reads the dead rows only).
CREATE INDEX IF NOT EXISTS {name:dead_id_idx} ON {table} (id) WHERE status = 'dead';

-- HoldOnDeadLetter: pending rows that failed before (nacked), whose key's
-- later rows are then claimed only once they are delivered.
CREATE INDEX IF NOT EXISTS {name:failed_key_idx} ON {table} (key, id)
    WHERE status = 'pending' AND key <> '' AND last_error IS NOT NULL;
