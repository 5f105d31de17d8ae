package sqlite

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/txoutbox/txoutbox/storage"
)

// heldKeysSQL lists (or counts) the held keys. Parameters: ?1 now, ?2 hold
// on dead-letter, ?3 list keys after this one, ?4 limit (-1: none). A key's
// head is its first pending record, or its first dead one that holds it
// (dead-lettered with HoldOnDeadLetter, or any with ?2); the key is held
// when the head is dead, or is not claimable (leased or waiting for its
// retry) with records waiting behind it.
func (s *Storage) heldKeysSQL(count bool) string {
	if !s.strict {
		if count {
			return `SELECT 0`
		}
		return `SELECT '', 0, '', NULL, NULL, 0, NULL, 0, 0 WHERE 0`
	}
	cols := `"key", id, status, leased_by, leased_until, due_at, last_error, created_at, behind`
	if count {
		cols = `count(*)`
	}
	return fmt.Sprintf(`SELECT %[2]s FROM (
    SELECT h."key", o.id, o.status, o.leased_by, o.leased_until, o.due_at, o.last_error, o.created_at,
        (SELECT count(*) FROM %[1]s AS b
         WHERE b.status = 'pending' AND b."key" <> '' AND b."key" = h."key" AND b.id > o.id) AS behind
    FROM (
        -- Each key's first pending record, read in key order from the
        -- pending keyed index (no sort), moved back to the key's first dead
        -- record that holds it (any with ?2); then the keys with such dead
        -- records only.
        SELECT p."key", min(p.id, ifnull((SELECT min(d.id) FROM %[1]s AS d
                WHERE d.status = 'dead' AND d."key" <> '' AND d."key" = p."key" AND (?2 OR d.hold = 'key')), p.id)) AS id
        FROM (SELECT "key", min(id) AS id FROM %[1]s
              WHERE status = 'pending' AND "key" <> '' AND "key" > ?3 GROUP BY "key") AS p
        UNION ALL
        SELECT "key", min(id) FROM %[1]s AS d
        WHERE d.status = 'dead' AND d."key" <> '' AND d."key" > ?3 AND (?2 OR d.hold = 'key')
          AND NOT EXISTS (SELECT 1 FROM %[1]s AS e WHERE e.status = 'pending' AND e."key" <> '' AND e."key" = d."key")
        GROUP BY "key") AS h
    JOIN %[1]s AS o ON o.id = h.id
    WHERE o.status = 'dead' OR max(o.due_at, ifnull(o.leased_until, 0)) > ?1)
WHERE status = 'dead' OR behind > 0
ORDER BY "key" LIMIT ?4`, quote(s.table), cols)
}

// HeldKeys implements [storage.Operator].
func (s *Storage) HeldKeys(ctx context.Context, params storage.HeldKeysParams) ([]storage.HeldKey, error) {
	rows, err := s.db.QueryContext(ctx, s.heldKeysSQL(false), nanos(s.now()), s.hold, params.AfterKey, storage.PageLimit(params.Limit))
	if err != nil {
		return nil, fmt.Errorf("list held keys of %q: %w", s.table, err)
	}
	defer func() { _ = rows.Close() }()
	var out []storage.HeldKey
	now := nanos(s.now())
	for rows.Next() {
		var (
			h                   storage.HeldKey
			status              string
			leasedBy, lastError sql.NullString
			leasedUntil         sql.NullInt64
			dueAt, created      int64
		)
		if err := rows.Scan(&h.Key, &h.HeadID, &status, &leasedBy, &leasedUntil, &dueAt, &lastError, &created, &h.Behind); err != nil {
			return nil, fmt.Errorf("list held keys of %q: %w", s.table, err)
		}
		h.LastError, h.Since = lastError.String, fromNanos(created)
		switch {
		case status == string(storage.StatusDead):
			h.Reason = storage.HoldDead
		case leasedUntil.Valid && leasedUntil.Int64 > now:
			h.Reason, h.LeasedBy, h.Until = storage.HoldLeased, leasedBy.String, fromNanos(leasedUntil.Int64)
		default:
			h.Reason, h.Until = storage.HoldRetry, fromNanos(dueAt)
		}
		out = append(out, h)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list held keys of %q: %w", s.table, err)
	}
	return out, nil
}

// infoColumns are the columns scanInfo reads, from the outbox table.
const infoColumns = `id, uuid, topic, "key", %s, metadata, attempts, created_at, status, last_error,
    leased_by, leased_until, due_at, delivered_at, NULL, NULL`

// skippedColumns are the same from the skipped table.
const skippedColumns = `id, uuid, topic, "key", %s, metadata, attempts, created_at, 'skipped', last_error,
    NULL, NULL, dead_at, NULL, skipped_at, reason`

func scanInfo(row interface{ Scan(...any) error }) (storage.RecordInfo, error) {
	var (
		info                                  storage.RecordInfo
		r                                     = &info.Record
		status                                string
		metadata, lastError, leasedBy, reason sql.NullString
		leasedUntil, delivered, skipped       sql.NullInt64
		created, dueAt                        int64
	)
	err := row.Scan(&r.ID, &r.UUID, &r.Topic, &r.Key, &r.Payload, &metadata, &r.Attempts, &created, &status, &lastError,
		&leasedBy, &leasedUntil, &dueAt, &delivered, &skipped, &reason)
	if err != nil {
		return info, err
	}
	r.CreatedAt = fromNanos(created)
	if metadata.Valid && metadata.String != "" {
		if err := json.Unmarshal([]byte(metadata.String), &r.Metadata); err != nil {
			r.Metadata = nil
			r.DecodeError = fmt.Errorf("decode metadata of outbox record %d: %w", r.ID, err)
		}
	}
	info.Status = storage.Status(status)
	info.LastError, info.LeasedBy, info.SkipReason = lastError.String, leasedBy.String, reason.String
	if leasedUntil.Valid {
		info.LeasedUntil = fromNanos(leasedUntil.Int64)
	}
	if delivered.Valid {
		info.DeliveredAt = fromNanos(delivered.Int64)
	}
	if skipped.Valid {
		info.SkippedAt = fromNanos(skipped.Int64)
	}
	switch info.Status {
	case storage.StatusDead, storage.StatusSkipped:
		info.DeadAt = fromNanos(dueAt)
	default:
		info.DueAt = fromNanos(dueAt)
	}
	return info, nil
}

// ListDead implements [storage.Operator]: one page in id order, from the
// dead records' partial indexes when filtered by topic or key.
func (s *Storage) ListDead(ctx context.Context, params storage.ListDeadParams) ([]storage.RecordInfo, error) {
	var cutoff int64
	if params.OlderThan > 0 {
		cutoff = nanos(s.now().Add(-params.OlderThan))
	}
	query := fmt.Sprintf(`SELECT `+infoColumns+` FROM %s
WHERE status = 'dead' AND id > ?1 AND (?2 = '' OR topic = ?2) AND (?3 = '' OR "key" = ?3)
  AND (?4 = '' OR instr(ifnull(last_error, ''), ?4) > 0) AND (?5 = 0 OR created_at < ?5)
ORDER BY id LIMIT ?6`, `x''`, quote(s.table))
	rows, err := s.db.QueryContext(ctx, query, params.AfterID, params.Topic, params.Key, params.ErrorContains, cutoff,
		storage.PageLimit(params.Limit))
	if err != nil {
		return nil, fmt.Errorf("list dead outbox records of %q: %w", s.table, err)
	}
	defer func() { _ = rows.Close() }()
	var out []storage.RecordInfo
	for rows.Next() {
		info, err := scanInfo(rows)
		if err != nil {
			return nil, fmt.Errorf("list dead outbox records of %q: %w", s.table, err)
		}
		info.Record.Payload = nil
		out = append(out, info)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list dead outbox records of %q: %w", s.table, err)
	}
	return out, nil
}

// Record implements [storage.Operator]: the outbox table first, then the
// skipped table.
func (s *Storage) Record(ctx context.Context, id int64) (storage.RecordInfo, error) {
	query := fmt.Sprintf(`SELECT `+infoColumns+` FROM %s WHERE id = ?1
UNION ALL SELECT `+skippedColumns+` FROM %s WHERE id = ?1`, "payload", quote(s.table), "payload", quote(s.SkippedTable()))
	info, err := scanInfo(s.db.QueryRowContext(ctx, query, id))
	if errors.Is(err, sql.ErrNoRows) {
		err = storage.ErrRecordNotFound
	}
	if err != nil {
		return info, fmt.Errorf("read outbox record %d of %q: %w", id, s.table, err)
	}
	return info, nil
}

// Skip implements [storage.Operator]: in one write transaction the dead
// record is copied, with params.Reason and the time, into
// [Storage.SkippedTable] (the audit record) and deleted from the outbox
// table, so a key held by it moves on.
func (s *Storage) Skip(ctx context.Context, params storage.SkipParams) error {
	if params.Reason == "" {
		return fmt.Errorf("skip outbox record %d: SkipParams.Reason is required (it is the audit record)", params.ID)
	}
	t, sk := quote(s.table), quote(s.SkippedTable())
	var status string
	err := s.write(ctx, func(ctx context.Context) error {
		status = ""
		tx, err := s.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		res, err := tx.ExecContext(ctx, fmt.Sprintf(`INSERT INTO %s
    (id, uuid, topic, "key", payload, metadata, created_at, attempts, last_error, dead_at, skipped_at, reason)
SELECT id, uuid, topic, "key", payload, metadata, created_at, attempts, last_error, due_at, ?2, ?3
FROM %s WHERE id = ?1 AND status = 'dead'`, sk, t), params.ID, nanos(s.now()), params.Reason)
		if err != nil {
			return err
		}
		if n, err := res.RowsAffected(); err != nil || n == 0 {
			if err == nil {
				err = tx.QueryRowContext(ctx, fmt.Sprintf(`SELECT status FROM %s WHERE id = ?1
UNION ALL SELECT 'skipped' FROM %s WHERE id = ?1`, t, sk), params.ID).Scan(&status)
			}
			return err
		}
		if _, err := tx.ExecContext(ctx, fmt.Sprintf(`DELETE FROM %s WHERE id = ?1 AND status = 'dead'`, t), params.ID); err != nil {
			return err
		}
		status = string(storage.StatusSkipped)
		return tx.Commit()
	})
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return fmt.Errorf("skip outbox record %d of %q: %w", params.ID, s.table, storage.ErrRecordNotFound)
	case err != nil:
		return fmt.Errorf("skip outbox record %d of %q: %w", params.ID, s.table, err)
	case status != string(storage.StatusSkipped):
		return fmt.Errorf("skip outbox record %d of %q (%s): %w", params.ID, s.table, status, storage.ErrNotDead)
	}
	return nil
}
