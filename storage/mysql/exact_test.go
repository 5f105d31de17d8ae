package mysql

import (
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// openCharsetDB opens a pool whose connections use charset (the DSN's
// charset parameter), closed when the test ends.
func openCharsetDB(t *testing.T, charset string) *sql.DB {
	t.Helper()
	openDB(t) // skips when no server answers
	dsn := testDSN()
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	db, err := sql.Open("mysql", dsn+sep+"charset="+charset)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	var got string
	must(t, db.QueryRowContext(t.Context(), "SELECT @@character_set_results").Scan(&got))
	if !strings.HasPrefix(got, charset) {
		t.Fatalf("character_set_results = %q, want %q", got, charset)
	}
	return db
}

// TestReadBackIndependentOfCharset: through a pool whose connections use
// utf8 (3-byte) or latin1, claims, the operator API and the per-key
// statements see exactly what was written: emoji in topic, key, metadata
// and errors.
func TestReadBackIndependentOfCharset(t *testing.T) {
	t.Parallel()
	for _, charset := range []string{"utf8", "latin1"} {
		t.Run(charset, func(t *testing.T) {
			t.Parallel()
			base := newStore(t, Config{DeleteOnAck: true, HoldOnDeadLetter: true})
			s, err := New(openCharsetDB(t, charset), base.config)
			must(t, err)
			ctx := t.Context()
			const key = "客户-😀"
			in := storage.Record{UUID: "uuid-😀", Topic: "orders-😀", Key: key, Payload: []byte("payload-😀\xff"),
				Metadata: map[string]string{"é-😀": "客户-😀"}}
			ids := insert(t, base, in, in, in)

			got := claim(t, s, "w-😀", 1, time.Minute)
			if len(got) != 1 {
				t.Fatalf("claim = %v, want [%d]", idsOf(got), ids[0])
			}
			r := got[0]
			if r.UUID != in.UUID || r.Topic != in.Topic || r.Key != in.Key || string(r.Payload) != string(in.Payload) ||
				!maps.Equal(r.Metadata, in.Metadata) || r.DecodeError != nil {
				t.Fatalf("claimed %+v, want %+v", r, in)
			}
			// The rows behind the leased head are parked; the ack (deleting
			// the head) must set the next one free.
			if got := claim(t, s, "w-😀", 10, time.Minute); len(got) != 0 {
				t.Fatalf("claim behind a leased head = %v", idsOf(got))
			}
			held, err := s.HeldKeys(ctx, storage.HeldKeysParams{})
			must(t, err)
			if len(held) != 1 || held[0].Key != key || held[0].LeasedBy != "w-😀" {
				t.Fatalf("HeldKeys = %+v, want key %q leased by %q", held, key, "w-😀")
			}
			must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[0]), WorkerID: "w-😀"}))
			got = claim(t, s, "w-😀", 1, time.Minute)
			if !slices.Equal(idsOf(got), ids[1:2]) {
				t.Fatalf("claim after the head's ack = %v, want [%d]", idsOf(got), ids[1])
			}
			// A dead row holds its key (HoldOnDeadLetter); skipping it sets
			// the next row free.
			must(t, s.DeadLetter(ctx, storage.DeadLetterParams{Record: liveRef(t, s, ids[1]), WorkerID: "w-😀", Error: "boom-😀"}))
			if got := claim(t, s, "w-😀", 10, time.Minute); len(got) != 0 {
				t.Fatalf("claim behind a dead head = %v", idsOf(got))
			}
			dead, err := s.ListDead(ctx, storage.ListDeadParams{Key: key})
			must(t, err)
			if len(dead) != 1 || dead[0].Record.Key != key || dead[0].Record.Topic != in.Topic || dead[0].LastError != "boom-😀" ||
				!maps.Equal(dead[0].Record.Metadata, in.Metadata) {
				t.Fatalf("ListDead = %+v, want record %d of key %q with error %q", dead, ids[1], key, "boom-😀")
			}
			held, err = s.HeldKeys(ctx, storage.HeldKeysParams{})
			must(t, err)
			if len(held) != 1 || held[0].Key != key || held[0].LastError != "boom-😀" {
				t.Fatalf("HeldKeys = %+v, want key %q held by error %q", held, key, "boom-😀")
			}
			must(t, s.Skip(ctx, storage.SkipParams{ID: ids[1], Reason: "reason-😀"}))
			info, err := s.Record(ctx, ids[1])
			must(t, err)
			if info.Record.Key != key || info.SkipReason != "reason-😀" || info.LastError != "boom-😀" || info.Record.UUID != in.UUID {
				t.Fatalf("Record = %+v, want key %q, reason %q, error %q", info, key, "reason-😀", "boom-😀")
			}
			if got := claim(t, s, "w-😀", 10, time.Minute); !slices.Equal(idsOf(got), ids[2:]) {
				t.Fatalf("claim after the skip = %v, want [%d]", idsOf(got), ids[2])
			}
			info, err = s.Record(ctx, ids[2])
			must(t, err)
			if info.LeasedBy != "w-😀" || info.Record.Topic != in.Topic {
				t.Fatalf("Record = %+v, want leased by %q", info, "w-😀")
			}
		})
	}
}

var _ = fmt.Sprint

// TestKeysTrailingSpace: utf8mb4_bin ignores trailing spaces ('a' = 'a '),
// so a key ending in a space is refused at Insert, nothing written; and the
// operator's key and topic filters match byte for byte, also rows written
// before (by hand here).
func TestKeysTrailingSpace(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{HoldOnDeadLetter: true})
	ctx := t.Context()
	tx, err := s.db.BeginTx(ctx, nil)
	must(t, err)
	err = s.Insert(ctx, tx, recs("a", "a "))
	if !errors.Is(err, storage.ErrInvalidRecord) || !strings.Contains(err.Error(), "ends in a space") {
		t.Errorf("Insert of key %q = %v, want ErrInvalidRecord saying it ends in a space", "a ", err)
	}
	must(t, tx.Rollback())
	if st := mustStats(t, s); st.Pending != 0 {
		t.Fatalf("%d rows written by the refused insert", st.Pending)
	}

	// Dead rows of keys "a" and "a " and topics "t" and "t ", as a table
	// written before might hold.
	must(t, exec(t, s, "INSERT INTO "+s.table+" (uuid, topic, `key`, created_at, due_at, status) VALUES "+
		"('1', 't', 'a', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), 'dead'), ('2', 't ', 'a ', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), 'dead')"))
	for _, p := range []storage.ListDeadParams{{Key: "a"}, {Topic: "t"}} {
		dead, err := s.ListDead(ctx, p)
		must(t, err)
		if len(dead) != 1 || dead[0].Record.UUID != "1" {
			t.Errorf("ListDead(%+v) = %+v, want only uuid 1", p, dead)
		}
	}
	for _, p := range []storage.RedriveParams{{Key: "a"}, {Topic: "t "}} {
		n, err := s.Redrive(ctx, p)
		must(t, err)
		if n != 1 {
			t.Errorf("Redrive(%+v) = %d rows, want 1", p, n)
		}
	}
}
