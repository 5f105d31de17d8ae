DROP INDEX IF EXISTS "{table}_inbox_received";
-- "{table}_inbox" is kept: dropping it would let every message still
-- redelivered be processed again. Step 5 finds it again (IF NOT EXISTS).
