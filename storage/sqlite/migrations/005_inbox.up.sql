-- The inbox of the inbox package: one entry per message a consumer
-- processed, recorded in the transaction that processed it; received_at in
-- Unix nanoseconds. Its down step keeps the table: dropping it would let every
-- message still redelivered be processed again.
CREATE TABLE IF NOT EXISTS "{table}_inbox" (
    consumer    TEXT    NOT NULL,
    uuid        TEXT    NOT NULL,
    received_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, uuid)
);
-- Retention deletes a consumer's oldest entries first.
CREATE INDEX IF NOT EXISTS "{table}_inbox_received" ON "{table}_inbox" (consumer, received_at);
