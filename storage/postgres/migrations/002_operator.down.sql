DROP INDEX IF EXISTS {rel:failed_key_idx};
DROP INDEX IF EXISTS {rel:dead_id_idx};
DROP INDEX IF EXISTS {rel:dead_key_idx};
DROP INDEX IF EXISTS {rel:key_idx};
-- {rel:skipped} is kept: it is the audit record of every skip, and dropping
-- it would lose the skipped records.
