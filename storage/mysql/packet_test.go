package mysql

import (
	"bytes"
	"database/sql"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// payloadOf returns n random bytes (every byte value, those the driver
// escapes included).
func payloadOf(n int) []byte {
	p := make([]byte, n)
	r := rand.NewChaCha8([32]byte{byte(n)})
	_, _ = r.Read(p)
	return p
}

// TestInsertLargePayloads: payloads up to the server's max_allowed_packet
// insert, alone or together (split into statements that fit), and come back
// intact; a payload that cannot fit is refused with ErrInvalidRecord before
// anything is sent, and the producer's transaction goes on. Also through a
// pool whose DSN sets interpolateParams (the driver then sends the payload
// escaped in the statement's text).
func TestInsertLargePayloads(t *testing.T) {
	t.Parallel()
	for _, dsnParams := range []string{"", "interpolateParams=true"} {
		t.Run("dsn "+dsnParams, func(t *testing.T) {
			t.Parallel()
			base := newStore(t, Config{})
			db := base.db
			if dsnParams != "" {
				dsn := testDSN()
				sep := "?"
				if strings.Contains(dsn, "?") {
					sep = "&"
				}
				var err error
				db, err = sql.Open("mysql", dsn+sep+dsnParams)
				must(t, err)
				t.Cleanup(func() { db.Close() })
			}
			s, err := New(db, base.config)
			must(t, err)
			ctx := t.Context()
			var limit int
			must(t, db.QueryRowContext(ctx, "SELECT @@max_allowed_packet").Scan(&limit))
			if limit > 64<<20 {
				t.Skipf("max_allowed_packet is %d: the test's payloads assume at most 64 MiB", limit)
			}
			mib := func(f float64) int { return int(f * float64(1<<20) * float64(limit) / float64(16<<20)) }
			want := []storage.Record{
				{UUID: "a", Topic: "t", Key: "k", Payload: payloadOf(mib(1.9))},
				{UUID: "b", Topic: "t", Key: "k", Payload: payloadOf(mib(6.3))},
				{UUID: "c", Topic: "t", Key: "k", Payload: payloadOf(mib(8.1))},
				{UUID: "d", Topic: "t", Key: "k", Payload: payloadOf(mib(6.3))},
				{UUID: "e", Topic: "t", Key: "k", Payload: []byte("small")},
			}
			tx, err := db.BeginTx(ctx, nil)
			must(t, err)
			defer tx.Rollback() //nolint:errcheck // no-op after commit
			must(t, s.Insert(ctx, tx, want[:2]))
			must(t, s.Insert(ctx, tx, want[2:3]))
			err = s.Insert(ctx, tx, []storage.Record{{UUID: "x", Topic: "t", Payload: payloadOf(limit)}})
			if !errors.Is(err, storage.ErrInvalidRecord) || !strings.Contains(err.Error(), "max_allowed_packet") {
				t.Errorf("Insert of a payload of max_allowed_packet bytes = %v, want ErrInvalidRecord naming max_allowed_packet", err)
			}
			must(t, s.Insert(ctx, tx, want[3:]))
			must(t, tx.Commit())
			got := claim(t, s, "w", 10, time.Minute)
			if len(got) != len(want) {
				t.Fatalf("claimed %d records, want %d", len(got), len(want))
			}
			for i, r := range got {
				if r.UUID != want[i].UUID || !bytes.Equal(r.Payload, want[i].Payload) {
					t.Errorf("record %d: uuid %q, payload of %d bytes (equal: %v), want %q, %d bytes", i, r.UUID, len(r.Payload),
						bytes.Equal(r.Payload, want[i].Payload), want[i].UUID, len(want[i].Payload))
				}
			}
		})
	}
}
