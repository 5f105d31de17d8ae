CREATE TABLE IF NOT EXISTS "{table}" (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    uuid         TEXT    NOT NULL,
    topic        TEXT    NOT NULL,
    "key"        TEXT    NOT NULL DEFAULT '',
    payload      BLOB    NOT NULL,
    metadata     TEXT,
    created_at   INTEGER NOT NULL,
    due_at       INTEGER NOT NULL DEFAULT 0,
    attempts     INTEGER NOT NULL DEFAULT 0,
    leased_by    TEXT,
    leased_until INTEGER,
    status       TEXT    NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'delivered', 'dead')),
    last_error   TEXT,
    delivered_at INTEGER
);
CREATE INDEX IF NOT EXISTS "{table}_pending" ON "{table}" (id) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS "{table}_pending_key" ON "{table}" ("key", max(due_at, ifnull(leased_until, 0)))
    WHERE status = 'pending' AND "key" <> '';
CREATE INDEX IF NOT EXISTS "{table}_delivered" ON "{table}" (delivered_at) WHERE status = 'delivered';
CREATE INDEX IF NOT EXISTS "{table}_dead_topic" ON "{table}" (topic, id) WHERE status = 'dead';
