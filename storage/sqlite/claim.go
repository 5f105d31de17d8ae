package sqlite

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/txoutbox/txoutbox/storage"
)

func (s *Storage) buildSQL() {
	t := quote(s.table)
	// A record is held back while an earlier pending record with the same key
	// is not claimable now: not yet due, or leased and the lease not expired,
	// that is max(due_at, leased_until) > now. An earlier claimable record is
	// claimed before it (id order). The probe is a range scan of the partial
	// index on (key, max(due_at, leased_until)), so it reads only the records
	// that block, never the claimable ones queued before o; the filter must
	// repeat the index's WHERE and expression for SQLite to use it.
	strict := ""
	if s.strict {
		strict = fmt.Sprintf(`
      AND (o."key" = '' OR NOT EXISTS (
        SELECT 1 FROM %[1]s AS e
        WHERE e.status = 'pending' AND e."key" <> '' AND e."key" = o."key"
          AND max(e.due_at, ifnull(e.leased_until, 0)) > ?3 AND e.id < o.id))`, t)
	}
	if s.hold {
		// A dead record holds its key until re-driven or skipped; and a
		// record that failed before is claimed without the later records of
		// its key, which must not be in a forwarder's batch if this attempt
		// dead-letters it. Both probes read small partial indexes.
		strict += fmt.Sprintf(`
      AND (o."key" = '' OR NOT EXISTS (
        SELECT 1 FROM %[1]s AS d
        WHERE d.status = 'dead' AND d."key" <> '' AND d."key" = o."key" AND d.id < o.id))
      AND (o."key" = '' OR NOT EXISTS (
        SELECT 1 FROM %[1]s AS f
        WHERE f.status = 'pending' AND f."key" <> '' AND f.last_error IS NOT NULL
          AND f."key" = o."key" AND f.id < o.id))`, t)
	}
	claimable := fmt.Sprintf(`o.status = 'pending' AND o.due_at <= ?3
      AND (o.leased_until IS NULL OR o.leased_until <= ?3)
      AND o.created_at <= ?4%s`, strict)
	// A read, outside any transaction: in WAL mode it takes no lock that a
	// writer waits for, so a claim that finds nothing never holds up the
	// application's writes.
	s.probeSQL = fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s AS o WHERE %s)`, t, claimable)
	// One statement: SQLite takes the write lock when the statement starts
	// (before it reads), so no other claimer can claim the same rows, and the
	// busy timeout applies to that wait whatever the transaction's BEGIN mode.
	s.claimSQL = fmt.Sprintf(`UPDATE %[1]s SET leased_by = ?1, leased_until = ?2, attempts = attempts + 1
WHERE id IN (
    SELECT o.id FROM %[1]s AS o
    WHERE %[2]s
    ORDER BY o.id
    LIMIT ?5)
RETURNING id, uuid, topic, "key", payload, metadata, attempts, created_at`, t, claimable)

	// Write-backs are fenced on leased_by; ids come as one JSON array so any
	// number fits in one statement.
	const ids = `id IN (SELECT value FROM json_each(?1))`
	s.ackSQL = fmt.Sprintf(`UPDATE %s SET status = 'delivered', delivered_at = ?3, leased_by = NULL, leased_until = NULL
WHERE %s AND leased_by = ?2 AND status = 'pending'`, t, ids)
	s.relSQL = fmt.Sprintf(`UPDATE %s SET attempts = max(attempts - 1, 0), due_at = ?3, leased_by = NULL, leased_until = NULL
WHERE %s AND leased_by = ?2 AND status = 'pending'`, t, ids)
	s.nackSQL = fmt.Sprintf(`UPDATE %s SET last_error = ?3, due_at = ?4, leased_by = NULL, leased_until = NULL
WHERE id = ?1 AND leased_by = ?2 AND status = 'pending'`, t)
	s.extendSQL = fmt.Sprintf(`UPDATE %s SET leased_until = ?3
WHERE %s AND leased_by = ?2 AND leased_until > ?4 AND status = 'pending'
RETURNING id`, t, ids)
	// A dead record's due_at is when it was dead-lettered.
	s.deadSQL = fmt.Sprintf(`UPDATE %s SET status = 'dead', last_error = ?3, due_at = ?4, leased_by = NULL, leased_until = NULL
WHERE id = ?1 AND leased_by = ?2 AND status = 'pending'`, t)
}

// Claim implements [storage.Storage]. It is one write transaction: select the
// claimable records in id order, lease them and count the attempt.
func (s *Storage) Claim(ctx context.Context, params storage.ClaimParams) ([]storage.Record, error) {
	switch {
	case params.BatchSize <= 0:
		return nil, fmt.Errorf("claim outbox records: BatchSize must be > 0, got %d", params.BatchSize)
	case params.Lease <= 0:
		return nil, fmt.Errorf("claim outbox records: Lease must be > 0, got %s", params.Lease)
	case params.WorkerID == "":
		return nil, errors.New("claim outbox records: WorkerID must not be empty")
	}
	// Look before taking the write lock. SQLite's lock is not fair: writers
	// that take it in turn (claims polling an empty outbox) starve a writer
	// that waits in the busy handler, such as the application inserting the
	// records the claims poll for.
	now := s.now()
	var found bool
	err := s.db.QueryRowContext(ctx, s.probeSQL,
		params.WorkerID, nanos(now.Add(params.Lease)), nanos(now), nanos(now.Add(-s.visibilityDelay))).Scan(&found)
	switch {
	case isBusy(err):
		// Only a database outside WAL mode, or in recovery, blocks a read:
		// claim as before, waiting for the lock.
	case err != nil:
		return nil, fmt.Errorf("claim outbox records from %q: look for claimable records: %w", s.table, err)
	case !found:
		return nil, nil
	}
	var records []storage.Record
	err = s.write(ctx, func(ctx context.Context) error {
		now := s.now()
		tx, err := s.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		rows, err := tx.QueryContext(ctx, s.claimSQL,
			params.WorkerID, nanos(now.Add(params.Lease)), nanos(now),
			nanos(now.Add(-s.visibilityDelay)), params.BatchSize)
		if err != nil {
			return err
		}
		records, err = scanRecords(rows, params.BatchSize)
		if err != nil {
			return err
		}
		return tx.Commit()
	})
	if err != nil {
		return nil, fmt.Errorf("claim outbox records from %q: %w", s.table, err)
	}
	// RETURNING order is unspecified.
	slices.SortFunc(records, func(a, b storage.Record) int { return cmp.Compare(a.ID, b.ID) })
	return records, nil
}

func scanRecords(rows *sql.Rows, capacity int) ([]storage.Record, error) {
	defer func() { _ = rows.Close() }()
	records := make([]storage.Record, 0, min(capacity, 1024))
	for rows.Next() {
		var (
			r        storage.Record
			metadata sql.NullString
			created  int64
		)
		if err := rows.Scan(&r.ID, &r.UUID, &r.Topic, &r.Key, &r.Payload, &metadata, &r.Attempts, &created); err != nil {
			return nil, err
		}
		r.CreatedAt = fromNanos(created)
		if metadata.Valid && metadata.String != "" {
			if err := json.Unmarshal([]byte(metadata.String), &r.Metadata); err != nil {
				r.Metadata = nil
				r.DecodeError = fmt.Errorf("decode metadata of outbox record %d: %w", r.ID, err)
			}
		}
		records = append(records, r)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return records, rows.Close()
}

// Ack implements [storage.Storage].
func (s *Storage) Ack(ctx context.Context, params storage.AckParams) error {
	if len(params.IDs) == 0 || params.WorkerID == "" {
		return nil
	}
	if err := s.exec(ctx, s.ackSQL, idsJSON(params.IDs), params.WorkerID, nanos(s.now())); err != nil {
		return fmt.Errorf("ack %d outbox records: %w", len(params.IDs), err)
	}
	return nil
}

// Nack implements [storage.Storage].
func (s *Storage) Nack(ctx context.Context, params storage.NackParams) error {
	if params.WorkerID == "" {
		return nil
	}
	if err := s.exec(ctx, s.nackSQL, params.ID, params.WorkerID, params.Error, nanos(params.RetryAt)); err != nil {
		return fmt.Errorf("nack outbox record %d: %w", params.ID, err)
	}
	return nil
}

// Release implements [storage.Storage].
func (s *Storage) Release(ctx context.Context, params storage.ReleaseParams) error {
	if len(params.IDs) == 0 || params.WorkerID == "" {
		return nil
	}
	if err := s.exec(ctx, s.relSQL, idsJSON(params.IDs), params.WorkerID, nanos(params.RetryAt)); err != nil {
		return fmt.Errorf("release %d outbox records: %w", len(params.IDs), err)
	}
	return nil
}

// DeadLetter implements [storage.Storage].
func (s *Storage) DeadLetter(ctx context.Context, params storage.DeadLetterParams) error {
	if params.WorkerID == "" {
		return nil
	}
	if err := s.exec(ctx, s.deadSQL, params.ID, params.WorkerID, params.Error, nanos(s.now())); err != nil {
		return fmt.Errorf("dead-letter outbox record %d: %w", params.ID, err)
	}
	return nil
}

// Extend implements [storage.Storage].
func (s *Storage) Extend(ctx context.Context, params storage.ExtendParams) ([]int64, error) {
	if params.Lease <= 0 {
		return nil, fmt.Errorf("extend outbox leases: Lease must be > 0, got %s", params.Lease)
	}
	if len(params.IDs) == 0 || params.WorkerID == "" {
		return nil, nil
	}
	var extended []int64
	err := s.write(ctx, func(ctx context.Context) error {
		extended = extended[:0]
		now := s.now()
		rows, err := s.db.QueryContext(ctx, s.extendSQL, idsJSON(params.IDs), params.WorkerID, nanos(now.Add(params.Lease)), nanos(now))
		if err != nil {
			return err
		}
		defer func() { _ = rows.Close() }()
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				return err
			}
			extended = append(extended, id)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("extend the lease of %d outbox records: %w", len(params.IDs), err)
	}
	return extended, nil
}

// exec runs one write statement in autocommit mode under the write semaphore.
func (s *Storage) exec(ctx context.Context, query string, args ...any) error {
	return s.write(ctx, func(ctx context.Context) error {
		_, err := s.db.ExecContext(ctx, query, args...)
		return err
	})
}

// idsJSON encodes ids as a JSON array for json_each.
func idsJSON(ids []int64) string {
	var b strings.Builder
	b.Grow(len(ids)*8 + 2)
	b.WriteByte('[')
	for i, id := range ids {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(id, 10))
	}
	b.WriteByte(']')
	return b.String()
}
