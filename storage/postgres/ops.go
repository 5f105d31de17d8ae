package postgres

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox/storage"
)

// queries holds the statements of one storage, built once in New.
type queries struct {
	claim, ack, nack, release, deadLetter string
	lock                                  string
}

func buildQueries(t string, strict bool, visibility time.Duration, deleteOnAck bool) queries {
	// A row is claimable when it is pending, due and not under a live lease.
	due := "o.due_at <= now() AND (o.leased_until IS NULL OR o.leased_until <= now())"
	if visibility > 0 {
		due += fmt.Sprintf(" AND o.created_at <= now() - interval '%d microseconds'", visibility.Microseconds())
	}
	hold := ""
	if strict {
		// Held back: an earlier pending row of the same key that is not
		// claimable now. The statement's snapshot is taken after the advisory
		// lock was granted by the previous statement of the batch, so it sees
		// every committed claim.
		//
		// Only a leased row (leased_until set) or a row rescheduled past its
		// creation (due_at > created_at: due_at > now() >= created_at) can be
		// unclaimable, and the partial (key, id) index holds only those rows.
		// The InitPlan reads them once per claim into a map key -> the lowest
		// unclaimable id of that key (a few hundred or thousand entries: the
		// rows leased by all workers plus those waiting for a retry); a
		// candidate is held back when its key maps to a lower id. Each
		// candidate then costs one map lookup instead of an index probe and a
		// heap recheck, which is what a worker walking rows held by others
		// pays for.
		//
		// The visibility delay needs no clause here: created_at is taken at
		// insert (clock_timestamp), so an earlier id is never younger than a
		// row that is old enough to claim.
		hold = fmt.Sprintf(`
      AND (o.key = '' OR o.id < COALESCE((
          (SELECT jsonb_object_agg(h.key, h.first) FROM (
              SELECT e.key, min(e.id) AS first FROM %s e
              WHERE e.status = 'pending' AND e.key <> ''
                AND (e.leased_until IS NOT NULL OR e.due_at > e.created_at)
                AND (e.due_at > now() OR e.leased_until > now())
              GROUP BY e.key) h) ->> o.key)::bigint, 9223372036854775807))`, t)
	}
	ack := fmt.Sprintf(`UPDATE %s SET status = 'delivered', delivered_at = now(), leased_by = NULL, leased_until = NULL
WHERE id = ANY($1) AND leased_by = $2 AND status = 'pending'`, t)
	if deleteOnAck {
		ack = fmt.Sprintf(`DELETE FROM %s WHERE id = ANY($1) AND leased_by = $2 AND status = 'pending'`, t)
	}
	return queries{
		// id = ANY(ARRAY(...)) keeps the primary-key plan; id IN (SELECT ...)
		// can turn into a scan of the whole table at large batch sizes.
		claim: fmt.Sprintf(`UPDATE %[1]s SET
    leased_by = $2,
    leased_until = now() + $3::bigint * interval '1 microsecond',
    attempts = attempts + 1
WHERE id = ANY(ARRAY(
    SELECT o.id FROM %[1]s o
    WHERE o.status = 'pending' AND %[2]s%[3]s
    ORDER BY o.id
    LIMIT $1
    FOR UPDATE SKIP LOCKED))
RETURNING id, uuid, topic, key, payload, metadata, attempts, created_at`, t, due, hold),

		ack: ack,

		nack: fmt.Sprintf(`UPDATE %s SET leased_by = NULL, leased_until = NULL, last_error = $3, due_at = $4
WHERE id = $1 AND leased_by = $2 AND status = 'pending'`, t),

		release: fmt.Sprintf(`UPDATE %s SET leased_by = NULL, leased_until = NULL, attempts = GREATEST(attempts - 1, 0), due_at = $3
WHERE id = ANY($1) AND leased_by = $2 AND status = 'pending'`, t),

		deadLetter: fmt.Sprintf(`UPDATE %s SET status = 'dead', last_error = $3, leased_by = NULL, leased_until = NULL
WHERE id = $1 AND leased_by = $2 AND status = 'pending'`, t),

		lock: "SELECT pg_advisory_xact_lock($1)",
	}
}

// Claim implements [storage.Storage]. With strict ordering it sends the
// advisory lock and the claim as one batch: one round trip, one implicit
// transaction, and the claim's snapshot is taken after the lock is held.
func (s *Storage) Claim(ctx context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	if p.BatchSize <= 0 || p.Lease <= 0 || p.WorkerID == "" {
		return nil, fmt.Errorf("claim outbox rows: need BatchSize > 0, Lease > 0 and a WorkerID (got %d, %s, %q)", p.BatchSize, p.Lease, p.WorkerID)
	}
	args := []any{p.BatchSize, p.WorkerID, p.Lease.Microseconds()}
	if s.config.DisableStrictOrdering {
		rows, err := s.pool.Query(ctx, s.q.claim, args...)
		if err != nil {
			return nil, fmt.Errorf("claim outbox rows from %s: %w", s.table, err)
		}
		return scanClaimed(rows, s.table, p.BatchSize)
	}
	b := &pgx.Batch{}
	b.Queue(s.q.lock, s.lockKey)
	b.Queue(s.q.claim, args...)
	br := s.pool.SendBatch(ctx, b)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("claim outbox rows from %s: advisory lock: %w", s.table, err)
	}
	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("claim outbox rows from %s: %w", s.table, err)
	}
	recs, err := scanClaimed(rows, s.table, p.BatchSize)
	if err != nil {
		return nil, err
	}
	// Close commits the implicit transaction: a failure here means the lease
	// was not taken, so the records must not be handed out.
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("claim outbox rows from %s: commit: %w", s.table, err)
	}
	return recs, nil
}

func scanClaimed(rows pgx.Rows, table string, capacity int) ([]storage.Record, error) {
	defer rows.Close()
	recs := make([]storage.Record, 0, min(capacity, 1024))
	var meta []byte
	for rows.Next() {
		var r storage.Record
		var attempts int32
		if err := rows.Scan(&r.ID, &r.UUID, &r.Topic, &r.Key, &r.Payload, &meta, &attempts, &r.CreatedAt); err != nil {
			return nil, fmt.Errorf("claim outbox rows from %s: scan: %w", table, err)
		}
		r.Attempts = int(attempts)
		if meta != nil {
			if err := json.Unmarshal(meta, &r.Metadata); err != nil {
				r.Metadata = nil
				r.DecodeError = fmt.Errorf("decode metadata of outbox row %d: %w", r.ID, err)
			}
		}
		recs = append(recs, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("claim outbox rows from %s: %w", table, err)
	}
	slices.SortFunc(recs, func(a, b storage.Record) int { return cmpInt64(a.ID, b.ID) })
	return recs, nil
}

func cmpInt64(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Ack implements [storage.Storage]: the whole batch in one statement.
func (s *Storage) Ack(ctx context.Context, p storage.AckParams) error {
	if len(p.IDs) == 0 {
		return nil
	}
	if _, err := s.pool.Exec(ctx, s.q.ack, p.IDs, p.WorkerID); err != nil {
		return fmt.Errorf("ack %d outbox rows in %s: %w", len(p.IDs), s.table, err)
	}
	return nil
}

// Nack implements [storage.Storage].
func (s *Storage) Nack(ctx context.Context, p storage.NackParams) error {
	if err := s.writeBack(ctx, s.q.nack, p.ID, p.WorkerID, p.Error, p.RetryAt); err != nil {
		return fmt.Errorf("nack outbox row %d in %s: %w", p.ID, s.table, err)
	}
	return nil
}

// Release implements [storage.Storage].
func (s *Storage) Release(ctx context.Context, p storage.ReleaseParams) error {
	if len(p.IDs) == 0 {
		return nil
	}
	if err := s.writeBack(ctx, s.q.release, p.IDs, p.WorkerID, p.RetryAt); err != nil {
		return fmt.Errorf("release %d outbox rows in %s: %w", len(p.IDs), s.table, err)
	}
	return nil
}

// DeadLetter implements [storage.Storage].
func (s *Storage) DeadLetter(ctx context.Context, p storage.DeadLetterParams) error {
	if _, err := s.pool.Exec(ctx, s.q.deadLetter, p.ID, p.WorkerID, p.Error); err != nil {
		return fmt.Errorf("dead-letter outbox row %d in %s: %w", p.ID, s.table, err)
	}
	return nil
}

// writeBack runs a statement that makes leased rows unclaimable until a retry
// time. With strict ordering it takes the claim lock first: a claim running
// meanwhile could otherwise see such a row as claimable in its snapshot (its
// lease expired) while skipping it as locked, and hand out a later row of the
// same key ahead of it.
func (s *Storage) writeBack(ctx context.Context, sql string, args ...any) error {
	if s.config.DisableStrictOrdering {
		_, err := s.pool.Exec(ctx, sql, args...)
		return err
	}
	b := &pgx.Batch{}
	b.Queue(s.q.lock, s.lockKey)
	b.Queue(sql, args...)
	return s.pool.SendBatch(ctx, b).Close()
}
