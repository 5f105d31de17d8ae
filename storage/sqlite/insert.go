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

// insertChunk is the most records one INSERT statement carries: 6 bound
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
	for i, r := range records {
		m, err := validateRecord(r)
		if err != nil {
			return fmt.Errorf("insert outbox records: record %d: %w", i, err)
		}
		metadata[i] = m
	}
	// A keyed record waits behind an earlier pending record of its key, so
	// that claims never read it until that one is delivered: the first
	// record of each key here asks the table (insertHold), the others are
	// behind it.
	first := make([]bool, len(records))
	if s.insertHold != "" {
		seen := make(map[string]bool)
		for i, r := range records {
			if r.Key != "" && !seen[r.Key] {
				seen[r.Key], first[i] = true, true
			}
		}
	}
	// created_at never decreases in id order, even when the clock steps
	// back or a producer that read it first gets the write lock second, so
	// VisibilityDelay never shows a record while an earlier one is hidden:
	// the first record takes the later of the clock and the newest record's
	// created_at, read by its INSERT under the write lock, and the others,
	// inserted under the same lock, take the same.
	created := nanos(s.now())
	query, args := s.insertSQL(true, created, records[:1], metadata[:1], first[:1])
	if err := sqlTx.QueryRowContext(ctx, query+" RETURNING created_at", args...).Scan(&created); err != nil {
		return fmt.Errorf("insert %d outbox records into %q: %w", len(records), s.table, err)
	}
	for start := 1; start < len(records); start += insertChunk {
		end := min(start+insertChunk, len(records))
		query, args := s.insertSQL(false, created, records[start:end], metadata[start:end], first[start:end])
		if _, err := sqlTx.ExecContext(ctx, query, args...); err != nil {
			return fmt.Errorf("insert %d outbox records into %q: %w", len(records), s.table, err)
		}
	}
	return nil
}

// insertSQL is one multi-row INSERT. With newest, created_at is the later
// of created and the newest record's.
func (s *Storage) insertSQL(newest bool, created int64, records []storage.Record, metadata []any, first []bool) (string, []any) {
	// Anonymous ? parameters: the driver looks up the name of every numbered
	// one (?NNN) with a linear scan, which makes a large insert quadratic.
	t := quote(s.table)
	var b strings.Builder
	b.Grow(96 + len(records)*24)
	b.WriteString("INSERT INTO ")
	b.WriteString(t)
	b.WriteString(` (created_at, uuid, topic, "key", payload, metadata, hold) VALUES `)
	args := make([]any, 0, 8*len(records))
	for i, r := range records {
		if i > 0 {
			b.WriteByte(',')
		}
		if newest {
			b.WriteString(`(max(?, ifnull((SELECT created_at FROM ` + t + ` ORDER BY id DESC LIMIT 1), 0)),?,?,?,?,?,`)
		} else {
			b.WriteString("(?,?,?,?,?,?,")
		}
		payload := r.Payload
		if payload == nil {
			payload = []byte{} // NOT NULL; a nil []byte binds as NULL
		}
		args = append(args, created, r.UUID, r.Topic, r.Key, payload, metadata[i])
		switch {
		case r.Key == "" || s.insertHold == "":
			b.WriteString("NULL")
		case first[i]:
			b.WriteString(s.insertHold)
			args = append(args, r.Key, r.Key)
		default:
			b.WriteString("'behind'")
		}
		b.WriteByte(')')
	}
	return b.String(), args
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
