DROP INDEX IF EXISTS "{table}_failed_key";
DROP INDEX IF EXISTS "{table}_dead_key";
-- "{table}_skipped" is kept: it is the audit record of every skip, and
-- dropping it would lose the skipped records.
