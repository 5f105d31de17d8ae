DROP TRIGGER IF EXISTS "{table}_next_after_delete";
DROP TRIGGER IF EXISTS "{table}_next_after_update";
CREATE INDEX IF NOT EXISTS "{table}_pending" ON "{table}" (id) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS "{table}_pending_key" ON "{table}" ("key", max(due_at, ifnull(leased_until, 0)))
    WHERE status = 'pending' AND "key" <> '';
DROP INDEX IF EXISTS "{table}_retry_due";
DROP INDEX IF EXISTS "{table}_pending_key_id";
DROP INDEX IF EXISTS "{table}_pending_hold";
