-- Held rows leave the claim's walk. A pending row's hold says why it is not
-- walked: 'retry' (it failed, and waits for due_at; a claim sets hold back
-- to NULL once it is due) or 'behind' (strict ordering: an earlier record of
-- its key waits for a retry, is parked itself, or is dead with
-- HoldOnDeadLetter; the delivery of that earlier record sets it back to
-- NULL). NULL: the row is walked. The claim then reads the rows it can hand
-- out and the rows in flight, not the rows held back, however many.
--
-- The column is added without rewriting the table (NULL default), and the
-- constraint NOT VALID (rows written before this step have NULL, which it
-- allows: no scan of the table under its lock).
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS hold TEXT;
DO $$
BEGIN
    ALTER TABLE {table} ADD CONSTRAINT {name:hold_check} CHECK (hold IN ('retry', 'behind')) NOT VALID;
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;

-- The claim's walk: pending rows not held, in id order (slot: see step 1).
CREATE INDEX IF NOT EXISTS {name:ready_idx} ON {table} (id, slot) WHERE status = 'pending' AND hold IS NULL;

-- The claim wakes the rows whose retry is due.
CREATE INDEX IF NOT EXISTS {name:retry_idx} ON {table} (due_at) WHERE status = 'pending' AND hold = 'retry';

-- Strict ordering: is an earlier record of this key held? And the parked
-- rows of a key, in id order, that a delivery sets free.
CREATE INDEX IF NOT EXISTS {name:held_idx} ON {table} (key, id) WHERE status = 'pending' AND hold IS NOT NULL;

-- Rows that a process of version 3 nacks or releases for later while this
-- version runs beside it (a rolling upgrade) get no hold: a claim finds them
-- here and sets their hold to 'retry' before it walks. The index holds only
-- those rows and the rows released or re-driven due at once, until claimed.
CREATE INDEX IF NOT EXISTS {name:unheld_retry_idx} ON {table} (due_at)
    WHERE status = 'pending' AND hold IS NULL AND due_at > created_at;

-- Rows waiting for a retry when this step runs (failed under an earlier
-- version) wait in the retry index from now on.
UPDATE {table} SET hold = 'retry'
WHERE status = 'pending' AND hold IS NULL AND due_at > created_at AND due_at > now();

-- The walk and the check that the two indexes above replace.
DROP INDEX IF EXISTS {rel:pending_idx};
DROP INDEX IF EXISTS {rel:rescheduled_idx};
