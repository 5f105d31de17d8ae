package postgres

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox/storage"
)

// heldKeysSQL lists (or counts) the held keys. Parameters: $1 list keys
// after this one, $2 the most keys (listing only). A key's head is its lowest
// unclaimable id: a live lease, a row waiting for its retry, or with
// HoldOnDeadLetter a dead row. Those rows come from the lease table (the
// rows in flight), the held index (rows waiting for a retry) and the
// dead_key index, so the
// query reads no pending row but the heads and, per head, the key_idx entries
// of the rows behind it. A key is held when its head is dead or has pending
// rows behind it.
func (s *Storage) heldKeysSQL(count bool) string {
	if s.config.DisableStrictOrdering {
		return `SELECT 0::bigint WHERE $1::text IS NOT NULL` // no key is held back
	}
	dead := ""
	if s.config.HoldOnDeadLetter {
		dead = fmt.Sprintf(`
        UNION ALL
        SELECT d.key, d.id FROM %s d WHERE d.status = 'dead' AND d.key <> '' AND d.key > $1`, s.table)
	}
	cols := `key, id, status, leased_by, leased_until, due_at, last_error, created_at, behind`
	tail := `ORDER BY key LIMIT $2`
	if count {
		cols, tail = `count(*)`, ``
	}
	return fmt.Sprintf(`SELECT %[4]s FROM (
    SELECT h.key, o.id, o.status, l.leased_by, l.leased_until, o.due_at, o.last_error, o.created_at,
        (SELECT count(*) FROM %[1]s b WHERE b.status = 'pending' AND b.key <> '' AND b.key = h.key AND b.id > h.id) AS behind
    FROM (
        SELECT u.key, min(u.id) AS id FROM (
            SELECT l.key, l.id FROM %[2]s l WHERE l.leased_until > now() AND l.key <> '' AND l.key > $1
            UNION ALL
            SELECT e.key, e.id FROM %[1]s e
            WHERE e.status = 'pending' AND e.hold = 'retry' AND e.key <> '' AND e.key > $1%[3]s
        ) u GROUP BY u.key) h
    JOIN %[1]s o ON o.id = h.id
    LEFT JOIN %[2]s l ON l.id = o.id AND l.leased_until > now()) k
WHERE status = 'dead' OR (status = 'pending' AND behind > 0)
%[5]s`, s.table, s.leases, dead, cols, tail)
}

// HeldKeys implements [storage.Operator].
func (s *Storage) HeldKeys(ctx context.Context, params storage.HeldKeysParams) ([]storage.HeldKey, error) {
	if s.config.DisableStrictOrdering {
		return nil, nil // without strict ordering no key is held back
	}
	rows, err := s.pool.Query(ctx, s.heldKeysSQL(false), params.AfterKey, storage.PageLimit(params.Limit))
	if err != nil {
		return nil, fmt.Errorf("list held keys of %s: %w", s.table, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (storage.HeldKey, error) {
		var (
			h                   storage.HeldKey
			status              string
			leasedBy, lastError *string
			leasedUntil         *time.Time
			dueAt               time.Time
		)
		if err := r.Scan(&h.Key, &h.HeadID, &status, &leasedBy, &leasedUntil, &dueAt, &lastError, &h.Since, &h.Behind); err != nil {
			return h, err
		}
		h.LastError = deref(lastError)
		switch {
		case status == string(storage.StatusDead):
			h.Reason = storage.HoldDead
		case leasedUntil != nil:
			h.Reason, h.LeasedBy, h.Until = storage.HoldLeased, deref(leasedBy), *leasedUntil
		default:
			h.Reason, h.Until = storage.HoldRetry, dueAt
		}
		return h, nil
	})
	if err != nil {
		return nil, fmt.Errorf("list held keys of %s: %w", s.table, err)
	}
	return out, nil
}

func deref(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}

// recordColumns are the columns scanInfo reads; %s is the payload column
// (or an empty bytea).
const recordColumns = `o.id, o.uuid, o.topic, o.key, %s, o.metadata, o.attempts, o.created_at, o.status, o.last_error,
    %s, o.due_at, o.delivered_at, NULL::timestamptz, NULL::text, o.dead_at`

func scanInfo(row pgx.Row) (storage.RecordInfo, error) {
	var (
		info                          storage.RecordInfo
		r                             = &info.Record
		status                        string
		metadata                      []byte
		lastError, leasedBy, reason   *string
		leasedUntil, delivered, skipd *time.Time
		dueAt, deadAt                 *time.Time
	)
	err := row.Scan(&r.ID, &r.UUID, &r.Topic, &r.Key, &r.Payload, &metadata, &r.Attempts, &r.CreatedAt, &status, &lastError,
		&leasedBy, &leasedUntil, &dueAt, &delivered, &skipd, &reason, &deadAt)
	if err != nil {
		return info, err
	}
	if len(metadata) > 0 {
		decodeMetadata(metadata, r)
	}
	info.Status = storage.Status(status)
	info.LastError, info.LeasedBy, info.SkipReason = deref(lastError), deref(leasedBy), deref(reason)
	if leasedUntil != nil {
		info.LeasedUntil = *leasedUntil
	}
	if delivered != nil {
		info.DeliveredAt = *delivered
	}
	if skipd != nil {
		info.SkippedAt = *skipd
	}
	// Records dead-lettered before schema version 3 have no dead_at.
	if deadAt != nil && info.Status == storage.StatusDead {
		info.DeadAt = *deadAt
	}
	if info.Status == storage.StatusPending && dueAt != nil {
		info.DueAt = *dueAt
	}
	return info, nil
}

// ListDead implements [storage.Operator]: one page in id order. Only the
// filters that are set go into the statement, so that each shape uses its
// index: by key the dead_key index (key, id), by topic the dead index
// (topic, id), otherwise the dead_id index (id), all partial indexes of the
// dead rows: a page never walks the pending rows. A filter on the error text
// or the age reads dead rows until the page is full.
func (s *Storage) ListDead(ctx context.Context, params storage.ListDeadParams) ([]storage.RecordInfo, error) {
	where := `o.status = 'dead' AND o.id > $1`
	args := []any{params.AfterID}
	add := func(cond string, v any) {
		args = append(args, v)
		where += fmt.Sprintf(" AND "+cond, len(args))
	}
	if params.Topic != "" {
		add("o.topic = $%d", params.Topic)
	}
	if params.Key != "" {
		add("o.key <> '' AND o.key = $%d", params.Key)
	}
	if params.ErrorContains != "" {
		add("strpos(o.last_error, $%d) > 0", params.ErrorContains)
	}
	if params.OlderThan > 0 {
		add("o.created_at < now() - $%d::bigint * interval '1 microsecond'", params.OlderThan.Microseconds())
	}
	args = append(args, storage.PageLimit(params.Limit))
	// A dead row has no lease: the dead-letter deleted it.
	q := fmt.Sprintf(`SELECT `+recordColumns+` FROM %s o
WHERE %s ORDER BY o.id LIMIT $%d`, `''::bytea`, `NULL::text, NULL::timestamptz`, s.table, where, len(args))
	rows, err := s.pool.Query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("list dead outbox records of %s: %w", s.table, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (storage.RecordInfo, error) {
		info, err := scanInfo(r)
		info.Record.Payload = nil
		return info, err
	})
	if err != nil {
		return nil, fmt.Errorf("list dead outbox records of %s: %w", s.table, err)
	}
	return out, nil
}

// Record implements [storage.Operator]: the outbox table (pending and dead
// records, with their lease), then the skipped table, then the delivered
// table (which keeps no payload nor metadata).
func (s *Storage) Record(ctx context.Context, id int64) (storage.RecordInfo, error) {
	q := fmt.Sprintf(`SELECT `+recordColumns+` FROM %[3]s o LEFT JOIN %[4]s l ON l.id = o.id WHERE o.id = $1
UNION ALL
SELECT k.id, k.uuid, k.topic, k.key, k.payload, k.metadata, k.attempts, k.created_at, 'skipped', k.last_error,
    NULL, NULL, NULL, NULL, k.skipped_at, k.reason, NULL
FROM %[5]s k WHERE k.id = $1
UNION ALL
SELECT d.id, d.uuid, d.topic, d.key, NULL, NULL, d.attempts, d.created_at, 'delivered', d.last_error,
    NULL, NULL, NULL, d.delivered_at, NULL, NULL, NULL
FROM %[6]s d WHERE d.id = $1
LIMIT 1`, "o.payload", "l.leased_by, l.leased_until", s.table, s.leases, s.skipped, s.delivered)
	info, err := scanInfo(s.pool.QueryRow(ctx, q, id))
	if errors.Is(err, pgx.ErrNoRows) {
		err = storage.ErrRecordNotFound
	}
	if err != nil {
		return info, fmt.Errorf("read outbox record %d of %s: %w", id, s.table, err)
	}
	return info, nil
}

// Skip implements [storage.Operator]: in one statement the dead row is
// deleted from the outbox table and copied, with params.Reason and the
// time, into [Storage.SkippedTable] (the audit record), so a key it held
// moves on.
func (s *Storage) Skip(ctx context.Context, params storage.SkipParams) error {
	if params.Reason == "" {
		return fmt.Errorf("skip outbox record %d: SkipParams.Reason is required (it is the audit record)", params.ID)
	}
	var n int64
	if err := s.queryRow(ctx, !s.config.DisableStrictOrdering, []any{&n}, s.skipStatement(), params.ID, params.Reason); err != nil {
		return fmt.Errorf("skip outbox record %d of %s: %w", params.ID, s.table, err)
	}
	if n == 1 {
		return nil
	}
	return s.skipMissed(ctx, params.ID)
}

// skipStatement is Skip's statement: $1 the record, $2 the reason.
func (s *Storage) skipStatement() string {
	// The rows of its key parked behind the dead record are set free (see
	// the claim), under the claim lock: a claim running meanwhile could
	// otherwise park a row behind the record this statement removes, after
	// the statement looked.
	return fmt.Sprintf(`WITH d AS (
    DELETE FROM %s WHERE id = $1 AND status = 'dead'
    RETURNING id, uuid, topic, key, payload, metadata, created_at, attempts, last_error),
i AS (
    INSERT INTO %s (id, uuid, topic, key, payload, metadata, created_at, attempts, last_error, skipped_at, reason)
    SELECT id, uuid, topic, key, payload, metadata, created_at, attempts, last_error, now(), $2 FROM d)%s
SELECT count(*) FROM d`, s.table, s.skipped, s.q.unparkCTEs)
}

// skipMissed explains why Skip of the record id found no dead row.
func (s *Storage) skipMissed(ctx context.Context, id int64) error {
	info, err := s.Record(ctx, id)
	switch {
	case err != nil:
		return fmt.Errorf("skip: %w", err)
	case info.Status == storage.StatusSkipped:
		return nil
	default:
		return fmt.Errorf("skip outbox record %d of %s (%s): %w", id, s.table, info.Status, storage.ErrNotDead)
	}
}
