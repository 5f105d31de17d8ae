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
// anything is written; up to 1000 records go in one multi-row INSERT.
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
	created := nanos(s.now())
	for start := 0; start < len(records); start += insertChunk {
		end := min(start+insertChunk, len(records))
		query, args := s.insertSQL(created, records[start:end], metadata[start:end])
		if _, err := sqlTx.ExecContext(ctx, query, args...); err != nil {
			return fmt.Errorf("insert %d outbox records into %q: %w", end-start, s.table, err)
		}
	}
	return nil
}

func (s *Storage) insertSQL(created int64, records []storage.Record, metadata []any) (string, []any) {
	// Anonymous ? parameters: the driver looks up the name of every numbered
	// one (?NNN) with a linear scan, which makes a large insert quadratic.
	const row = "(?,?,?,?,?,?)"
	var b strings.Builder
	b.Grow(96 + len(records)*(len(row)+1))
	b.WriteString("INSERT INTO ")
	b.WriteString(quote(s.table))
	b.WriteString(` (created_at, uuid, topic, "key", payload, metadata) VALUES `)
	args := make([]any, 0, 6*len(records))
	for i, r := range records {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(row)
		payload := r.Payload
		if payload == nil {
			payload = []byte{} // NOT NULL; a nil []byte binds as NULL
		}
		args = append(args, created, r.UUID, r.Topic, r.Key, payload, metadata[i])
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
