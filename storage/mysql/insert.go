package mysql

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/txoutbox/txoutbox/storage"
)

// maxTextLen is the length, in characters, of the uuid, topic and key
// columns (VARCHAR(255)): longer values would be refused or, outside strict
// SQL mode, silently cut.
const maxTextLen = 255

// Payloads of at least paramPayloadBytes are sent as bound parameters
// (the driver then prepares the statement, and sends a payload larger than
// its own packet limit as long data), smaller ones as hexadecimal literals
// in the statement's text, which goes in one round trip.
const paramPayloadBytes = 64 << 10

// Statements of an Insert are kept within the server's max_allowed_packet,
// looked up in the producer's transaction once the records' statement
// would exceed smallStatementBytes (at least 1 MiB on any server set up
// for real use; the default is 16 MiB on MariaDB, 64 MiB on MySQL 8).
const smallStatementBytes = 1 << 20

// maxStatementBytes bounds a statement of several records, below the
// driver's own packet limit (64 MiB unless the DSN sets maxAllowedPacket):
// a record larger than that goes alone in its statement.
const maxStatementBytes = 16 << 20

// packetMargin is kept free in a packet for the protocol's headers.
const packetMargin = 1 << 10

// maxStatementParams bounds the payloads bound to one statement (the
// server allows 65535 placeholders).
const maxStatementParams = 10000

// Insert implements [storage.Inserter]: it writes records through tx, a
// *sql.Tx on the same database, in one multi-row INSERT, more when the
// records do not fit in one packet of the server (max_allowed_packet).
// Every record is checked first; one invalid record fails the call with an
// error wrapping [storage.ErrInvalidRecord] and nothing is written. A
// record that cannot fit in a packet alone (its payload close to
// max_allowed_packet) is refused the same way, before anything is sent, so
// that the producer's transaction and connection stay usable: raise
// max_allowed_packet (a server variable) for larger payloads.
func (s *Storage) Insert(ctx context.Context, tx any, records []storage.Record) error {
	sqlTx, ok := tx.(*sql.Tx)
	if !ok || sqlTx == nil {
		return fmt.Errorf("insert outbox rows: %w: %T (want *sql.Tx)", storage.ErrUnsupportedTx, tx)
	}
	if len(records) == 0 {
		return nil
	}
	metadata := make([]string, len(records))
	sizes := make([]int, len(records))
	total := 0
	for i, r := range records {
		m, err := checkRecord(r)
		if err != nil {
			return fmt.Errorf("insert outbox rows: record %d (uuid %q): %w", i, r.UUID, err)
		}
		metadata[i] = m
		sizes[i] = recordBytes(r, m)
		total += sizes[i]
	}
	head := "INSERT INTO " + s.table + " (uuid, topic, `key`, payload, metadata, created_at, due_at) VALUES "
	budget := math.MaxInt
	if total+len(head) > smallStatementBytes {
		var packet int
		if err := sqlTx.QueryRowContext(ctx, "SELECT @@max_allowed_packet").Scan(&packet); err != nil {
			return fmt.Errorf("insert outbox rows into %s: read max_allowed_packet: %w", s.table, err)
		}
		budget = packet - packetMargin - len(head)
		for i, r := range records {
			if sizes[i] > budget {
				return fmt.Errorf("insert outbox rows: record %d (uuid %q): %w: with its payload of %d bytes it takes %d bytes, more than fit in the server's max_allowed_packet (%d bytes)",
					i, r.UUID, storage.ErrInvalidRecord, len(r.Payload), sizes[i]+len(head)+packetMargin, packet)
			}
		}
	}
	if err := s.lockKeys(ctx, sqlTx, records); err != nil {
		return err
	}
	split := min(budget, maxStatementBytes)
	due := plusMicros("UTC_TIMESTAMP(6)", s.config.VisibilityDelay)
	now := time.Now()
	var b strings.Builder
	var args []any
	n, size := 0, 0
	flush := func() error {
		if n == 0 {
			return nil
		}
		if _, err := sqlTx.ExecContext(ctx, b.String(), args...); err != nil {
			return fmt.Errorf("insert %d outbox rows into %s: %w", n, s.table, err)
		}
		b.Reset()
		args = args[:0]
		n, size = 0, 0
		return nil
	}
	for i, r := range records {
		if n > 0 && (size+sizes[i] > split || len(args) == maxStatementParams) {
			if err := flush(); err != nil {
				return err
			}
		}
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
		if len(r.Payload) >= paramPayloadBytes {
			b.WriteByte('?')
			args = append(args, r.Payload)
		} else {
			bytesLit(&b, r.Payload)
		}
		b.WriteByte(',')
		if r.Metadata == nil {
			b.WriteString("NULL")
		} else {
			strLit(&b, metadata[i])
		}
		b.WriteString(",UTC_TIMESTAMP(6),")
		if r.DueAt.After(now) {
			// A delayed record: the claim's walk (by due time) reaches it
			// at its time, and strict ordering holds its key's later
			// records behind it until then.
			b.WriteString("GREATEST(" + timeLit(r.DueAt) + "," + due + ")")
		} else {
			b.WriteString(due)
		}
		b.WriteByte(')')
		n++
		size += sizes[i]
	}
	return flush()
}

// recordBytes bounds the bytes a record takes in a statement as the server
// receives it: its text as hexadecimal literals, and its payload as a
// literal or, bound, as the driver sends it (in a prepared statement's
// packet, or escaped into the text with the DSN's interpolateParams).
func recordBytes(r storage.Record, metadata string) int {
	n := 200 // the row's SQL around its values
	for _, v := range [...]string{r.UUID, r.Topic, r.Key, metadata} {
		n += 40 + 2*len(v)
	}
	if len(r.Payload) < paramPayloadBytes {
		return n + 2*len(r.Payload)
	}
	n += len(r.Payload) + 16
	for _, c := range r.Payload {
		switch c {
		case 0, '\n', '\r', '\\', '\'', '"', 0x1a: // escaped by interpolateParams
			n++
		}
	}
	return n
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
	if r.DueAt.Year() > 9999 {
		return "", fmt.Errorf("%w: due time %s is past the DATETIME range (year 9999)", storage.ErrInvalidRecord, r.DueAt.UTC().Format(time.RFC3339))
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

// keyLocksPerStatement bounds the keys one statement of lockKeys locks.
const keyLocksPerStatement = 1000

// lockKeys takes the key locks of records in the producer's transaction
// (see [Config.DisableKeyLocks]): one row of [Storage.KeyTable] per key,
// inserted or updated, in key order, so that one call never deadlocks
// another.
func (s *Storage) lockKeys(ctx context.Context, tx *sql.Tx, records []storage.Record) error {
	if s.config.DisableKeyLocks || s.config.DisableStrictOrdering {
		return nil
	}
	keys := make([]string, 0, len(records))
	for _, r := range records {
		if r.Key != "" {
			keys = append(keys, r.Key)
		}
	}
	slices.Sort(keys)
	keys = slices.Compact(keys)
	for len(keys) > 0 {
		n := min(len(keys), keyLocksPerStatement)
		var b strings.Builder
		b.WriteString("INSERT INTO " + s.KeyTable() + " (`key`, seq) VALUES ")
		for i, k := range keys[:n] {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteByte('(')
			strLit(&b, k)
			b.WriteString(",1)")
		}
		b.WriteString(" ON DUPLICATE KEY UPDATE seq = seq + 1")
		if _, err := tx.ExecContext(ctx, b.String()); err != nil {
			if isNoSuchTable(err) {
				return fmt.Errorf("insert outbox rows: lock their keys in %s: %w (the schema is older than this code: run Migrate)", s.KeyTable(), err)
			}
			return fmt.Errorf("insert outbox rows: lock their keys in %s: %w", s.KeyTable(), err)
		}
		keys = keys[n:]
	}
	return nil
}
