package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// PurgeBatchSize is how many delivered records one Purge statement deletes;
// each batch is its own short write transaction.
const PurgeBatchSize = 1000

// Stats implements [storage.StatsReader]. The counts come from one read
// transaction, so they are consistent with each other; all but HeldKeys
// are answered from a partial index (HeldKeys groups the pending keyed
// records).
func (s *Storage) Stats(ctx context.Context) (storage.Stats, error) {
	var st storage.Stats
	now := s.now()
	tx, err := s.db.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
	if err != nil {
		return st, fmt.Errorf("read outbox stats of %q: %w", s.table, err)
	}
	defer func() { _ = tx.Rollback() }()
	t := quote(s.table)
	var oldest, delivered sql.NullInt64
	err = tx.QueryRowContext(ctx, fmt.Sprintf(`SELECT
    (SELECT count(*) FROM %[1]s WHERE status = 'pending'),
    (SELECT count(*) FROM %[1]s WHERE status = 'pending' AND leased_until > ?1),
    (SELECT count(*) FROM %[1]s WHERE status = 'delivered'),
    (SELECT count(*) FROM %[1]s WHERE status = 'dead'),
    (SELECT created_at FROM %[1]s WHERE id = (SELECT min(id) FROM (
        SELECT min(id) AS id FROM %[1]s WHERE status = 'pending' AND hold IS NULL
        UNION ALL SELECT min(id) FROM %[1]s WHERE status = 'pending' AND hold = 'retry'
        UNION ALL SELECT min(id) FROM %[1]s WHERE status = 'pending' AND hold = 'behind'))),
    (SELECT count(*) FROM %[2]s),
    (SELECT count(DISTINCT leased_by) FROM %[1]s WHERE status = 'pending' AND leased_until > ?1),
    (%[3]s),
    (SELECT min(delivered_at) FROM %[1]s WHERE status = 'delivered')`, t, quote(s.SkippedTable()), s.heldKeysSQL(true)),
		nanos(now), s.hold, "", -1).Scan(&st.Pending, &st.Leased, &st.Delivered, &st.Dead, &oldest, &st.Skipped, &st.Forwarders, &st.HeldKeys, &delivered)
	if err != nil {
		return st, fmt.Errorf("read outbox stats of %q: %w", s.table, err)
	}
	if oldest.Valid {
		st.OldestPendingAge = max(now.Sub(fromNanos(oldest.Int64)), 0)
	}
	if delivered.Valid {
		st.OldestDeliveredAge = max(now.Sub(fromNanos(delivered.Int64)), 0)
	}
	return st, nil
}

// Purge implements [storage.Maintainer]: it deletes records delivered more
// than olderThan ago, [PurgeBatchSize] per write transaction, so producers and
// forwarders get the write lock between batches.
func (s *Storage) Purge(ctx context.Context, olderThan time.Duration) (int64, error) {
	if olderThan < 0 {
		return 0, fmt.Errorf("purge outbox records: olderThan must be >= 0, got %s", olderThan)
	}
	cutoff := nanos(s.now().Add(-olderThan))
	query := fmt.Sprintf(`DELETE FROM %[1]s WHERE id IN (
    SELECT id FROM %[1]s WHERE status = 'delivered' AND delivered_at < ?1 LIMIT ?2)`, quote(s.table))
	var total int64
	for {
		var n int64
		err := s.write(ctx, func(ctx context.Context) error {
			res, err := s.db.ExecContext(ctx, query, cutoff, PurgeBatchSize)
			if err != nil {
				return err
			}
			n, err = res.RowsAffected()
			return err
		})
		total += n
		if err != nil {
			return total, fmt.Errorf("purge outbox records from %q: %w", s.table, err)
		}
		if n < PurgeBatchSize {
			return total, nil
		}
	}
}

// Redrive implements [storage.Maintainer]: the selected dead-lettered records
// become pending, due at once, with attempts and last error cleared, in one
// statement. They keep their ids, so each key's records are claimed again in
// id order; a re-driven record with an earlier pending record of its key
// waits behind it.
func (s *Storage) Redrive(ctx context.Context, params storage.RedriveParams) (int64, error) {
	if err := params.Validate(); err != nil {
		return 0, fmt.Errorf("redrive outbox records: %w", err)
	}
	set := s.redriveSet
	var query string
	var arg any
	switch {
	case params.Topic != "":
		query, arg = set+`topic = :by`, params.Topic
	case params.Key != "":
		query, arg = set+`"key" = :by`, params.Key
	case params.All:
		query, arg = set+`:by`, true
	default:
		query, arg = set+`id IN (SELECT value FROM json_each(:by))`, idsJSON(params.IDs)
	}
	var n int64
	err := s.write(ctx, func(ctx context.Context) error {
		res, err := s.db.ExecContext(ctx, query, sql.Named("by", arg), sql.Named("now", nanos(s.now())))
		if err != nil {
			return err
		}
		n, err = res.RowsAffected()
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("redrive outbox records of %q: %w", s.table, err)
	}
	return n, nil
}
