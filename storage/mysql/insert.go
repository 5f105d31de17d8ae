package mysql

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/txoutbox/txoutbox/storage"
)

// maxTextLen is the length, in characters, of the uuid, topic and key
// columns (VARCHAR(255)): longer values would be refused or, outside strict
// SQL mode, silently cut.
const maxTextLen = 255

// insertStatementBytes is the size at which Insert starts a new INSERT
// statement, well below the default max_allowed_packet (16 MiB on MariaDB,
// 64 MiB on MySQL 8).
const insertStatementBytes = 4 << 20

// Insert implements [storage.Inserter]: it writes records through tx, a
// *sql.Tx on the same database, in one multi-row INSERT (more only past 4 MiB
// of statement text). Every record is checked first; one invalid record fails
// the call with an error wrapping [storage.ErrInvalidRecord] and nothing is
// written.
func (s *Storage) Insert(ctx context.Context, tx any, records []storage.Record) error {
	sqlTx, ok := tx.(*sql.Tx)
	if !ok || sqlTx == nil {
		return fmt.Errorf("insert outbox rows: %w: %T (want *sql.Tx)", storage.ErrUnsupportedTx, tx)
	}
	if len(records) == 0 {
		return nil
	}
	metadata := make([]string, len(records))
	for i, r := range records {
		m, err := checkRecord(r)
		if err != nil {
			return fmt.Errorf("insert outbox rows: record %d (uuid %q): %w", i, r.UUID, err)
		}
		metadata[i] = m
	}
	head := "INSERT INTO " + s.table + " (uuid, topic, `key`, payload, metadata, created_at, due_at) VALUES "
	due := plusMicros("UTC_TIMESTAMP(6)", s.config.VisibilityDelay)
	var b strings.Builder
	n := 0
	flush := func() error {
		if n == 0 {
			return nil
		}
		if _, err := sqlTx.ExecContext(ctx, b.String()); err != nil {
			return fmt.Errorf("insert %d outbox rows into %s: %w", n, s.table, err)
		}
		b.Reset()
		n = 0
		return nil
	}
	for i, r := range records {
		if n == 0 {
			b.WriteString(head)
		} else {
			b.WriteByte(',')
		}
		b.WriteByte('(')
		strLit(&b, r.UUID)
		b.WriteByte(',')
		strLit(&b, r.Topic)
		b.WriteByte(',')
		strLit(&b, r.Key)
		b.WriteByte(',')
		bytesLit(&b, r.Payload)
		b.WriteByte(',')
		if r.Metadata == nil {
			b.WriteString("NULL")
		} else {
			strLit(&b, metadata[i])
		}
		b.WriteString(",UTC_TIMESTAMP(6),")
		b.WriteString(due)
		b.WriteByte(')')
		n++
		if b.Len() >= insertStatementBytes {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	return flush()
}

// checkRecord refuses what the table cannot hold as given (invalid UTF-8,
// text longer than its column) or what could never be published (empty
// topic), and returns the metadata as JSON.
func checkRecord(r storage.Record) (string, error) {
	if r.Topic == "" {
		return "", fmt.Errorf("%w: empty topic", storage.ErrInvalidRecord)
	}
	for _, f := range [...]struct{ name, v string }{{"uuid", r.UUID}, {"topic", r.Topic}, {"key", r.Key}} {
		if !utf8.ValidString(f.v) {
			return "", fmt.Errorf("%w: %s is not valid UTF-8", storage.ErrInvalidRecord, f.name)
		}
		if n := utf8.RuneCountInString(f.v); n > maxTextLen {
			return "", fmt.Errorf("%w: %s is %d characters, at most %d fit", storage.ErrInvalidRecord, f.name, n, maxTextLen)
		}
	}
	if strings.HasSuffix(r.Key, " ") {
		return "", fmt.Errorf("%w: key %q ends in a space: MySQL and MariaDB compare text ignoring trailing spaces (PAD SPACE), so it would share the order of key %q",
			storage.ErrInvalidRecord, r.Key, strings.TrimRight(r.Key, " "))
	}
	if r.Metadata == nil {
		return "", nil
	}
	for k, v := range r.Metadata {
		// encoding/json would silently replace invalid UTF-8 with U+FFFD.
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return "", fmt.Errorf("%w: metadata %q is not valid UTF-8", storage.ErrInvalidRecord, k)
		}
	}
	b, err := json.Marshal(r.Metadata)
	if err != nil {
		return "", fmt.Errorf("%w: metadata: %w", storage.ErrInvalidRecord, err)
	}
	return string(b), nil
}
