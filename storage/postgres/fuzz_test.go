package postgres

import (
	"encoding/json"
	"errors"
	"maps"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox/storage"
)

// FuzzDecode writes arbitrary documents into the metadata column by hand,
// bypassing Insert, then claims the record. The column is JSONB, so the
// server refuses text that is not JSON (that input is skipped); every JSON
// value it does store (strings, numbers, arrays, nested objects, null) must
// claim without error or panic, and a record whose metadata is not an object
// of strings comes back with DecodeError set and no metadata.
func FuzzDecode(f *testing.F) {
	s := newStore(f, Config{})
	for _, doc := range []string{
		`{"a":"b"}`, `{}`, `"not an object"`, `{"a":1}`, `{"a":{"b":"c"}}`, `[1,2]`, `null`,
		`true`, `12.5`, `{"a":null}`, `{"a":"\u00e9","b":"🎉"}`, `{"a":"b","a":"c"}`,
		`{"a":"b"`, "\xff", `{"a":"\u0000"}`,
	} {
		f.Add(doc)
	}
	f.Fuzz(func(t *testing.T, doc string) {
		ctx := t.Context()
		id := insert(t, s, rec("k"))[0]
		if _, err := s.pool.Exec(ctx, "UPDATE "+s.table+" SET metadata = $1::text::jsonb WHERE id = $2", doc, id); err != nil {
			// Not a document PostgreSQL stores as JSONB; park the row.
			if _, err := s.pool.Exec(ctx, "UPDATE "+s.table+" SET status = 'dead' WHERE id = $1", id); err != nil {
				t.Fatal(err)
			}
			t.Skipf("not storable as jsonb: %v", err)
		}
		var stored *string
		if err := s.pool.QueryRow(ctx, "SELECT metadata::text FROM "+s.table+" WHERE id = $1", id).Scan(&stored); err != nil {
			t.Fatal(err)
		}
		recs, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 10, Lease: time.Minute, WorkerID: "fuzz"})
		if err != nil {
			t.Fatalf("claim failed on metadata %v: %v", doc, err)
		}
		if len(recs) != 1 || recs[0].ID != id {
			t.Fatalf("claimed %v, want record %d alone", idsOf(recs), id)
		}
		r := recs[0]
		var want map[string]string
		decodable := stored == nil || json.Unmarshal([]byte(*stored), &want) == nil
		switch {
		case decodable && r.DecodeError != nil:
			t.Fatalf("metadata %s decodes, but the record has DecodeError %v", *stored, r.DecodeError)
		case !decodable && r.DecodeError == nil:
			t.Fatalf("metadata %s is not an object of strings, but DecodeError is nil (metadata %q)", *stored, r.Metadata)
		case !decodable && r.Metadata != nil:
			t.Fatalf("undecodable record carries metadata %q", r.Metadata)
		case decodable && !maps.Equal(want, r.Metadata):
			t.Fatalf("metadata %s decoded as %q, want %q", *stored, r.Metadata, want)
		}
		if r.DecodeError != nil && !strings.Contains(r.DecodeError.Error(), strconv.FormatInt(id, 10)) {
			t.Fatalf("DecodeError %q does not name the record %d", r.DecodeError, id)
		}
		// Park it, as the forwarder would, so the next input starts clean.
		if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: liveRef(t, s, id), WorkerID: "fuzz", Error: "fuzz"}); err != nil {
			t.Fatal(err)
		}
	})
}

// plainPart is the documented rule for each part of Config.Table and for
// Config.NotifyChannel.
var plainPart = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

func plainTableName(name string) bool {
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return false
	}
	for _, p := range parts {
		if len(p) > 63 || !plainPart.MatchString(p) {
			return false
		}
	}
	return true
}

// FuzzIdentifiers checks that New accepts exactly the documented table and
// channel names and refuses every other with an error wrapping
// storage.ErrInvalidIdentifier, before anything reaches the server.
func FuzzIdentifiers(f *testing.F) {
	for _, name := range []string{
		"outbox", "app.outbox", "_x", "outbox; DROP TABLE x", `"quoted"`, "a.b.c", "таблица", ".outbox",
		"outbox.", "1outbox", strings.Repeat("a", 63), strings.Repeat("a", 64), "out box", "outbox\n",
		"outbox\x00", "x'); DROP TABLE x; --",
	} {
		f.Add(name)
	}
	// A pool that connects nowhere: New must not need the server.
	cfg, err := pgxpool.ParseConfig("postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	if err != nil {
		f.Fatal(err)
	}
	p, err := pgxpoolWithConfig(f, cfg)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, name string) {
		_, terr := New(p, Config{Table: name})
		tableOK := name == "" || plainTableName(name)
		_, cerr := New(p, Config{NotifyChannel: name})
		channelOK := name == "" || (len(name) <= 63 && plainPart.MatchString(name))
		for _, c := range []struct {
			what string
			ok   bool
			err  error
		}{{"Table", tableOK, terr}, {"NotifyChannel", channelOK, cerr}} {
			switch {
			case c.ok && c.err != nil:
				t.Fatalf("New with %s %q refused a plain identifier: %v", c.what, name, c.err)
			case !c.ok && !errors.Is(c.err, storage.ErrInvalidIdentifier):
				t.Fatalf("New with %s %q = %v, want an error wrapping ErrInvalidIdentifier", c.what, name, c.err)
			}
		}
	})
}
