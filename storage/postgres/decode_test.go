package postgres

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox/storage"
)

// TestClaimDecodesInEveryExecMode claims the same rows through pools in each
// of pgx's exec modes: the default one takes the raw-bytes path, the simple
// protocol and exec modes get other formats and go through Scan. Every field
// must come back the same, including the edge cases (NULL and empty payload
// and metadata, escapes and non-ASCII in metadata, a created_at of infinity,
// metadata that is not an object of strings).
func TestClaimDecodesInEveryExecMode(t *testing.T) {
	t.Parallel()
	base := newStore(t, Config{})
	ctx := t.Context()
	in := []storage.Record{
		{UUID: "u1", Topic: "t", Key: "a", Payload: []byte("p"), Metadata: map[string]string{"k": "v", "long key": "x y"}},
		{UUID: "u2", Topic: "t", Payload: nil, Metadata: nil},
		{UUID: "u3", Topic: "other", Key: "b", Payload: []byte{}, Metadata: map[string]string{}},
		{UUID: "u4", Topic: "t", Key: "c", Payload: []byte{0, 1, 255}, Metadata: map[string]string{"q": `a "quoted" \ value`, "é": "ü ✓"}},
		{UUID: "u5", Topic: "t", Key: "d", Payload: []byte("x"), Metadata: map[string]string{"a": "b"}},
		{UUID: "u6", Topic: "t", Key: "e", Payload: []byte("y"), Metadata: map[string]string{"a": "b"}},
	}
	ids := insert(t, base, in...)
	_, err := base.pool.Exec(ctx, fmt.Sprintf("UPDATE %s SET metadata = '{\"n\": 1}' WHERE id = $1", base.table), ids[4])
	must(t, err)
	_, err = base.pool.Exec(ctx, fmt.Sprintf("UPDATE %s SET created_at = 'infinity' WHERE id = $1", base.table), ids[5])
	must(t, err)

	var want []storage.Record
	for _, mode := range []pgx.QueryExecMode{
		pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec,
		pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
	} {
		cfg, err := pgxpool.ParseConfig(testDatabaseURL())
		must(t, err)
		cfg.ConnConfig.DefaultQueryExecMode = mode
		p, err := pgxpoolWithConfig(t, cfg)
		must(t, err)
		s, err := New(p, Config{Table: base.config.Table})
		must(t, err)
		got, drained, err := s.ClaimDrained(ctx, storage.ClaimParams{BatchSize: 10, Lease: time.Minute, WorkerID: "w"})
		must(t, err)
		if !drained {
			t.Errorf("%v: a claim of all %d rows with nothing held is not reported drained", mode, len(got))
		}
		// Give the rows back for the next mode.
		must(t, s.Release(ctx, storage.ReleaseParams{Records: storage.Refs(got), WorkerID: "w", RetryAt: time.Now().Add(-time.Second)}))
		if len(got) != len(in) {
			t.Fatalf("%v: claimed %d rows, want %d", mode, len(got), len(in))
		}
		if want == nil {
			want = got
			if got[1].Payload != nil || got[1].Metadata != nil || got[2].Payload == nil || len(got[2].Payload) != 0 || got[2].Metadata == nil {
				t.Fatalf("%v: NULL and empty payload or metadata mixed up: %+v / %+v", mode, got[1], got[2])
			}
			if got[3].Metadata["q"] != `a "quoted" \ value` || got[3].Metadata["é"] != "ü ✓" || got[0].Metadata["long key"] != "x y" {
				t.Fatalf("%v: metadata decoded as %q and %q", mode, got[0].Metadata, got[3].Metadata)
			}
			if got[4].DecodeError == nil || got[4].Metadata != nil {
				t.Fatalf("%v: metadata {\"n\": 1} gave %v, %v; want a DecodeError", mode, got[4].Metadata, got[4].DecodeError)
			}
			if !got[5].CreatedAt.IsZero() || got[0].CreatedAt.IsZero() {
				t.Fatalf("%v: created_at infinity came back as %v (want the zero time), a real one as %v", mode, got[5].CreatedAt, got[0].CreatedAt)
			}
			continue
		}
		for i := range want {
			w, g := want[i], got[i]
			same := w.ID == g.ID && w.UUID == g.UUID && w.Topic == g.Topic && w.Key == g.Key &&
				slices.Equal(w.Payload, g.Payload) && (w.Payload == nil) == (g.Payload == nil) &&
				maps.Equal(w.Metadata, g.Metadata) && (w.Metadata == nil) == (g.Metadata == nil) &&
				w.Attempts == g.Attempts && w.CreatedAt.Equal(g.CreatedAt) && (w.DecodeError == nil) == (g.DecodeError == nil)
			if !same {
				t.Fatalf("%v: row %d decoded as\n%+v\nwant (default mode)\n%+v", mode, i, g, w)
			}
		}
	}
}

// FuzzParseFlatObject: whatever the fast metadata parser accepts,
// encoding/json must decode to the same map.
func FuzzParseFlatObject(f *testing.F) {
	for _, s := range []string{`{}`, `{"a": "b"}`, `{"a": "b", "c": "d"}`, ` { "a" : "b" } `, `{"a": "b",}`, `{"a": 1}`, `{"a": "\u00e9"}`, `{"a": "b"} x`, `{"a":"b","a":"c"}`, `[]`, `null`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, ok := parseFlatObject(b)
		if !ok {
			return
		}
		var want map[string]string
		if err := json.Unmarshal(b, &want); err != nil {
			t.Fatalf("parseFlatObject accepted %q, encoding/json refuses it: %v", b, err)
		}
		if !maps.Equal(m, want) || m == nil {
			t.Fatalf("parseFlatObject(%q) = %q, encoding/json: %q", b, m, want)
		}
	})
}

// TestClaimRowsTakeTheRawPath: with pgx's default exec mode the claim's
// columns come in the formats decodeRaw reads (else the fast path would
// silently never run); with the simple protocol they do not.
func TestClaimRowsTakeTheRawPath(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	insert(t, s, rec("a"))
	for _, tc := range []struct {
		mode pgx.QueryExecMode
		raw  bool
	}{{pgx.QueryExecModeCacheStatement, true}, {pgx.QueryExecModeSimpleProtocol, false}} {
		tx, err := s.pool.Begin(t.Context())
		must(t, err)
		rows, err := tx.Query(t.Context(), s.q.claim, append([]any{tc.mode}, claimArgs(s, 10, "w", 0)...)...)
		must(t, err)
		if got := rawDecodable(rows.FieldDescriptions()); got != tc.raw {
			t.Errorf("%v: rawDecodable = %v, want %v (%+v)", tc.mode, got, tc.raw, rows.FieldDescriptions())
		}
		rows.Close()
		must(t, rows.Err())
		must(t, tx.Rollback(t.Context()))
	}
}
