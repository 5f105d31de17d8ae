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

// Stats implements [storage.StatsReader]. Each count reads one partial index,
// the delivered count the delivered table (plus outbox rows marked delivered in
// place, see [Storage.SchemaSQL]): it grows with the records not yet purged,
// and is always 0 with [Config.DeleteOnAck]. Skipped counts the skipped
// table, Forwarders the distinct workers with a live lease (the lease table
// holds the rows in flight only), HeldKeys the keys [Storage.HeldKeys] lists,
// Fenced the pending records [Config.CommitFence] holds back, and
// OldestDeliveredAge the delivered_at indexes.
func (s *Storage) Stats(ctx context.Context) (storage.Stats, error) {
	// Fenced: pending rows [Config.CommitFence] holds back (0 without it).
	fenced := "false"
	if s.config.CommitFence {
		fenced = "created_xid >= pg_snapshot_xmin(pg_current_snapshot())"
	}
	q := fmt.Sprintf(`SELECT
    (SELECT count(*) FROM %[1]s WHERE status = 'pending'),
    (SELECT count(*) FROM %[2]s l JOIN %[1]s o ON o.id = l.id WHERE l.leased_until > now() AND o.status = 'pending'),
    (SELECT count(*) FROM %[3]s) + (SELECT count(*) FROM %[1]s WHERE status = 'delivered'),
    (SELECT count(*) FROM %[1]s WHERE status = 'dead'),
    COALESCE((SELECT EXTRACT(EPOCH FROM now() - min(created_at))::float8 FROM %[1]s WHERE status = 'pending'), 0),
    (SELECT count(*) FROM %[4]s),
    (SELECT count(DISTINCT leased_by) FROM %[2]s WHERE leased_until > now()),
    (%[5]s),
    (SELECT count(*) FROM %[1]s WHERE status = 'pending' AND %[6]s),
    COALESCE(EXTRACT(EPOCH FROM now() - LEAST(
        (SELECT min(delivered_at) FROM %[3]s),
        (SELECT min(delivered_at) FROM %[1]s WHERE status = 'delivered')))::float8, 0)`, s.table, s.leases, s.delivered, s.skipped, s.heldKeysSQL(true), fenced)
	var st storage.Stats
	var age, deliveredAge float64
	if err := s.pool.QueryRow(ctx, q, "").Scan(&st.Pending, &st.Leased, &st.Delivered, &st.Dead, &age,
		&st.Skipped, &st.Forwarders, &st.HeldKeys, &st.Fenced, &deliveredAge); err != nil {
		return storage.Stats{}, fmt.Errorf("outbox stats of %s: %w", s.table, err)
	}
	st.OldestPendingAge = max(time.Duration(age*float64(time.Second)), 0)
	st.OldestDeliveredAge = max(time.Duration(deliveredAge*float64(time.Second)), 0)
	return st, nil
}

// Purge implements [storage.Maintainer]: it deletes the records delivered more
// than olderThan ago from the delivered table (and outbox rows marked
// delivered in place, see [Storage.SchemaSQL]), [PurgeBatchSize] per
// statement, until none is left. On error it returns how many it had deleted
// so far. With [Config.DeleteOnAck] there are no delivered records to delete.
func (s *Storage) Purge(ctx context.Context, olderThan time.Duration) (int64, error) {
	if olderThan < 0 {
		return 0, fmt.Errorf("purge outbox %s: olderThan is %s: must be >= 0", s.table, olderThan)
	}
	// The delivered table has no key: its rows are picked by ctid, within one
	// statement (they are never updated, and a row another purge deleted
	// meanwhile cannot be vacuumed away, its ctid reused, while this
	// statement's snapshot can still see it). No FOR UPDATE, which would need
	// the UPDATE privilege: two purges at once wait for each other's rows
	// rather than skip them.
	var total int64
	for _, q := range s.purgeStatements() {
		for {
			tag, err := s.pool.Exec(ctx, q, olderThan.Microseconds(), PurgeBatchSize)
			if err != nil {
				return total, fmt.Errorf("purge outbox %s: %w", s.table, err)
			}
			total += tag.RowsAffected()
			if tag.RowsAffected() < PurgeBatchSize {
				break
			}
			if err := ctx.Err(); err != nil {
				return total, fmt.Errorf("purge outbox %s: %w", s.table, err)
			}
		}
	}
	return total, nil
}

// purgeStatements delete up to $2 records delivered more than $1
// microseconds ago, the oldest first: from the delivered table, and from
// the outbox rows marked delivered in place.
func (s *Storage) purgeStatements() []string {
	return []string{
		fmt.Sprintf(`DELETE FROM %[1]s WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM %[1]s
    WHERE delivered_at < now() - $1::bigint * interval '1 microsecond'
    ORDER BY delivered_at
    LIMIT $2))`, s.delivered),
		fmt.Sprintf(`DELETE FROM %[1]s WHERE id = ANY(ARRAY(
    SELECT id FROM %[1]s
    WHERE status = 'delivered' AND delivered_at < now() - $1::bigint * interval '1 microsecond'
    ORDER BY delivered_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED))`, s.table),
	}
}

// Prune implements [storage.Pruner]: in one transaction that holds the
// table's prune lock (a transaction-level advisory lock, tried, never
// waited for: a forwarder that finds another pruning deletes nothing), it
// deletes up to params.Limit records delivered more than params.OlderThan
// ago, the oldest first, from the delivered table and then from the outbox
// rows marked delivered in place.
func (s *Storage) Prune(ctx context.Context, p storage.PruneParams) (int64, error) {
	if err := p.Validate(); err != nil {
		return 0, err
	}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("prune outbox %s: %w", s.table, err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	var locked bool
	if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock(hashtextextended('txoutbox prune ' || $1::regclass::oid::text, 0))`, s.table).Scan(&locked); err != nil {
		return 0, fmt.Errorf("prune outbox %s: take the prune lock: %w", s.table, err)
	}
	if !locked {
		return 0, nil
	}
	var total int64
	for _, q := range s.purgeStatements() {
		tag, err := tx.Exec(ctx, q, p.OlderThan.Microseconds(), int64(p.Limit)-total)
		if err != nil {
			return 0, fmt.Errorf("prune outbox %s: %w", s.table, err)
		}
		if total += tag.RowsAffected(); total >= int64(p.Limit) {
			break
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("prune outbox %s: %w", s.table, err)
	}
	return total, nil
}

// Redrive implements [storage.Maintainer]: the selected dead-lettered rows go
// back to pending, due now, with attempts 0 and no error.
func (s *Storage) Redrive(ctx context.Context, p storage.RedriveParams) (int64, error) {
	if err := p.Validate(); err != nil {
		return 0, fmt.Errorf("redrive outbox rows: %w", err)
	}
	q, args := s.redriveStatement(p)
	var n int64
	if err := s.pool.QueryRow(ctx, q, args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("redrive outbox rows in %s: %w", s.table, err)
	}
	return n, nil
}

// redriveStatement is Redrive's statement for the (valid) selection p, and
// its arguments.
func (s *Storage) redriveStatement(p storage.RedriveParams) (string, []any) {
	// By ids, the rows are read by their primary key (s), those that are
	// dead locked by it (r, waiting for another transaction's lock, and
	// checked again as locked), and re-driven by it: with "status = 'dead'"
	// beside the ids in one WHERE, a dead-letter index could serve the ids
	// too, read whole and checked entry by entry, and with statistics from
	// before the incident (few dead rows) the planner chose that (see
	// lockedByID). Rows of the list that are not dead are not locked: they
	// may be in flight, and their write-backs must not wait.
	with, where := "WITH ", "status = 'dead' AND "
	var args []any
	switch {
	case len(p.IDs) > 0:
		with = fmt.Sprintf(`WITH s AS MATERIALIZED (SELECT id, status FROM %[1]s WHERE id = ANY($1)),
r AS MATERIALIZED (SELECT id, status FROM %[1]s WHERE id = ANY(ARRAY(SELECT s.id FROM s WHERE s.status = 'dead')) FOR UPDATE),
`, s.table)
		where, args = "id = ANY(ARRAY(SELECT r.id FROM r WHERE r.status = 'dead'))", []any{p.IDs}
	case p.Key != "":
		where, args = where+"key <> '' AND key = $1", []any{p.Key}
	case p.All:
		where += "true"
	default:
		where, args = where+"topic = $1", []any{p.Topic}
	}
	q := with + fmt.Sprintf(`d AS (UPDATE %s SET status = 'pending', attempts = 0, last_error = NULL,
    due_at = now(), dead_at = NULL, hold = NULL
WHERE %s RETURNING id, key)`, s.table, where)
	// The rows of their keys parked behind them are set free too (see the
	// claim): a re-driven record goes out first, then the rest of its key.
	return q + s.q.unparkCTEs + "\nSELECT count(*) FROM d", args
}
