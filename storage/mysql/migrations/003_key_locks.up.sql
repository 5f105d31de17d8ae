-- One row per ordering key that Insert locks in the producer's transaction
-- (INSERT ... ON DUPLICATE KEY UPDATE), so that producers of one key commit
-- in the order they took their ids. No down step: the table holds no
-- record, but code at this version needs it.
CREATE TABLE IF NOT EXISTS {keys} (
    `key`      VARCHAR(255) NOT NULL,
    -- How many transactions inserted records of the key.
    seq        BIGINT       NOT NULL,
    PRIMARY KEY (`key`)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
