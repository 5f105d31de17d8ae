-- The inbox of the inbox package: one entry per message a consumer
-- processed, recorded in the transaction that processed it; retention
-- deletes a consumer's oldest entries first. No down step: dropping the
-- table would let every message still redelivered be processed again.
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer     VARCHAR(255) NOT NULL,
    uuid         VARCHAR(255) NOT NULL,
    received_at  DATETIME(6)  NOT NULL,
    PRIMARY KEY (consumer, uuid),
    KEY received (consumer, received_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
