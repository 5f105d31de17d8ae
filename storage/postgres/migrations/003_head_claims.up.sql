-- Strict ordering without a table lock: claims take the first pending row of
-- each key (its head) with FOR UPDATE SKIP LOCKED, so that claimers of
-- different keys never wait for one another, and rows that wait behind a
-- head are parked, out of the claim's walk, so that a claim's cost does not
-- grow with what is held back. The key slots, the worker table and the
-- indexes of the advisory-lock design go.
--
-- Upgrade note: forwarders of the previous version serialise on an advisory
-- lock that this version does not take; stop them before running this step
-- (or accept that a key may be reordered while both versions claim).
-- CREATE INDEX blocks inserts into the outbox table while it builds the walk
-- index (seconds per million pending rows); the other statements only
-- change the catalog.

-- parked: set by a claim on a row that waits behind an earlier pending row
-- of its key; the write-back that removes that earlier row unparks the next
-- one. Claims do not walk parked rows.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS parked BOOLEAN NOT NULL DEFAULT false;

-- dead_at: when the record was dead-lettered.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS dead_at TIMESTAMPTZ;

-- created_xid: the producer's transaction, for Config.CommitFence. Rows
-- written before this step have none (NULL: long committed). Added without
-- a default, then given one, so that the table is not rewritten.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS created_xid XID8;
ALTER TABLE {table} ALTER COLUMN created_xid SET DEFAULT pg_current_xact_id();

-- The claim's walk: pending rows that are not parked, due first. Rows waiting
-- for their retry are due later and parked rows are not in it.
CREATE INDEX IF NOT EXISTS {name:walk_idx} ON {table} (due_at, id) WHERE status = 'pending' AND NOT parked;

-- Claims probe the key index for the first row of a key. When one hot key
-- fills the table, ANALYZE concludes that every key has that many rows, and
-- the planner then probes for a fresh key by walking the primary key from
-- the start (20 ms a probe at 50k rows). Tell it that keys are many: then
-- the key index, which answers in one step whatever the key, is its choice.
ALTER TABLE {table} ALTER COLUMN key SET (n_distinct = -0.5);

-- The parked rows of a key: a write-back that removes a key's head looks
-- here first, and only for a key with parked rows for the row to unpark.
CREATE INDEX IF NOT EXISTS {name:parked_idx} ON {table} (key, id) WHERE status = 'pending' AND parked;

DROP INDEX IF EXISTS {rel:pending_idx};
DROP INDEX IF EXISTS {rel:rescheduled_idx};
DROP INDEX IF EXISTS {rel:failed_key_idx};
ALTER TABLE {table} DROP COLUMN IF EXISTS slot;
DROP TABLE IF EXISTS {rel:workers};
