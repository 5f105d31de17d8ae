package postgres

import (
	"context"
	"fmt"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// PurgeBatchSize is how many delivered rows one Purge statement deletes at most,
// so that a purge of millions of rows never holds a long lock.
const PurgeBatchSize = 1000

// Stats implements [storage.StatsReader]. Each count reads one partial index;
// the delivered count grows with the rows not yet purged, and is always 0 with
// [Config.DeleteOnAck].
func (s *Storage) Stats(ctx context.Context) (storage.Stats, error) {
	q := fmt.Sprintf(`SELECT
    (SELECT count(*) FROM %[1]s WHERE status = 'pending'),
    (SELECT count(*) FROM %[2]s l JOIN %[1]s o ON o.id = l.id WHERE l.leased_until > now() AND o.status = 'pending'),
    (SELECT count(*) FROM %[1]s WHERE status = 'delivered'),
    (SELECT count(*) FROM %[1]s WHERE status = 'dead'),
    COALESCE((SELECT EXTRACT(EPOCH FROM now() - min(created_at))::float8 FROM %[1]s WHERE status = 'pending'), 0)`, s.table, s.leases)
	var st storage.Stats
	var age float64
	if err := s.pool.QueryRow(ctx, q).Scan(&st.Pending, &st.Leased, &st.Delivered, &st.Dead, &age); err != nil {
		return storage.Stats{}, fmt.Errorf("outbox stats of %s: %w", s.table, err)
	}
	st.OldestPendingAge = max(time.Duration(age*float64(time.Second)), 0)
	return st, nil
}

// Purge implements [storage.Maintainer]: it deletes delivered rows delivered
// more than olderThan ago, [PurgeBatchSize] per statement, until none is left.
// On error it returns how many it had deleted so far. With [Config.DeleteOnAck]
// there are no delivered rows to delete.
func (s *Storage) Purge(ctx context.Context, olderThan time.Duration) (int64, error) {
	if olderThan < 0 {
		return 0, fmt.Errorf("purge outbox %s: olderThan is %s: must be >= 0", s.table, olderThan)
	}
	q := fmt.Sprintf(`DELETE FROM %[1]s WHERE id = ANY(ARRAY(
    SELECT id FROM %[1]s
    WHERE status = 'delivered' AND delivered_at < now() - $1::bigint * interval '1 microsecond'
    ORDER BY delivered_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED))`, s.table)
	var total int64
	for {
		tag, err := s.pool.Exec(ctx, q, olderThan.Microseconds(), PurgeBatchSize)
		if err != nil {
			return total, fmt.Errorf("purge outbox %s: %w", s.table, err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < PurgeBatchSize {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, fmt.Errorf("purge outbox %s: %w", s.table, err)
		}
	}
}

// Redrive implements [storage.Maintainer]: the selected dead-lettered rows go
// back to pending, due now, with attempts 0 and no error.
func (s *Storage) Redrive(ctx context.Context, p storage.RedriveParams) (int64, error) {
	set := fmt.Sprintf(`UPDATE %s SET status = 'pending', attempts = 0, last_error = NULL,
    due_at = now()
WHERE status = 'dead' AND `, s.table)
	if err := p.Validate(); err != nil {
		return 0, fmt.Errorf("redrive outbox rows: %w", err)
	}
	var q string
	var arg any
	switch {
	case len(p.IDs) > 0:
		q, arg = set+"id = ANY($1)", p.IDs
	default:
		q, arg = set+"topic = $1", p.Topic
	}
	tag, err := s.pool.Exec(ctx, q, arg)
	if err != nil {
		return 0, fmt.Errorf("redrive outbox rows in %s: %w", s.table, err)
	}
	return tag.RowsAffected(), nil
}
