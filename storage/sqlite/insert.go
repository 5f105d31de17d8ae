package sqlite

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/txoutbox/txoutbox/storage"
)

// insertChunk is the most records one INSERT statement carries: 8 bound
// values each stays far below SQLite's default limit of 32766 host
// parameters.
const insertChunk = 1000

// Insert implements [storage.Inserter]: it writes records through tx, which
// must be a *sql.Tx on the same database. Every record is validated before
// anything is written; the first record goes in an INSERT of its own, the
// others up to 1000 in one multi-row INSERT.
func (s *Storage) Insert(ctx context.Context, tx any, records []storage.Record) error {
	sqlTx, ok := tx.(*sql.Tx)
	if !ok || sqlTx == nil {
		return fmt.Errorf("insert outbox records: %w: %T (want *sql.Tx)", storage.ErrUnsupportedTx, tx)
	}
	if len(records) == 0 {
		return nil
	}
	metadata := make([]any, len(records))
	dues := make([]int64, len(records))
	now := s.now()
	for i, r := range records {
		m, err := validateRecord(r)
		if err != nil {
			return fmt.Errorf("insert outbox records: record %d: %w", i, err)
		}
		metadata[i] = m
		if r.DueAt.After(now) {
			dues[i] = nanos(r.DueAt)
		}
	}
	// created_at never decreases in id order, even when the clock steps
	// back or a producer that read it first gets the write lock second, so
	// VisibilityDelay never shows a record while an earlier one is hidden:
	// the first record takes the later of the clock and the newest record's
	// created_at, read by its INSERT under the write lock, and the others,
	// inserted under the same lock, take the same.
	created := nanos(now)
	if err := sqlTx.QueryRowContext(ctx, s.insertFirstSQL(records[0]), s.insertFirstArgs(created, records[0], metadata[0], dues[0])...).Scan(&created); err != nil {
		return fmt.Errorf("insert %d outbox records into %q: %w", len(records), s.table, err)
	}
	if len(records) == 1 {
		return nil
	}
	// A keyed record waits behind an earlier pending record of its key (see
	// insertFirstSQL); the first INSERT took the write lock, so what this
	// reads holds until the commit.
	holds, err := s.insertHolds(ctx, sqlTx, records)
	if err != nil {
		return fmt.Errorf("insert %d outbox records into %q: %w", len(records), s.table, err)
	}
	for i := range holds {
		if holds[i] == nil && dues[i] != 0 {
			holds[i] = "retry"
		}
	}
	for start := 1; start < len(records); start += insertChunk {
		end := min(start+insertChunk, len(records))
		query, args := s.insertSQL(created, records[start:end], metadata[start:end], holds[start:end], dues[start:end])
		if _, err := sqlTx.ExecContext(ctx, query, args...); err != nil {
			return fmt.Errorf("insert %d outbox records into %q: %w", len(records), s.table, err)
		}
	}
	return nil
}

// insertFirstSQL inserts one record, with created_at the later of the
// clock and the newest record's, and, with strict ordering, a keyed record
// set aside (hold 'behind') when an earlier record of its key is pending or
// dead and holding the key: claims then never read it until that one is
// gone (see the schema's triggers). A delayed record (due_at ?7, 0 when due
// at once) that is not set aside so waits for its time like a retry
// (hold 'retry'), out of the claims' walk.
func (s *Storage) insertFirstSQL(r storage.Record) string {
	t := quote(s.table)
	hold := "CASE WHEN ?7 > 0 THEN 'retry' END"
	if r.Key != "" && s.strict {
		hold = fmt.Sprintf(`CASE WHEN EXISTS (SELECT 1 FROM %[1]s WHERE status = 'pending' AND "key" <> '' AND "key" = ?4)
    OR EXISTS (SELECT 1 FROM %[1]s WHERE status = 'dead' AND "key" <> '' AND "key" = ?4 AND hold = 'key') THEN 'behind'
    WHEN ?7 > 0 THEN 'retry' END`, t)
	}
	return fmt.Sprintf(`INSERT INTO %[1]s (created_at, uuid, topic, "key", payload, metadata, due_at, hold)
VALUES (max(?1, ifnull((SELECT created_at FROM %[1]s ORDER BY id DESC LIMIT 1), 0)), ?2, ?3, ?4, ?5, ?6, ?7, %[2]s)
RETURNING created_at`, t, hold)
}

func (s *Storage) insertFirstArgs(created int64, r storage.Record, metadata any, due int64) []any {
	return []any{created, r.UUID, r.Topic, r.Key, payloadOf(r), metadata, due}
}

// insertHolds returns the hold of each record but the first: with strict
// ordering, 'behind' for a keyed record whose key has an earlier record
// here, or a pending record, or a dead one that holds it, in the table.
func (s *Storage) insertHolds(ctx context.Context, tx *sql.Tx, records []storage.Record) ([]any, error) {
	holds := make([]any, len(records))
	if !s.strict {
		return holds, nil
	}
	seen := map[string]bool{records[0].Key: true}
	var keys []string
	for _, r := range records[1:] {
		if r.Key != "" && !seen[r.Key] {
			seen[r.Key] = true
			keys = append(keys, r.Key)
		}
	}
	held := map[string]bool{}
	if len(keys) > 0 {
		list, err := json.Marshal(keys)
		if err != nil {
			return nil, err
		}
		t := quote(s.table)
		rows, err := tx.QueryContext(ctx, fmt.Sprintf(`SELECT k.value FROM json_each(?1) AS k
WHERE EXISTS (SELECT 1 FROM %[1]s WHERE status = 'pending' AND "key" <> '' AND "key" = k.value)
   OR EXISTS (SELECT 1 FROM %[1]s WHERE status = 'dead' AND "key" <> '' AND "key" = k.value AND hold = 'key')`, t), string(list))
		if err != nil {
			return nil, err
		}
		defer func() { _ = rows.Close() }()
		for rows.Next() {
			var k string
			if err := rows.Scan(&k); err != nil {
				return nil, err
			}
			held[k] = true
		}
		if err := rows.Err(); err != nil {
			return nil, err
		}
	}
	first := map[string]bool{records[0].Key: true}
	for i, r := range records {
		if i == 0 || r.Key == "" {
			continue
		}
		if first[r.Key] || held[r.Key] {
			holds[i] = "behind"
		}
		first[r.Key] = true
	}
	return holds, nil
}

// insertSQL is one multi-row INSERT.
func (s *Storage) insertSQL(created int64, records []storage.Record, metadata, holds []any, dues []int64) (string, []any) {
	// Anonymous ? parameters: the driver looks up the name of every numbered
	// one (?NNN) with a linear scan, which makes a large insert quadratic.
	const row = "(?,?,?,?,?,?,?,?)"
	var b strings.Builder
	b.Grow(96 + len(records)*(len(row)+1))
	b.WriteString("INSERT INTO ")
	b.WriteString(quote(s.table))
	b.WriteString(` (created_at, uuid, topic, "key", payload, metadata, due_at, hold) VALUES `)
	args := make([]any, 0, 8*len(records))
	for i, r := range records {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(row)
		args = append(args, created, r.UUID, r.Topic, r.Key, payloadOf(r), metadata[i], dues[i], holds[i])
	}
	return b.String(), args
}

// payloadOf is the record's payload as the NOT NULL column takes it: a nil
// []byte binds as NULL.
func payloadOf(r storage.Record) []byte {
	if r.Payload == nil {
		return []byte{}
	}
	return r.Payload
}

// validateRecord checks what the table cannot hold and returns the metadata
// column value: JSON text, or nil for no metadata.
func validateRecord(r storage.Record) (any, error) {
	switch {
	case r.Topic == "":
		return nil, fmt.Errorf("%w: empty topic", storage.ErrInvalidRecord)
	case !utf8.ValidString(r.Topic):
		return nil, fmt.Errorf("%w: topic is not valid UTF-8", storage.ErrInvalidRecord)
	case !utf8.ValidString(r.UUID):
		return nil, fmt.Errorf("%w: uuid is not valid UTF-8", storage.ErrInvalidRecord)
	case !utf8.ValidString(r.Key):
		return nil, fmt.Errorf("%w: key is not valid UTF-8", storage.ErrInvalidRecord)
	}
	if len(r.Metadata) == 0 {
		return nil, nil
	}
	for k, v := range r.Metadata {
		// encoding/json would silently replace invalid UTF-8 with U+FFFD.
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return nil, fmt.Errorf("%w: metadata %q is not valid UTF-8", storage.ErrInvalidRecord, k)
		}
	}
	b, err := json.Marshal(r.Metadata)
	if err != nil {
		return nil, fmt.Errorf("%w: encode metadata: %w", storage.ErrInvalidRecord, err)
	}
	return string(b), nil
}
