-- The audit record of Skip: a skipped dead row moves here, with when and why.
-- No down step: dropping the table would lose the audit record.
CREATE TABLE IF NOT EXISTS {skipped} (
    id           BIGINT       NOT NULL,
    uuid         VARCHAR(255) NOT NULL,
    topic        VARCHAR(255) NOT NULL,
    `key`        VARCHAR(255) NOT NULL,
    payload      LONGBLOB,
    metadata     JSON,
    created_at   DATETIME(6)  NOT NULL,
    attempts     INT          NOT NULL,
    last_error   TEXT,
    dead_at      DATETIME(6)  NOT NULL,
    skipped_at   DATETIME(6)  NOT NULL,
    reason       TEXT         NOT NULL,
    PRIMARY KEY (id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
