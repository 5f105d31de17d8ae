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
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// maxID is larger than any id: the bound of a key's queue with no dead
// record in it.
const maxID = int64(1<<63 - 1)

func (s *Storage) buildSQL() {
	t := quote(s.table)
	retryIndex := quote(s.table + "_retry_due")
	// A dead record holds back the later records of its key when it was
	// dead-lettered with HoldOnDeadLetter (hold = 'key'), or, with
	// HoldOnDeadLetter, whatever storage dead-lettered it.
	holding := `d.hold = 'key'`
	if s.hold {
		holding = `1`
	}
	deadBefore := func(alias string) string {
		return fmt.Sprintf(`EXISTS (SELECT 1 FROM %s AS d
        WHERE d.status = 'dead' AND d."key" <> '' AND d."key" = %[2]s."key" AND d.id < %[2]s.id AND %[3]s)`, t, alias, holding)
	}

	// visible is the VisibilityDelay cutoff, on created_at, which Insert
	// keeps increasing in id order: the records not yet visible are the
	// newest ones, so an earlier record of a key is never hidden while a
	// later one shows.
	visible := ""
	if s.visibilityDelay > 0 {
		visible = ` AND o.created_at <= ?4`
	}
	// The strict-ordering check of a candidate o: no earlier pending record
	// of its key is set aside, waiting for its retry or leased (it reads
	// the key's earlier pending records in id order and stops at the first
	// that blocks; a candidate is almost always its key's first), and no
	// earlier dead record holds the key.
	strict := ""
	if s.strict {
		strict = fmt.Sprintf(`
      AND (o."key" = '' OR NOT EXISTS (
        SELECT 1 FROM %[1]s AS e
        WHERE e.status = 'pending' AND e."key" <> '' AND e."key" = o."key" AND e.id < o.id
          AND (e.hold IS NOT NULL OR e.due_at > ?3 OR e.leased_until > ?3)))
      AND (o."key" = '' OR NOT %[2]s)`, t, deadBefore("o"))
		if s.hold {
			// A record that failed before is claimed without the later
			// records of its key, which must not be in a forwarder's batch
			// if this attempt dead-letters it.
			strict += fmt.Sprintf(`
      AND (o."key" = '' OR NOT EXISTS (
        SELECT 1 FROM %s AS f
        WHERE f.status = 'pending' AND f."key" <> '' AND f.last_error IS NOT NULL
          AND f."key" = o."key" AND f.id < o.id))`, t)
		}
	}
	// The records a claim walks: pending, not set aside, due, not leased.
	claimable := fmt.Sprintf(`o.status = 'pending' AND o.hold IS NULL AND o.due_at <= ?3
      AND (o.leased_until IS NULL OR o.leased_until <= ?3)%s%s`, visible, strict)
	// A read, outside any transaction: in WAL mode it takes no lock that a
	// writer waits for, so a claim that finds nothing never holds up the
	// application's writes. It also tells whether a record's retry is due,
	// which the claim then puts back first.
	s.probeSQL = fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %[1]s AS o WHERE %[2]s),
    EXISTS (SELECT 1 FROM %[1]s INDEXED BY %[3]s WHERE status = 'pending' AND hold = 'retry' AND due_at <= ?3)`,
		t, claimable, retryIndex)

	// The hold a pending record gets when it is handed back or comes due
	// (due is its due time): 'retry' while not due, 'behind' while an
	// earlier record of its key is pending or holds it dead (strict
	// ordering only), else none.
	holdRule := func(alias, due string) string {
		rule := fmt.Sprintf(`CASE WHEN %s > :now THEN 'retry'`, due)
		if s.strict {
			rule += fmt.Sprintf(`
        WHEN %[2]s."key" <> '' AND (EXISTS (SELECT 1 FROM %[1]s AS e
            WHERE e.status = 'pending' AND e."key" <> '' AND e."key" = %[2]s."key" AND e.id < %[2]s.id)
          OR %[3]s) THEN 'behind'`, t, alias, deadBefore(alias))
		}
		return rule + ` END`
	}
	// Records whose retry is due go back to the walk (or behind an earlier
	// record of their key), a batch at a time, before the walk. They are
	// found by due time (INDEXED BY: without statistics SQLite would read
	// every record waiting for its retry through the (hold, id) index).
	s.dueSQL = fmt.Sprintf(`UPDATE %[1]s SET hold = %[2]s
WHERE id IN (SELECT id FROM %[1]s INDEXED BY %[3]s WHERE status = 'pending' AND hold = 'retry' AND due_at <= :now
             ORDER BY due_at LIMIT :limit)`, t, holdRule(t, "due_at"), retryIndex)

	// One statement, run after dueSQL in the same write transaction: the
	// walk over the records that are not set aside, in id order.
	// It returns whether records are queued behind each one it took.
	s.claimSQL = fmt.Sprintf(`UPDATE %[1]s SET leased_by = ?1, leased_until = ?2, attempts = attempts + 1
WHERE id IN (
    SELECT o.id FROM %[1]s AS o
    WHERE %[2]s
    ORDER BY o.id
    LIMIT ?5)
RETURNING %[3]s,
    "key" <> '' AND EXISTS (SELECT 1 FROM %[1]s AS q
        WHERE q.status = 'pending' AND q."key" <> '' AND q."key" = %[1]s."key" AND q.id > %[1]s.id)`, t, claimable, returned)

	// The records queued behind the last record a claim took of a key, in
	// id order, up to the first dead record that holds the key: the claim
	// takes them while they are claimable (see takeAlong).
	s.queueSQL = fmt.Sprintf(`SELECT id, hold, due_at, ifnull(leased_until, 0), created_at, last_error IS NOT NULL FROM %[1]s
WHERE status = 'pending' AND "key" <> '' AND "key" = ?1 AND id > ?2
  AND id < ifnull((SELECT min(d.id) FROM %[1]s AS d
                   WHERE d.status = 'dead' AND d."key" <> '' AND d."key" = ?1 AND d.id > ?2 AND %[2]s), %[3]d)
ORDER BY id LIMIT ?3`, t, holding, maxID)
	s.alongSQL = fmt.Sprintf(`UPDATE %s SET leased_by = ?1, leased_until = ?2, attempts = attempts + 1, hold = NULL
WHERE id IN (SELECT value FROM json_each(?3)) AND status = 'pending'
RETURNING %s, 0`, t, returned)

	// Write-backs are fenced on the claim: leased_by and the attempts it
	// returned (see storage.ClaimRef). The records come as one JSON array of
	// [id, attempts] pairs so any number fits in one statement. A record
	// that leaves the pending state sets the next record of its key free
	// (the schema's triggers).
	const refs = `(id, attempts) IN (SELECT value ->> 0, value ->> 1 FROM json_each(?1))`
	s.ackSQL = fmt.Sprintf(`UPDATE %s SET status = 'delivered', delivered_at = ?3, leased_by = NULL, leased_until = NULL
WHERE %s AND leased_by = ?2 AND status = 'pending'`, t, refs)
	s.relSQL = fmt.Sprintf(`UPDATE %s SET attempts = max(attempts - 1, 0), due_at = ?3, leased_by = NULL, leased_until = NULL,
    hold = %s
WHERE %s AND leased_by = ?2 AND status = 'pending'`, t, holdRule(t, "?3"), refs)
	s.nackSQL = fmt.Sprintf(`UPDATE %s SET last_error = ?3, due_at = ?4, leased_by = NULL, leased_until = NULL,
    hold = %s
WHERE id = ?1 AND attempts = :attempt AND leased_by = ?2 AND status = 'pending'`, t, holdRule(t, "?4"))
	s.extendSQL = fmt.Sprintf(`UPDATE %s SET leased_until = ?3
WHERE %s AND leased_by = ?2 AND leased_until > ?4 AND status = 'pending'
RETURNING id`, t, refs)
	// A dead record's due_at is when it was dead-lettered; with
	// HoldOnDeadLetter it holds its key (hold = 'key'), whatever storage
	// claims next.
	deadHold := `NULL`
	if s.hold {
		deadHold = `CASE WHEN "key" <> '' THEN 'key' END`
	}
	s.deadSQL = fmt.Sprintf(`UPDATE %s SET status = 'dead', last_error = ?3, due_at = ?4, leased_by = NULL, leased_until = NULL,
    hold = %s
WHERE id = ?1 AND attempts = :attempt AND leased_by = ?2 AND status = 'pending'`, t, deadHold)
	s.redriveSet = fmt.Sprintf(`UPDATE %s SET status = 'pending', attempts = 0, last_error = NULL, due_at = 0,
    leased_by = NULL, leased_until = NULL, hold = %s WHERE status = 'dead' AND `, t, holdRule(t, "0"))
}

// returned are the columns a claim returns.
const returned = `id, uuid, topic, "key", payload, metadata, attempts, created_at, last_error IS NOT NULL`

// Claim implements [storage.Storage]. It is one write transaction: put the
// records whose retry is due back in the walk, walk the records that are
// not set aside in id order, then take the records queued right behind the
// keys it took (see takeAlong); each claimed record is leased and its
// attempt counted.
//
// The forwarder calls it (the relay protocol); an application does not.
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
	var found, due bool
	err := s.db.QueryRowContext(ctx, s.probeSQL,
		params.WorkerID, nanos(now.Add(params.Lease)), nanos(now), nanos(now.Add(-s.visibilityDelay))).Scan(&found, &due)
	switch {
	case isBusy(err):
		// Only a database outside WAL mode, or in recovery, blocks a read:
		// claim as before, waiting for the lock.
		found, due = true, true
	case err != nil:
		return nil, fmt.Errorf("claim outbox records from %q: look for claimable records: %w", s.table, err)
	case !found && !due:
		return nil, nil
	}
	var records []storage.Record
	err = s.write(ctx, func(ctx context.Context) error {
		records = records[:0]
		now := s.now()
		tx, err := s.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		if due {
			if _, err := tx.ExecContext(ctx, s.dueSQL, sql.Named("now", nanos(now)), sql.Named("limit", params.BatchSize)); err != nil {
				return err
			}
		}
		leasedUntil := nanos(now.Add(params.Lease))
		rows, err := tx.QueryContext(ctx, s.claimSQL,
			params.WorkerID, leasedUntil, nanos(now), nanos(now.Add(-s.visibilityDelay)), params.BatchSize)
		if err != nil {
			return err
		}
		var failed, queued []bool
		records, failed, queued, err = scanRecords(rows, params.BatchSize, records)
		if err != nil {
			return err
		}
		if len(records) < params.BatchSize && slices.Contains(queued, true) {
			if records, err = s.takeAlong(ctx, tx, params, now, records, failed, queued); err != nil {
				return err
			}
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

// takeAlong fills the room the walk left in a claim with the records
// queued right behind the keys it took, in each key's id order, while they
// are claimable: a key's backlog waits set aside behind its first record
// (Insert puts it there), so the walk reads one record per key, and the
// claim then takes that key's next records without anyone setting them
// free first. The room is shared evenly among the keys, in the order the
// walk met them. A key whose last record taken failed before is left alone
// with HoldOnDeadLetter: that record is claimed without the rest of its
// key.
func (s *Storage) takeAlong(ctx context.Context, tx *sql.Tx, params storage.ClaimParams, now time.Time,
	records []storage.Record, failed, queued []bool) ([]storage.Record, error) {
	type key struct {
		name           string
		last           int64
		failed, queued bool
	}
	var keys []key
	index := map[string]int{}
	for i, r := range records {
		if r.Key == "" {
			continue
		}
		j, ok := index[r.Key]
		if !ok {
			j = len(keys)
			index[r.Key] = j
			keys = append(keys, key{name: r.Key})
		}
		if r.ID > keys[j].last {
			keys[j].last, keys[j].queued = r.ID, queued[i]
		}
		keys[j].failed = keys[j].failed || failed[i]
	}
	keys = slices.DeleteFunc(keys, func(k key) bool { return !k.queued || (s.hold && k.failed) })
	room := params.BatchSize - len(records)
	cutoff := nanos(now.Add(-s.visibilityDelay))
	var take []int64
	for i, k := range keys {
		share := (room - len(take) + len(keys) - i - 1) / (len(keys) - i)
		if share <= 0 {
			continue
		}
		queue, err := s.queue(ctx, tx, k.name, k.last, share)
		if err != nil {
			return nil, err
		}
		for _, q := range queue {
			claimable := (!q.hold.Valid || q.hold.String == "behind" || q.hold.String == "retry") &&
				q.due <= nanos(now) && q.leased <= nanos(now) && (s.visibilityDelay == 0 || q.created <= cutoff) &&
				!(s.hold && q.failed)
			if !claimable {
				break
			}
			take = append(take, q.id)
		}
	}
	if len(take) == 0 {
		return records, nil
	}
	rows, err := tx.QueryContext(ctx, s.alongSQL, params.WorkerID, nanos(now.Add(params.Lease)), idsJSON(take))
	if err != nil {
		return nil, err
	}
	records, _, _, err = scanRecords(rows, len(take), records)
	return records, err
}

// queued is a record queued behind a key's last claimed record.
type queued struct {
	id, due, leased, created int64
	hold                     sql.NullString
	failed                   bool
}

// queue reads up to n records queued behind record last of key.
func (s *Storage) queue(ctx context.Context, tx *sql.Tx, key string, last int64, n int) ([]queued, error) {
	rows, err := tx.QueryContext(ctx, s.queueSQL, key, last, n)
	if err != nil {
		return nil, err
	}
	defer func() { _ = rows.Close() }()
	var out []queued
	for rows.Next() {
		var q queued
		if err := rows.Scan(&q.id, &q.hold, &q.due, &q.leased, &q.created, &q.failed); err != nil {
			return nil, err
		}
		out = append(out, q)
	}
	return out, rows.Err()
}

// scanRecords appends the claimed records rows returns to records, and
// returns whether each failed before and has records queued behind it.
func scanRecords(rows *sql.Rows, capacity int, records []storage.Record) (_ []storage.Record, failed, queued []bool, _ error) {
	defer func() { _ = rows.Close() }()
	if records == nil {
		records = make([]storage.Record, 0, min(capacity, 1024))
	}
	for rows.Next() {
		var (
			r                    storage.Record
			metadata             sql.NullString
			created              int64
			failedBefore, behind bool
		)
		if err := rows.Scan(&r.ID, &r.UUID, &r.Topic, &r.Key, &r.Payload, &metadata, &r.Attempts, &created, &failedBefore, &behind); err != nil {
			return nil, nil, nil, err
		}
		r.CreatedAt = fromNanos(created)
		if metadata.Valid && metadata.String != "" {
			if err := json.Unmarshal([]byte(metadata.String), &r.Metadata); err != nil {
				r.Metadata = nil
				r.DecodeError = fmt.Errorf("decode metadata of outbox record %d: %w", r.ID, err)
			}
		}
		records = append(records, r)
		failed, queued = append(failed, failedBefore), append(queued, behind)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, nil, err
	}
	return records, failed, queued, rows.Close()
}

// Ack implements [storage.Storage].
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Ack(ctx context.Context, params storage.AckParams) error {
	if len(params.Records) == 0 || params.WorkerID == "" {
		return nil
	}
	if err := s.exec(ctx, s.ackSQL, refsJSON(params.Records), params.WorkerID, nanos(s.now())); err != nil {
		return fmt.Errorf("ack %d outbox records: %w", len(params.Records), err)
	}
	return nil
}

// Nack implements [storage.Storage].
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Nack(ctx context.Context, params storage.NackParams) error {
	if params.WorkerID == "" {
		return nil
	}
	if err := s.exec(ctx, s.nackSQL, params.Record.ID, params.WorkerID, params.Error, nanos(params.RetryAt),
		sql.Named("now", nanos(s.now())), sql.Named("attempt", params.Record.Attempt)); err != nil {
		return fmt.Errorf("nack outbox record %d: %w", params.Record.ID, err)
	}
	return nil
}

// Release implements [storage.Storage].
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Release(ctx context.Context, params storage.ReleaseParams) error {
	if len(params.Records) == 0 || params.WorkerID == "" {
		return nil
	}
	if err := s.exec(ctx, s.relSQL, refsJSON(params.Records), params.WorkerID, nanos(params.RetryAt),
		sql.Named("now", nanos(s.now()))); err != nil {
		return fmt.Errorf("release %d outbox records: %w", len(params.Records), err)
	}
	return nil
}

// DeadLetter implements [storage.Storage].
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) DeadLetter(ctx context.Context, params storage.DeadLetterParams) error {
	if params.WorkerID == "" {
		return nil
	}
	if err := s.exec(ctx, s.deadSQL, params.Record.ID, params.WorkerID, params.Error, nanos(s.now()),
		sql.Named("attempt", params.Record.Attempt)); err != nil {
		return fmt.Errorf("dead-letter outbox record %d: %w", params.Record.ID, err)
	}
	return nil
}

// Extend implements [storage.Storage].
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Extend(ctx context.Context, params storage.ExtendParams) ([]int64, error) {
	if params.Lease <= 0 {
		return nil, fmt.Errorf("extend outbox leases: Lease must be > 0, got %s", params.Lease)
	}
	if len(params.Records) == 0 || params.WorkerID == "" {
		return nil, nil
	}
	var extended []int64
	err := s.write(ctx, func(ctx context.Context) error {
		extended = extended[:0]
		now := s.now()
		rows, err := s.db.QueryContext(ctx, s.extendSQL, refsJSON(params.Records), params.WorkerID, nanos(now.Add(params.Lease)), nanos(now))
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
		return nil, fmt.Errorf("extend the lease of %d outbox records: %w", len(params.Records), err)
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

// refsJSON encodes refs as a JSON array of [id, attempts] pairs for
// json_each.
func refsJSON(refs []storage.ClaimRef) string {
	var b strings.Builder
	b.Grow(len(refs)*12 + 2)
	b.WriteByte('[')
	for i, r := range refs {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('[')
		b.WriteString(strconv.FormatInt(r.ID, 10))
		b.WriteByte(',')
		b.WriteString(strconv.Itoa(r.Attempt))
		b.WriteByte(']')
	}
	b.WriteByte(']')
	return b.String()
}
