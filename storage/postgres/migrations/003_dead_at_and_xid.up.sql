-- When a record was dead-lettered (the operator's `dead list` and `dead
-- show` print it; NULL for records dead-lettered before this step), and the
-- producer's transaction of each record (Config.CommitFence; NULL for rows
-- written before this step, long committed). Both are added without
-- rewriting the table: created_xid gets its default after it is added.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS dead_at TIMESTAMPTZ;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS created_xid XID8;
ALTER TABLE {table} ALTER COLUMN created_xid SET DEFAULT pg_current_xact_id();
