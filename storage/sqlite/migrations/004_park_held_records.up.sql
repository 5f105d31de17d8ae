-- Pending records by hold, then id: a claim walks those not set aside
-- (hold IS NULL) in id order, and never reads the others.
CREATE INDEX IF NOT EXISTS "{table}_pending_hold" ON "{table}" (hold, id) WHERE status = 'pending';
-- A key's pending records in id order: whether an earlier one holds a
-- record back, which one is next, the records queued behind a claimed one.
CREATE INDEX IF NOT EXISTS "{table}_pending_key_id" ON "{table}" ("key", id) WHERE status = 'pending' AND "key" <> '';
-- Records waiting for their retry, by due time.
CREATE INDEX IF NOT EXISTS "{table}_retry_due" ON "{table}" (due_at) WHERE status = 'pending' AND hold = 'retry';
DROP INDEX IF EXISTS "{table}_pending";
DROP INDEX IF EXISTS "{table}_pending_key";
-- Records already queued behind an earlier pending record of their key
-- are set aside, once, in this step's transaction.
UPDATE "{table}" SET hold = 'behind'
WHERE status = 'pending' AND "key" <> '' AND hold IS NULL
  AND EXISTS (SELECT 1 FROM "{table}" AS e
              WHERE e.status = 'pending' AND e."key" <> '' AND e."key" = "{table}"."key" AND e.id < "{table}".id);
-- When a pending record stops being pending (delivered, dead) or a pending
-- or dead one is deleted (skipped), the next record of its key, set aside
-- behind it, is set free, unless a dead record that holds the key comes
-- before it. Triggers, so that every way a record goes sets the next free.
-- (No line inside a trigger ends with a semicolon but its last: goose
-- splits a file at those.)
CREATE TRIGGER IF NOT EXISTS "{table}_next_after_update" AFTER UPDATE OF status ON "{table}"
WHEN OLD.status = 'pending' AND NEW.status <> 'pending' AND OLD."key" <> ''
BEGIN
    UPDATE "{table}" SET hold = NULL
    WHERE id = (SELECT n.id FROM "{table}" AS n
                WHERE n.status = 'pending' AND n."key" <> '' AND n."key" = OLD."key" ORDER BY n.id LIMIT 1)
      AND hold = 'behind'
      AND NOT EXISTS (SELECT 1 FROM "{table}" AS d
                      WHERE d.status = 'dead' AND d."key" <> '' AND d."key" = OLD."key" AND d.hold = 'key'
                        AND d.id < "{table}".id); END;
CREATE TRIGGER IF NOT EXISTS "{table}_next_after_delete" AFTER DELETE ON "{table}"
WHEN OLD.status IN ('pending', 'dead') AND OLD."key" <> ''
BEGIN
    UPDATE "{table}" SET hold = NULL
    WHERE id = (SELECT n.id FROM "{table}" AS n
                WHERE n.status = 'pending' AND n."key" <> '' AND n."key" = OLD."key" ORDER BY n.id LIMIT 1)
      AND hold = 'behind'
      AND NOT EXISTS (SELECT 1 FROM "{table}" AS d
                      WHERE d.status = 'dead' AND d."key" <> '' AND d."key" = OLD."key" AND d.hold = 'key'
                        AND d.id < "{table}".id); END;
