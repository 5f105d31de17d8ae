-- The inbox of the inbox package: one entry per message a consumer
-- processed, recorded in the transaction that processed it. The primary key
-- makes a second transaction recording the same message wait for the first,
-- then find it there. No down step: dropping the table would let every
-- message still redelivered be processed again.
CREATE TABLE IF NOT EXISTS {rel:inbox} (
    consumer    TEXT        NOT NULL,
    uuid        TEXT        NOT NULL,
    received_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (consumer, uuid)
);

-- Retention deletes a consumer's oldest entries first.
CREATE INDEX IF NOT EXISTS {name:inbox_received_idx} ON {rel:inbox} (consumer, received_at);
