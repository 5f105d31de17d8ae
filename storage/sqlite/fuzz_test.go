package sqlite

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// FuzzDecode writes arbitrary values into the metadata column by hand,
// bypassing Insert (text of any bytes, a BLOB, an INTEGER, a REAL, NULL:
// SQLite stores whatever it is given), then claims the record. The claim must
// never fail or panic; a record whose metadata is not a JSON object of
// strings comes back with DecodeError set and no metadata, any other with the
// decoded metadata.
func FuzzDecode(f *testing.F) {
	s := newTestStorage(f, Config{})
	for _, seed := range []struct {
		data string
		kind uint8
	}{
		{`{"a":"b"}`, 0},
		{`{}`, 0},
		{`"not an object"`, 0},
		{`{"a":1}`, 0},
		{`{"a":{"b":"c"}}`, 0},
		{`[1,2]`, 0},
		{`null`, 0},
		{``, 0},
		{"\xff\xfe", 0},
		{`{"a":"b"`, 0},
		{`{"a":"b"} trailing`, 0},
		{`{"a":"\ud800"}`, 0},
		{`{"a":"b"}`, 1},
		{"12345", 2},
		{"1.5", 3},
		{"", 4},
	} {
		f.Add([]byte(seed.data), seed.kind)
	}
	f.Fuzz(func(t *testing.T, data []byte, kind uint8) {
		ctx := context.Background()
		id := insert(t, s, rec("t", "k"))[0]
		var v any
		switch kind % 5 {
		case 0:
			v = string(data)
		case 1:
			v = append([]byte{}, data...) // stored as a BLOB
		case 2:
			n, _ := strconv.ParseInt(string(data), 10, 64)
			v = n
		case 3:
			x, _ := strconv.ParseFloat(string(data), 64)
			v = x
		case 4:
			v = nil
		}
		if _, err := s.db.ExecContext(ctx, fmt.Sprintf(`UPDATE %s SET metadata = ? WHERE id = ?`, quote(s.table)), v, id); err != nil {
			t.Fatalf("corrupt metadata: %v", err)
		}
		var stored sql.NullString
		if err := s.db.QueryRowContext(ctx, fmt.Sprintf(`SELECT metadata FROM %s WHERE id = ?`, quote(s.table)), id).Scan(&stored); err != nil {
			t.Fatalf("read metadata back: %v", err)
		}

		recs, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 10, Lease: time.Minute, WorkerID: "fuzz"})
		if err != nil {
			t.Fatalf("claim failed on corrupt metadata %q: %v", stored.String, err)
		}
		if len(recs) != 1 || recs[0].ID != id {
			t.Fatalf("claimed %v, want record %d alone", ids(recs), id)
		}
		checkDecoded(t, recs[0], stored.Valid, stored.String)
		// Park it, as the forwarder would, so the next input starts clean.
		if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: liveRef(t, s, id), WorkerID: "fuzz", Error: "fuzz"}); err != nil {
			t.Fatal(err)
		}
	})
}

// checkDecoded checks a claimed record against the metadata text it was
// stored with: decodable as a JSON object of strings, or DecodeError set.
func checkDecoded(t *testing.T, r storage.Record, valid bool, text string) {
	t.Helper()
	var want map[string]string
	decodable := !valid || text == "" || json.Unmarshal([]byte(text), &want) == nil
	switch {
	case decodable && r.DecodeError != nil:
		t.Fatalf("metadata %q decodes, but the record has DecodeError %v", text, r.DecodeError)
	case !decodable && r.DecodeError == nil:
		t.Fatalf("metadata %q is not an object of strings, but DecodeError is nil (metadata %q)", text, r.Metadata)
	case !decodable && r.Metadata != nil:
		t.Fatalf("undecodable record carries metadata %q", r.Metadata)
	case decodable && !maps.Equal(want, r.Metadata):
		t.Fatalf("metadata %q decoded as %q, want %q", text, r.Metadata, want)
	}
	if r.DecodeError != nil && !strings.Contains(r.DecodeError.Error(), strconv.FormatInt(r.ID, 10)) {
		t.Fatalf("DecodeError %q does not name the record %d", r.DecodeError, r.ID)
	}
}

// plainTable is the documented rule for Config.Table.
var plainTable = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,63}$`)

// FuzzTableName checks that New accepts exactly the documented table names
// and refuses every other with an error wrapping storage.ErrInvalidIdentifier,
// so no name can change the meaning of a statement.
func FuzzTableName(f *testing.F) {
	for _, name := range []string{
		"outbox", "Outbox_2", "_x", "outbox; DROP TABLE x", `"quoted"`, "a.b", "a.b.c", "таблица",
		"1outbox", "sqlite_master", "SQLITE_x", strings.Repeat("a", 64), strings.Repeat("a", 65),
		"out box", "outbox\n", "outbox\x00", "",
	} {
		f.Add(name)
	}
	db, _ := openTestDB(f)
	f.Fuzz(func(t *testing.T, name string) {
		_, err := New(db, Config{Table: name})
		want := name == "" || (plainTable.MatchString(name) && !strings.HasPrefix(strings.ToLower(name), "sqlite_"))
		switch {
		case want && err != nil:
			t.Fatalf("New(%q) refused a plain identifier: %v", name, err)
		case !want && !errors.Is(err, storage.ErrInvalidIdentifier):
			t.Fatalf("New(%q) = %v, want an error wrapping ErrInvalidIdentifier", name, err)
		}
	})
}
