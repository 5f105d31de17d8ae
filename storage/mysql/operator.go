package mysql

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// heldKeysSQL lists (or counts) the held keys after afterKey, at most limit
// (count ignores both). A key's head is its first pending row, or with
// HoldOnDeadLetter its first dead row when that is earlier; the key is held
// when the head is dead, or is not claimable (leased, or waiting for its
// retry) with pending rows behind it. Heads are looked for among the few
// rows that can be one: pending, not parked and not due (claim_idx: leased
// rows and rows waiting for a retry; a parked row is behind another), and,
// with HoldOnDeadLetter, dead rows (done_idx). Each is checked against
// key_idx, each check reading one or two entries (a NOT EXISTS for an
// earlier row read every row of the key: a million behind a held key took
// half a second); the statement never reads the claimable backlog. The
// list counts the rows behind its page's heads, and only those.
func (s *Storage) heldKeysSQL(count bool, afterKey string, limit int) string {
	if s.config.DisableStrictOrdering {
		if count {
			return "SELECT 0"
		}
		return "SELECT '', 0, '', '', NULL, 0, '', 0, 0, 0 FROM DUAL WHERE FALSE"
	}
	t := s.table
	var after strings.Builder
	if afterKey != "" {
		after.WriteString(" AND `key` > ")
		strLit(&after, afterKey)
	}
	var b strings.Builder
	b.WriteString("SELECT " + bin("o.`key`") + " AS `key`, o.id, o.status, " + bin("COALESCE(o.leased_by, '')") + " AS leased_by, " + micros("o.leased_until") + " AS leased_until, " +
		micros("o.due_at") + " AS due_at, " + bin("COALESCE(o.last_error, '')") + " AS last_error, " + micros("o.created_at") + " AS created_at,\n" +
		"    COALESCE(o.leased_until > UTC_TIMESTAMP(6), 0) AS live, o.`key` AS raw_key,\n" +
		"    EXISTS (SELECT 1 FROM " + t + " AS b WHERE b.`key` = o.`key` AND b.status = 'pending' AND b.id > o.id) AS has_behind\n" +
		"FROM (\n    SELECT id FROM " + t + " WHERE status = 'pending' AND parked = 0 AND due_at > UTC_TIMESTAMP(6) AND `key` <> ''" + after.String())
	if s.hold {
		b.WriteString("\n    UNION ALL\n    SELECT id FROM " + t + " WHERE status = 'dead' AND `key` <> ''" + after.String())
	}
	b.WriteString("\n) AS c JOIN " + t + " AS o ON o.id = c.id\n" +
		"WHERE COALESCE(" + s.lowestOf("pending", "o") + ", o.id) >= o.id")
	if s.hold {
		b.WriteString("\n  AND COALESCE(" + s.lowestOf("dead", "o") + ", o.id) >= o.id")
	}
	heads := b.String()
	if count {
		return "SELECT COUNT(*) FROM (" + heads + ") AS k WHERE status = 'dead' OR has_behind"
	}
	// The rows behind are counted for the page's keys only.
	return "SELECT `key`, id, status, leased_by, leased_until, due_at, last_error, created_at, live,\n" +
		"    (SELECT COUNT(*) FROM " + t + " AS b WHERE b.`key` = p.raw_key AND b.status = 'pending' AND b.id > p.id) AS behind\n" +
		"FROM (SELECT * FROM (" + heads + ") AS k WHERE status = 'dead' OR has_behind ORDER BY raw_key LIMIT " + strconv.Itoa(limit) + ") AS p\n" +
		"ORDER BY raw_key"
}

// HeldKeys implements [storage.Operator].
func (s *Storage) HeldKeys(ctx context.Context, params storage.HeldKeysParams) ([]storage.HeldKey, error) {
	rows, err := s.db.QueryContext(ctx, s.heldKeysSQL(false, validText(params.AfterKey), storage.PageLimit(params.Limit)))
	if err != nil {
		return nil, fmt.Errorf("list held keys of %s: %w", s.table, err)
	}
	defer func() { _ = rows.Close() }()
	var out []storage.HeldKey
	for rows.Next() {
		var (
			h              storage.HeldKey
			key, status    []byte
			leasedBy       string
			leasedUntil    sql.NullInt64
			dueAt, created int64
			live           bool
		)
		if err := rows.Scan(&key, &h.HeadID, &status, &leasedBy, &leasedUntil, &dueAt, &h.LastError, &created, &live, &h.Behind); err != nil {
			return nil, fmt.Errorf("list held keys of %s: %w", s.table, err)
		}
		h.Key, h.Since = string(key), fromMicros(created)
		switch {
		case string(status) == string(storage.StatusDead):
			h.Reason = storage.HoldDead
		case live:
			h.Reason, h.LeasedBy, h.Until = storage.HoldLeased, leasedBy, fromMicros(leasedUntil.Int64)
		default:
			h.Reason, h.Until = storage.HoldRetry, fromMicros(dueAt)
		}
		out = append(out, h)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list held keys of %s: %w", s.table, err)
	}
	return out, nil
}

// infoColumns are the columns scanInfo reads from the outbox table; %s is
// the payload column (NULL to leave it out).
var infoColumns = "id, CAST(uuid AS BINARY), CAST(topic AS BINARY), CAST(`key` AS BINARY), %s, " + binJSON("metadata") + ", attempts, " +
	"TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', created_at), status, CAST(last_error AS BINARY), CAST(leased_by AS BINARY), " +
	"TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', leased_until), " +
	"TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', due_at), " +
	"TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', delivered_at), NULL, NULL"

// skippedColumns are the same from the skipped table.
var skippedColumns = "id, CAST(uuid AS BINARY), CAST(topic AS BINARY), CAST(`key` AS BINARY), payload, " + binJSON("metadata") + ", attempts, " +
	"TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', created_at), 'skipped', CAST(last_error AS BINARY), NULL, NULL, " +
	"TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', dead_at), NULL, " +
	"TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', skipped_at), CAST(reason AS BINARY)"

func scanInfo(row interface{ Scan(...any) error }) (storage.RecordInfo, error) {
	var (
		info                                   storage.RecordInfo
		r                                      = &info.Record
		uuid, topic, key, status               []byte
		metadata                               []byte
		lastError, leasedBy, reason            sql.NullString
		leasedUntil, dueAt, delivered, skipped sql.NullInt64
		created                                int64
	)
	err := row.Scan(&r.ID, &uuid, &topic, &key, &r.Payload, &metadata, &r.Attempts, &created, &status, &lastError,
		&leasedBy, &leasedUntil, &dueAt, &delivered, &skipped, &reason)
	if err != nil {
		return info, err
	}
	r.UUID, r.Topic, r.Key = string(uuid), string(topic), string(key)
	r.CreatedAt = fromMicros(created)
	if metadata != nil {
		if err := json.Unmarshal(metadata, &r.Metadata); err != nil {
			r.Metadata = nil
			r.DecodeError = fmt.Errorf("decode metadata of outbox record %d: %w", r.ID, err)
		}
	}
	info.Status = storage.Status(status)
	info.LastError, info.SkipReason = lastError.String, reason.String
	if leasedBy.Valid && leasedUntil.Valid {
		info.LeasedBy, info.LeasedUntil = leasedBy.String, fromMicros(leasedUntil.Int64)
	}
	if delivered.Valid {
		info.DeliveredAt = fromMicros(delivered.Int64)
	}
	if skipped.Valid {
		info.SkippedAt = fromMicros(skipped.Int64)
	}
	switch {
	case !dueAt.Valid:
	case info.Status == storage.StatusDead || info.Status == storage.StatusSkipped:
		info.DeadAt = fromMicros(dueAt.Int64) // a dead row's due_at is when it died
	case info.Status == storage.StatusPending && !leasedBy.Valid:
		info.DueAt = fromMicros(dueAt.Int64)
	}
	return info, nil
}

// ListDead implements [storage.Operator]: one page in id order. Dead rows
// have no delivered_at, so done_idx (status, delivered_at, and the primary
// key InnoDB appends) holds them in id order, and the page is read from it,
// named with FORCE INDEX: left to itself the optimizer walks the primary key
// in id order when dead rows are not rare, which reads the whole table when
// a filter matches few of them. A page reads at most the dead rows after
// AfterID. A key filter reads key_idx (key, status, id) instead, the key's
// dead rows in id order.
func (s *Storage) ListDead(ctx context.Context, params storage.ListDeadParams) ([]storage.RecordInfo, error) {
	rows, err := s.db.QueryContext(ctx, s.listDeadSQL(params))
	if err != nil {
		return nil, fmt.Errorf("list dead outbox records of %s: %w", s.table, err)
	}
	defer func() { _ = rows.Close() }()
	var out []storage.RecordInfo
	for rows.Next() {
		info, err := scanInfo(rows)
		if err != nil {
			return nil, fmt.Errorf("list dead outbox records of %s: %w", s.table, err)
		}
		info.Record.Payload = nil
		out = append(out, info)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list dead outbox records of %s: %w", s.table, err)
	}
	return out, nil
}

func (s *Storage) listDeadSQL(params storage.ListDeadParams) string {
	var b strings.Builder
	index := " FORCE INDEX (done_idx)"
	if params.Key != "" {
		index = "" // key_idx: the key's rows
	}
	fmt.Fprintf(&b, "SELECT "+infoColumns+" FROM %s%s WHERE status = 'dead' AND delivered_at IS NULL AND id > %d", "NULL", s.table, index, params.AfterID)
	if params.Topic != "" {
		exactly(&b, "topic", validText(params.Topic))
	}
	if params.Key != "" {
		exactly(&b, "`key`", validText(params.Key))
	}
	if params.ErrorContains != "" {
		b.WriteString(" AND LOCATE(")
		strLit(&b, validText(params.ErrorContains))
		b.WriteString(", last_error) > 0")
	}
	if params.OlderThan > 0 {
		b.WriteString(" AND created_at < " + plusMicros("UTC_TIMESTAMP(6)", -params.OlderThan))
	}
	fmt.Fprintf(&b, " ORDER BY id LIMIT %d", storage.PageLimit(params.Limit))
	return b.String()
}

// Record implements [storage.Operator]: the outbox table first, then the
// skipped table.
func (s *Storage) Record(ctx context.Context, id int64) (storage.RecordInfo, error) {
	q := fmt.Sprintf("SELECT "+infoColumns+" FROM %s WHERE id = %d UNION ALL SELECT "+skippedColumns+" FROM %s WHERE id = %d",
		"payload", s.table, id, s.SkippedTable(), id)
	info, err := scanInfo(s.db.QueryRowContext(ctx, q))
	if errors.Is(err, sql.ErrNoRows) {
		err = storage.ErrRecordNotFound
	}
	if err != nil {
		return info, fmt.Errorf("read outbox record %d of %s: %w", id, s.table, err)
	}
	return info, nil
}

// Skip implements [storage.Operator]: in one transaction the dead row is
// locked, copied with params.Reason and the time into [Storage.SkippedTable]
// (the audit record) and deleted from the outbox table; then, as after an
// ack, the next pending row of its key is unparked, so the key moves on.
func (s *Storage) Skip(ctx context.Context, params storage.SkipParams) error {
	if params.Reason == "" {
		return fmt.Errorf("skip outbox record %d: SkipParams.Reason is required (it is the audit record)", params.ID)
	}
	var status string
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		status = ""
		var key []byte
		err := tx.QueryRowContext(ctx, fmt.Sprintf("SELECT status, CAST(`key` AS BINARY) FROM %s WHERE id = %d FOR UPDATE", s.table, params.ID)).Scan(&status, &key)
		if errors.Is(err, sql.ErrNoRows) {
			var n int
			if err := tx.QueryRowContext(ctx, fmt.Sprintf("SELECT COUNT(*) FROM %s WHERE id = %d", s.SkippedTable(), params.ID)).Scan(&n); err != nil {
				return err
			}
			if n == 0 {
				return storage.ErrRecordNotFound
			}
			status = string(storage.StatusSkipped)
			return nil
		}
		if err != nil || status != string(storage.StatusDead) {
			return err
		}
		var b strings.Builder
		b.WriteString("INSERT INTO " + s.SkippedTable() + ` (id, uuid, topic, ` + "`key`" + `, payload, metadata, created_at, attempts, last_error, dead_at, skipped_at, reason)
SELECT id, uuid, topic, ` + "`key`" + `, payload, metadata, created_at, attempts, last_error, due_at, UTC_TIMESTAMP(6), `)
		strLit(&b, validText(params.Reason))
		fmt.Fprintf(&b, " FROM %s WHERE id = %d", s.table, params.ID)
		if _, err := tx.ExecContext(ctx, b.String()); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, fmt.Sprintf("DELETE FROM %s WHERE id = %d", s.table, params.ID)); err != nil {
			return err
		}
		status = string(storage.StatusSkipped)
		if len(key) == 0 {
			return nil
		}
		return s.promote(ctx, tx, nil, []string{string(key)})
	})
	switch {
	case err != nil:
		return fmt.Errorf("skip outbox record %d of %s: %w", params.ID, s.table, err)
	case status != string(storage.StatusSkipped):
		return fmt.Errorf("skip outbox record %d of %s (%s): %w", params.ID, s.table, status, storage.ErrNotDead)
	}
	return nil
}

// Stats implements [storage.StatsReader]. One statement, so the counts are
// one consistent read: Pending reads claim_idx, OldestPendingAge the
// lowest pending id's row (done_idx holds pending rows in id order: their
// delivered_at is NULL), so the age of the oldest pending record as ids
// order them,
// Delivered and Dead done_idx, Leased and Forwarders the leased rows of
// claim_idx (a live lease's end is its row's due_at), Skipped the skipped
// table, and HeldKeys the heads as [Storage.HeldKeys] finds them. Delivered
// is always 0 with [Config.DeleteOnAck]. On a table not yet migrated to the
// skipped table, Skipped is 0.
func (s *Storage) Stats(ctx context.Context) (storage.Stats, error) {
	st, err := s.stats(ctx, true)
	if isNoSuchTable(err) {
		st, err = s.stats(ctx, false)
	}
	if err != nil {
		return storage.Stats{}, fmt.Errorf("outbox stats of %s: %w", s.table, err)
	}
	return st, nil
}

func (s *Storage) stats(ctx context.Context, skipped bool) (storage.Stats, error) {
	skippedCount := "0"
	if skipped {
		skippedCount = "(SELECT COUNT(*) FROM " + s.SkippedTable() + ")"
	}
	leased := "status = 'pending' AND parked = 0 AND due_at > UTC_TIMESTAMP(6) AND leased_until > UTC_TIMESTAMP(6)"
	q := fmt.Sprintf(`SELECT
    (SELECT COUNT(*) FROM %[1]s WHERE status = 'pending'),
    (SELECT COUNT(*) FROM %[1]s WHERE %[2]s),
    (SELECT COUNT(*) FROM %[1]s WHERE status = 'delivered'),
    (SELECT COUNT(*) FROM %[1]s WHERE status = 'dead'),
    COALESCE((SELECT TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) FROM %[1]s FORCE INDEX (done_idx) WHERE status = 'pending' AND delivered_at IS NULL ORDER BY id LIMIT 1), 0),
    %[3]s,
    (SELECT COUNT(DISTINCT leased_by) FROM %[1]s WHERE %[2]s),
    (%[4]s),
    COALESCE((SELECT TIMESTAMPDIFF(MICROSECOND, MIN(delivered_at), UTC_TIMESTAMP(6)) FROM %[1]s WHERE status = 'delivered'), 0)`, s.table, leased, skippedCount, s.heldKeysSQL(true, "", 0))
	var st storage.Stats
	var age, deliveredAge int64
	if err := s.db.QueryRowContext(ctx, q).Scan(&st.Pending, &st.Leased, &st.Delivered, &st.Dead, &age, &st.Skipped, &st.Forwarders, &st.HeldKeys, &deliveredAge); err != nil {
		return storage.Stats{}, err
	}
	st.OldestPendingAge = max(time.Duration(age)*time.Microsecond, 0)
	st.OldestDeliveredAge = max(time.Duration(deliveredAge)*time.Microsecond, 0)
	return st, nil
}
