-- When a record was dead-lettered (the operator's `dead list` and `dead show`
-- print it). NULL for records dead-lettered before this step. Adding a
-- column without a default changes the catalog only; no row is rewritten.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS dead_at TIMESTAMPTZ;
