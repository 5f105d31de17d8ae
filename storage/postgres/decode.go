package postgres

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/txoutbox/txoutbox/storage"
)

// claimColumns are the claim's result columns, in order, with the format pgx
// asks the server for when it prepares the statement (its default exec mode):
// binary for numbers, times and bytea, text for text and jsonb.
var claimColumns = [...]struct {
	oid    uint32
	binary bool
	either bool // text and binary are the same bytes (text)
}{
	{pgtype.Int8OID, true, false},        // id
	{pgtype.TextOID, false, true},        // uuid
	{pgtype.TextOID, false, true},        // topic
	{pgtype.TextOID, false, true},        // key
	{pgtype.ByteaOID, true, false},       // payload
	{pgtype.JSONBOID, false, false},      // metadata
	{pgtype.Int4OID, true, false},        // attempts
	{pgtype.TimestamptzOID, true, false}, // created_at
	{pgtype.BoolOID, true, false},        // drained (the same in every row)
}

// rawDecodable reports whether the claim's rows come in the formats
// decodeRaw reads. They do with pgx's default exec mode; with the simple
// protocol (a pool configured for PgBouncer in statement mode, say) every
// column comes as text and the rows go through Scan.
func rawDecodable(fields []pgconn.FieldDescription) bool {
	if len(fields) != len(claimColumns) {
		return false
	}
	for i, c := range claimColumns {
		f := fields[i]
		if f.DataTypeOID != c.oid || !c.either && (f.Format == pgtype.BinaryFormatCode) != c.binary {
			return false
		}
	}
	return true
}

// y2k is PostgreSQL's epoch for binary timestamps.
var y2k = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC).UnixMicro()

// decodeRaw decodes one claimed row from the wire bytes, as Scan would, with
// a fraction of its allocations: the claim hands out thousands of rows a
// second and Scan was a third of the forwarder's own CPU. It reports false
// for a value it does not read (a wrong length), and the row is then scanned
// the ordinary way. A created_at of ±infinity (only possible by hand) comes
// back as the zero time, as from Scan: the record is still published.
func decodeRaw(v [][]byte, r *storage.Record, topic *string) bool {
	if len(v[0]) != 8 || len(v[6]) != 4 || len(v[7]) != 8 || len(v[8]) != 1 || v[1] == nil || v[2] == nil || v[3] == nil {
		return false
	}
	us := int64(binary.BigEndian.Uint64(v[7]))
	r.ID = int64(binary.BigEndian.Uint64(v[0]))
	r.UUID = string(v[1])
	// Records of a batch mostly share a topic: keep one copy.
	if string(v[2]) != *topic {
		*topic = string(v[2])
	}
	r.Topic = *topic
	r.Key = string(v[3])
	if v[4] != nil {
		r.Payload = slices.Clone(v[4])
		if r.Payload == nil {
			r.Payload = []byte{}
		}
	}
	r.Attempts = int(int32(binary.BigEndian.Uint32(v[6])))
	if us != 1<<63-1 && us != -1<<63 { // not 'infinity' or '-infinity'
		r.CreatedAt = time.UnixMicro(y2k + us)
	}
	if v[5] != nil {
		decodeMetadata(v[5], r)
	}
	return true
}

// decodeMetadata fills r.Metadata from the metadata column, or sets
// r.DecodeError when it is not a JSON object of strings.
func decodeMetadata(doc []byte, r *storage.Record) {
	if m, ok := parseFlatObject(doc); ok {
		r.Metadata = m
		return
	}
	if err := json.Unmarshal(doc, &r.Metadata); err != nil {
		r.Metadata = nil
		r.DecodeError = fmt.Errorf("decode metadata of outbox row %d: %w", r.ID, err)
	}
}

// parseFlatObject parses the common case of the metadata column as jsonb
// prints it: an object of string values, ASCII without escapes, such as
// {"a": "b", "c": "d"}. Anything else (escapes, other bytes, other value
// types, malformed input) returns false and goes through encoding/json, which
// gives the same result for the common case.
func parseFlatObject(b []byte) (map[string]string, bool) {
	i := 0
	space := func() {
		for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
			i++
		}
	}
	str := func() (string, bool) {
		if i >= len(b) || b[i] != '"' {
			return "", false
		}
		i++
		start := i
		for i < len(b) {
			c := b[i]
			switch {
			case c == '"':
				s := string(b[start:i])
				i++
				return s, true
			case c == '\\' || c < 0x20 || c >= 0x80:
				return "", false
			}
			i++
		}
		return "", false
	}
	space()
	if i >= len(b) || b[i] != '{' {
		return nil, false
	}
	i++
	m := make(map[string]string, 4)
	space()
	if i < len(b) && b[i] == '}' {
		i++
		space()
		return m, i == len(b)
	}
	for {
		space()
		k, ok := str()
		if !ok {
			return nil, false
		}
		space()
		if i >= len(b) || b[i] != ':' {
			return nil, false
		}
		i++
		space()
		v, ok := str()
		if !ok {
			return nil, false
		}
		m[k] = v
		space()
		if i >= len(b) {
			return nil, false
		}
		if b[i] == '}' {
			i++
			space()
			return m, i == len(b)
		}
		if b[i] != ',' {
			return nil, false
		}
		i++
	}
}

// scanClaimed reads the claim's rows and returns them in id order, and
// whether the claim left no claimable row out (its last column, the same in
// every row; false when no row came back).
func scanClaimed(rows pgx.Rows, table string, capacity int) (_ []storage.Record, drained bool, _ error) {
	defer rows.Close()
	recs := make([]storage.Record, 0, min(capacity, 1024))
	raw := rawDecodable(rows.FieldDescriptions())
	var topic string
	var meta []byte
	for rows.Next() {
		var r storage.Record
		if raw && decodeRaw(rows.RawValues(), &r, &topic) {
			drained = rows.RawValues()[8][0] == 1
			recs = append(recs, r)
			continue
		}
		r = storage.Record{}
		var attempts int32
		var created pgtype.Timestamptz
		if err := rows.Scan(&r.ID, &r.UUID, &r.Topic, &r.Key, &r.Payload, &meta, &attempts, &created, &drained); err != nil {
			return nil, false, fmt.Errorf("claim outbox rows from %s: scan: %w", table, err)
		}
		r.Attempts = int(attempts)
		if created.InfinityModifier == pgtype.Finite {
			r.CreatedAt = created.Time
		}
		if meta != nil {
			decodeMetadata(meta, &r)
		}
		recs = append(recs, r)
	}
	if err := rows.Err(); err != nil {
		return nil, false, fmt.Errorf("claim outbox rows from %s: %w", table, err)
	}
	if !slices.IsSortedFunc(recs, byID) {
		slices.SortFunc(recs, byID)
	}
	return recs, drained, nil
}

func byID(a, b storage.Record) int {
	switch {
	case a.ID < b.ID:
		return -1
	case a.ID > b.ID:
		return 1
	}
	return 0
}
