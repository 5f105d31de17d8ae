package mysql

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"

	"github.com/txoutbox/txoutbox/storage"
)

var _ storage.Pruner = (*Storage)(nil)

// Prune implements [storage.Pruner]: holding the table's prune lock
// (GET_LOCK with no wait, on one connection: a forwarder that finds another
// pruning deletes nothing), it deletes up to params.Limit records delivered
// more than params.OlderThan ago, the oldest first, in one statement.
func (s *Storage) Prune(ctx context.Context, p storage.PruneParams) (int64, error) {
	if err := p.Validate(); err != nil {
		return 0, err
	}
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return 0, fmt.Errorf("prune outbox %s: %w", s.table, err)
	}
	defer func() { _ = conn.Close() }()
	schemaLock, err := s.lockName(ctx, conn)
	if err != nil {
		return 0, fmt.Errorf("prune outbox %s: %w", s.table, err)
	}
	// The schema lock's name, hashed from the database and table (GET_LOCK
	// names are server-wide and at most 64 characters), under another prefix.
	lock := "txoutbox prune " + strings.TrimPrefix(schemaLock, "txoutbox schema ")
	var got sql.NullInt64
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK(?, 0)", lock).Scan(&got); err != nil {
		return 0, fmt.Errorf("prune outbox %s: take the prune lock: %w", s.table, err)
	}
	if got.Int64 != 1 {
		return 0, nil
	}
	defer conn.ExecContext(context.WithoutCancel(ctx), "SELECT RELEASE_LOCK(?)", lock) //nolint:errcheck // the lock also ends with the session
	r, err := conn.ExecContext(ctx, "DELETE FROM "+s.table+" WHERE status = 'delivered' AND delivered_at < UTC_TIMESTAMP(6) - INTERVAL "+
		strconv.FormatInt(p.OlderThan.Microseconds(), 10)+" MICROSECOND ORDER BY delivered_at LIMIT "+strconv.Itoa(p.Limit))
	if err != nil {
		return 0, fmt.Errorf("prune outbox %s: %w", s.table, err)
	}
	n, err := r.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("prune outbox %s: %w", s.table, err)
	}
	return n, nil
}
