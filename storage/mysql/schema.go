package mysql

import (
	"context"
	"database/sql"
	"fmt"
)

// SchemaLockTimeout is how long [Storage.CreateSchema] waits for another
// process creating the same table, in seconds.
const SchemaLockTimeout = 30

// SchemaSQL returns the DDL of the outbox table, its indexes included: one
// idempotent statement (CREATE TABLE IF NOT EXISTS), ready for a migration
// tool. The database of a qualified table must already exist.
//
// Times are DATETIME(6) in UTC, written and compared with UTC_TIMESTAMP(6),
// so the session time zone does not matter. Keys, topics and uuids compare
// byte for byte (utf8mb4_bin).
func (s *Storage) SchemaSQL() string {
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
    id           BIGINT       NOT NULL AUTO_INCREMENT,
    uuid         VARCHAR(255) NOT NULL,
    topic        VARCHAR(255) NOT NULL,
    `+"`key`"+`        VARCHAR(255) NOT NULL DEFAULT '',
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
    KEY key_idx (`+"`key`"+`, status, id),
    -- Purge (delivered by age) and redrive (dead rows).
    KEY done_idx (status, delivered_at),
    CONSTRAINT status_check CHECK (status IN ('pending', 'delivered', 'dead'))
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin`, s.table)
}

// CreateSchema runs [Storage.SchemaSQL]. Processes that start together may
// all call it: a named lock (GET_LOCK, up to [SchemaLockTimeout] seconds)
// lets one create the table while the others wait, then find it.
func (s *Storage) CreateSchema(ctx context.Context) error {
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("create outbox schema for %s: %w", s.table, err)
	}
	defer func() { _ = conn.Close() }()
	lock := "txoutbox schema " + s.name
	var got sql.NullInt64
	// GET_LOCK is held by the session: take and release it on one connection.
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK(?, ?)", lock, SchemaLockTimeout).Scan(&got); err != nil {
		return fmt.Errorf("create outbox schema for %s: lock: %w", s.table, err)
	}
	if got.Int64 != 1 {
		return fmt.Errorf("create outbox schema for %s: another process held the schema lock for %ds", s.table, SchemaLockTimeout)
	}
	defer conn.ExecContext(context.WithoutCancel(ctx), "SELECT RELEASE_LOCK(?)", lock) //nolint:errcheck // the lock also ends with the session
	if _, err := conn.ExecContext(ctx, s.SchemaSQL()); err != nil {
		return fmt.Errorf("create outbox schema for %s: %w", s.table, err)
	}
	return nil
}
