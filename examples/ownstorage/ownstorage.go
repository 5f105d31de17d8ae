// Package ownstorage is a txoutbox storage over an outbox table that was
// there first: its own column names, its own status values, and a schema you
// are not allowed to change. It is an example to copy and adapt; it runs on
// database/sql (PostgreSQL through pgx's stdlib driver) and passes the
// storage contract suite (storage/storagetest) in this repository's tests.
//
// The table it serves (see [SchemaSQL]):
//
//	event_id     bigserial PRIMARY KEY      -- the record id (insertion order)
//	event_uuid   text                       -- the message UUID
//	channel      text                       -- the topic
//	aggregate_id text DEFAULT ''            -- the ordering key
//	body         bytea                      -- the payload
//	headers      jsonb DEFAULT '{}'         -- the metadata
//	state        text DEFAULT 'NEW'         -- NEW (pending), SENT (delivered), FAILED (dead)
//	tries        integer DEFAULT 0          -- attempts
//	not_before   timestamptz                -- due time, NULL for at once
//	locked_by    text                       -- lease owner
//	locked_until timestamptz                -- lease end
//	error_text   text                       -- the last error
//	created      timestamptz DEFAULT now()
//
// A storage needs, per record, an id that grows with insertion, a status, an
// attempts counter, a due time and a lease (owner and end). A table without
// lease or due columns needs them added, or a side table keyed by the id.
//
// Write-backs are fenced on the claim (storage.ClaimRef): each one applies
// only WHERE event_id = ? AND locked_by = ? AND tries = ?. With strict
// ordering a claim takes a transaction-scoped advisory lock, so that
// concurrent claimers see each other's leases, and skips every record behind
// an earlier NEW record of its key that is leased or waiting for its retry.
package ownstorage

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// Config configures a [Storage].
type Config struct {
	// Table is the outbox table's name, a plain lower-case identifier.
	// Defaults to "legacy_events".
	Table string
	// DisableStrictOrdering lets a record be claimed while an earlier record
	// of its key is leased or waiting for its retry.
	DisableStrictOrdering bool
}

// Storage is a storage.Storage and a storage.Inserter over the table.
type Storage struct {
	db     *sql.DB
	table  string
	strict bool
}

var (
	_ storage.Storage  = (*Storage)(nil)
	_ storage.Inserter = (*Storage)(nil)
)

var identifier = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// New returns a storage over config.Table in db, a PostgreSQL database opened
// with the "pgx" driver of github.com/jackc/pgx/v5/stdlib.
func New(db *sql.DB, config Config) (*Storage, error) {
	if config.Table == "" {
		config.Table = "legacy_events"
	}
	if !identifier.MatchString(config.Table) {
		return nil, fmt.Errorf("ownstorage: table %q: %w (want lower-case letters, digits and _)", config.Table, storage.ErrInvalidIdentifier)
	}
	return &Storage{db: db, table: config.Table, strict: !config.DisableStrictOrdering}, nil
}

// SchemaSQL is the table this storage serves, as it would have been created
// before txoutbox came along (for tests and for trying it out).
func (s *Storage) SchemaSQL() string {
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %[1]s (
	event_id     bigserial PRIMARY KEY,
	event_uuid   text NOT NULL,
	channel      text NOT NULL,
	aggregate_id text NOT NULL DEFAULT '',
	body         bytea NOT NULL,
	headers      jsonb NOT NULL DEFAULT '{}',
	state        text NOT NULL DEFAULT 'NEW' CHECK (state IN ('NEW', 'SENT', 'FAILED')),
	tries        integer NOT NULL DEFAULT 0,
	not_before   timestamptz,
	locked_by    text,
	locked_until timestamptz,
	error_text   text,
	created      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS %[1]s_new ON %[1]s (event_id) WHERE state = 'NEW';
CREATE INDEX IF NOT EXISTS %[1]s_new_key ON %[1]s (aggregate_id, event_id) WHERE state = 'NEW'`, s.table)
}

// Insert writes records through tx, a *sql.Tx, in one statement: the
// transactional publisher calls it. It returns nothing; [Storage.InsertIDs]
// also returns the ids.
func (s *Storage) Insert(ctx context.Context, tx any, records []storage.Record) error {
	_, err := s.InsertIDs(ctx, tx, records)
	return err
}

// InsertIDs is Insert, returning the new records' ids in the order given.
func (s *Storage) InsertIDs(ctx context.Context, tx any, records []storage.Record) ([]int64, error) {
	sqlTx, ok := tx.(*sql.Tx)
	if !ok {
		return nil, fmt.Errorf("ownstorage: insert: %w: %T, want *sql.Tx", storage.ErrUnsupportedTx, tx)
	}
	uuids, topics, keys, headers := make([]string, len(records)), make([]string, len(records)), make([]string, len(records)), make([]string, len(records))
	bodies := make([][]byte, len(records))
	for i, r := range records {
		h, err := json.Marshal(r.Metadata)
		if err != nil {
			return nil, fmt.Errorf("ownstorage: insert: metadata of %s: %w", r.UUID, err)
		}
		if r.Metadata == nil {
			h = []byte("{}")
		}
		uuids[i], topics[i], keys[i], headers[i], bodies[i] = r.UUID, r.Topic, r.Key, string(h), r.Payload
		if bodies[i] == nil {
			bodies[i] = []byte{}
		}
	}
	rows, err := sqlTx.QueryContext(ctx, fmt.Sprintf(`INSERT INTO %s (event_uuid, channel, aggregate_id, body, headers)
		SELECT u, c, k, b, h::jsonb FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[])
			WITH ORDINALITY AS r(u, c, k, b, h, n) ORDER BY n
		RETURNING event_id`, s.table), uuids, topics, keys, bodies, headers)
	if err != nil {
		return nil, fmt.Errorf("ownstorage: insert: %w", err)
	}
	defer rows.Close()
	ids, err := scanIDs(rows)
	if err != nil {
		return nil, fmt.Errorf("ownstorage: insert: %w", err)
	}
	slices.Sort(ids) // ids are taken in the order of the rows inserted
	return ids, nil
}

// Claim leases up to params.BatchSize due NEW records to params.WorkerID, in
// id order, and counts an attempt on each.
func (s *Storage) Claim(ctx context.Context, params storage.ClaimParams) ([]storage.Record, error) {
	if params.BatchSize <= 0 || params.Lease <= 0 || params.WorkerID == "" {
		return nil, fmt.Errorf("ownstorage: claim: batch size %d and lease %v must be > 0 and the worker id set", params.BatchSize, params.Lease)
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("ownstorage: claim: %w", err)
	}
	defer tx.Rollback()
	heldBack := "" // strict ordering: not behind an earlier NEW record of the key that is not claimable now
	if s.strict {
		if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(hashtext($1))`, "ownstorage:"+s.table); err != nil {
			return nil, fmt.Errorf("ownstorage: claim: %w", err)
		}
		heldBack = fmt.Sprintf(`AND (c.aggregate_id = '' OR NOT EXISTS (SELECT 1 FROM %s e
			WHERE e.state = 'NEW' AND e.aggregate_id = c.aggregate_id AND e.event_id < c.event_id
			AND (e.not_before > now.t OR e.locked_until > now.t)))`, s.table)
	}
	// clock_timestamp(), read after the lock: now() is the start of a
	// transaction that may have waited for it.
	rows, err := tx.QueryContext(ctx, fmt.Sprintf(`WITH now AS (SELECT clock_timestamp() AS t)
		UPDATE %[1]s o SET tries = o.tries + 1, locked_by = $1, locked_until = now.t + $2 * interval '1 microsecond'
		FROM now
		WHERE o.event_id IN (SELECT c.event_id FROM %[1]s c, now
			WHERE c.state = 'NEW' AND (c.not_before IS NULL OR c.not_before <= now.t)
			AND (c.locked_until IS NULL OR c.locked_until <= now.t) %[2]s
			ORDER BY c.event_id LIMIT $3 FOR UPDATE OF c SKIP LOCKED)
		RETURNING o.event_id, o.event_uuid, o.channel, o.aggregate_id, o.body, o.headers::text, o.tries, o.created`, s.table, heldBack),
		params.WorkerID, params.Lease.Microseconds(), params.BatchSize)
	if err != nil {
		return nil, fmt.Errorf("ownstorage: claim: %w", err)
	}
	defer rows.Close()
	var records []storage.Record
	for rows.Next() {
		var r storage.Record
		var headers string
		if err := rows.Scan(&r.ID, &r.UUID, &r.Topic, &r.Key, &r.Payload, &headers, &r.Attempts, &r.CreatedAt); err != nil {
			return nil, fmt.Errorf("ownstorage: claim: %w", err)
		}
		if err := json.Unmarshal([]byte(headers), &r.Metadata); err != nil {
			r.DecodeError = fmt.Errorf("headers of event %d: %w", r.ID, err) // the forwarder dead-letters it
		}
		records = append(records, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("ownstorage: claim: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("ownstorage: claim: %w", err)
	}
	slices.SortFunc(records, func(a, b storage.Record) int { return cmp.Compare(a.ID, b.ID) })
	return records, nil
}

// fenced is the write-backs' condition: the records named by the claim refs
// in $1 (ids) and $2 (attempts), still leased to the worker in $3 by that
// claim. The rows are locked in id order, as Claim locks them.
func (s *Storage) fenced() string {
	return fmt.Sprintf(`o.event_id IN (SELECT c.event_id FROM %s c JOIN unnest($1::bigint[], $2::bigint[]) AS r(id, attempt)
		ON c.event_id = r.id AND c.tries = r.attempt
		WHERE c.state = 'NEW' AND c.locked_by = $3 ORDER BY c.event_id FOR UPDATE OF c)`, s.table)
}

// writeBack runs UPDATE table o SET set WHERE fenced, with the claim refs as
// $1 and $2, the worker as $3 and args from $4 on.
func (s *Storage) writeBack(ctx context.Context, what, set string, refs []storage.ClaimRef, worker string, args ...any) error {
	if len(refs) == 0 {
		return nil
	}
	ids, attempts := splitRefs(refs)
	query := fmt.Sprintf(`UPDATE %s o SET %s, locked_by = NULL, locked_until = NULL WHERE %s`, s.table, set, s.fenced())
	if _, err := s.db.ExecContext(ctx, query, append([]any{ids, attempts, worker}, args...)...); err != nil {
		return fmt.Errorf("ownstorage: %s: %w", what, err)
	}
	return nil
}

// Ack marks the records SENT.
func (s *Storage) Ack(ctx context.Context, params storage.AckParams) error {
	return s.writeBack(ctx, "ack", `state = 'SENT'`, params.Records, params.WorkerID)
}

// Nack records the error and makes the record due again at params.RetryAt.
func (s *Storage) Nack(ctx context.Context, params storage.NackParams) error {
	return s.writeBack(ctx, "nack", `error_text = $4, not_before = $5`,
		[]storage.ClaimRef{params.Record}, params.WorkerID, params.Error, dueAt(params.RetryAt))
}

// Release gives back records never tried: one attempt fewer, no error, due
// again at params.RetryAt.
func (s *Storage) Release(ctx context.Context, params storage.ReleaseParams) error {
	return s.writeBack(ctx, "release", `tries = greatest(o.tries - 1, 0), not_before = $4`,
		params.Records, params.WorkerID, dueAt(params.RetryAt))
}

// DeadLetter marks the record FAILED with the error.
func (s *Storage) DeadLetter(ctx context.Context, params storage.DeadLetterParams) error {
	return s.writeBack(ctx, "dead-letter", `state = 'FAILED', error_text = $4`,
		[]storage.ClaimRef{params.Record}, params.WorkerID, params.Error)
}

// Extend pushes to now+params.Lease the leases that the worker still holds
// by the named claims and that have not run out, and returns their ids.
func (s *Storage) Extend(ctx context.Context, params storage.ExtendParams) ([]int64, error) {
	if params.Lease <= 0 {
		return nil, fmt.Errorf("ownstorage: extend: lease %v must be > 0", params.Lease)
	}
	if len(params.Records) == 0 {
		return nil, nil
	}
	ids, attempts := splitRefs(params.Records)
	rows, err := s.db.QueryContext(ctx, fmt.Sprintf(`UPDATE %s o SET locked_until = clock_timestamp() + $4 * interval '1 microsecond'
		WHERE %s AND o.locked_until > clock_timestamp() RETURNING o.event_id`, s.table, s.fenced()),
		ids, attempts, params.WorkerID, params.Lease.Microseconds())
	if err != nil {
		return nil, fmt.Errorf("ownstorage: extend: %w", err)
	}
	defer rows.Close()
	extended, err := scanIDs(rows)
	if err != nil {
		return nil, fmt.Errorf("ownstorage: extend: %w", err)
	}
	return extended, nil
}

func splitRefs(refs []storage.ClaimRef) (ids, attempts []int64) {
	for _, r := range refs {
		ids = append(ids, r.ID)
		attempts = append(attempts, int64(r.Attempt))
	}
	return ids, attempts
}

// dueAt is NULL (due at once) for the zero time.
func dueAt(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

func scanIDs(rows *sql.Rows) ([]int64, error) {
	var ids []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		ids = append(ids, id)
	}
	return ids, rows.Err()
}
