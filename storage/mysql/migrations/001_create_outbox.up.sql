CREATE TABLE IF NOT EXISTS {table} (
    id           BIGINT       NOT NULL AUTO_INCREMENT,
    uuid         VARCHAR(255) NOT NULL,
    topic        VARCHAR(255) NOT NULL,
    `key`        VARCHAR(255) NOT NULL DEFAULT '',
    payload      LONGBLOB,
    metadata     JSON,
    created_at   DATETIME(6)  NOT NULL,
    -- When the row may next be claimed: its creation (plus the visibility
    -- delay), its retry time after a nack or release, and the end of its
    -- lease while leased, so that leased rows leave the claim's walk.
    due_at       DATETIME(6)  NOT NULL,
    attempts     INT          NOT NULL DEFAULT 0,
    status       VARCHAR(9)   NOT NULL DEFAULT 'pending',
    -- 1: known to be behind an earlier pending row of its key (strict
    -- ordering); the claim's walk skips it until that row leaves.
    parked       TINYINT      NOT NULL DEFAULT 0,
    leased_by    VARCHAR(255),
    leased_until DATETIME(6),
    last_error   TEXT,
    delivered_at DATETIME(6),
    PRIMARY KEY (id),
    -- Claim: due, not parked, pending rows by due time.
    KEY claim_idx (status, parked, due_at, id),
    -- Strict ordering: the pending rows of one key in id order.
    KEY key_idx (`key`, status, id),
    -- Purge (delivered by age) and redrive (dead rows).
    KEY done_idx (status, delivered_at),
    CONSTRAINT status_check CHECK (status IN ('pending', 'delivered', 'dead'))
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
