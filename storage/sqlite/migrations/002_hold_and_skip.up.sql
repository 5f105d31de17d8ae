CREATE TABLE IF NOT EXISTS "{table}_skipped" (
    id           INTEGER PRIMARY KEY,
    uuid         TEXT    NOT NULL,
    topic        TEXT    NOT NULL,
    "key"        TEXT    NOT NULL,
    payload      BLOB    NOT NULL,
    metadata     TEXT,
    created_at   INTEGER NOT NULL,
    attempts     INTEGER NOT NULL,
    last_error   TEXT,
    dead_at      INTEGER NOT NULL,
    skipped_at   INTEGER NOT NULL,
    reason       TEXT    NOT NULL
);
CREATE INDEX IF NOT EXISTS "{table}_dead_key" ON "{table}" ("key", id) WHERE status = 'dead' AND "key" <> '';
CREATE INDEX IF NOT EXISTS "{table}_failed_key" ON "{table}" ("key", id)
    WHERE status = 'pending' AND "key" <> '' AND last_error IS NOT NULL;
