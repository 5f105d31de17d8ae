package txoutbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"maps"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// fuzzPayloadLimit is the publisher's payload limit in FuzzPublish: small, so
// the fuzzer reaches both sides of it.
const fuzzPayloadLimit = 512

// FuzzPublish feeds the transactional publisher hostile input (topic, key,
// metadata key and value, payload size, UUID; invalid UTF-8 and NUL bytes
// included) over a real SQLite outbox. The invariant: Publish either returns
// an error wrapping one of the publisher's sentinels and nothing is written
// (the transaction is committed anyway to prove it), or it succeeds and the
// record reads back equal: topic, key, metadata, payload, UUID. Input that is
// valid must be accepted, and invalid input refused with the sentinel that
// names the fault.
func FuzzPublish(f *testing.F) {
	db, err := sqlite.Open(filepath.Join(f.TempDir(), "fuzz.db"))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { db.Close() })
	store, err := sqlite.New(db, sqlite.Config{})
	if err != nil {
		f.Fatal(err)
	}
	if err := store.CreateSchema(context.Background()); err != nil {
		f.Fatal(err)
	}
	pub, err := txoutbox.NewPublisher(store, txoutbox.PublisherConfig{MaxPayloadBytes: fuzzPayloadLimit})
	if err != nil {
		f.Fatal(err)
	}

	for _, seed := range []struct {
		topic, key, metaKey, metaValue string
		size                           uint16
		uuid                           string
	}{
		{"orders", "order-1", "trace", "abc", 10, "0b6d1c36-5f7e-4c39-9c55-1f0f1b8a4a01"},
		{"", "k", "m", "v", 1, "u-1"},                                            // empty topic
		{"t\xff", "k", "m", "v", 1, "u-2"},                                       // topic not UTF-8
		{"t\x00", "", "", "", 1, "u-3"},                                          // NUL in topic
		{"t", "k\x00", "", "", 1, "u-4"},                                         // NUL in key
		{"t", "k\xc3\x28", "", "", 1, "u-5"},                                     // key not UTF-8
		{"t", "k", "m\xfe", "v", 1, "u-6"},                                       // metadata key not UTF-8
		{"t", "k", "m", "v\xed\xa0\x80", 1, "u-7"},                               // surrogate half in value
		{"t", "", "", "", fuzzPayloadLimit + 1, "u-8"},                           // payload over the limit
		{"t", "", "", "", fuzzPayloadLimit, "u-9"},                               // payload at the limit
		{"t", "", "", "", 0, "u-10"},                                             // empty payload, no metadata
		{"t", "k", txoutbox.MetadataKey, "other", 3, "u-11"},                     // metadata overrides the key
		{"t", "ключ", "ключ", "значение 🎉", 3, "u-12"},                           // unicode
		{"t", "k", "m", "v", 3, ""},                                              // empty UUID
		{"t", "k", "m", "v", 3, "u\xff"},                                         // UUID not UTF-8
		{"t", strings.Repeat("k", 300), "", strings.Repeat("v", 300), 3, "u-13"}, // long strings
		{"x; DROP TABLE outbox; --", "'; --", `"`, `\`, 5, `u'"-14`},             // SQL and JSON metacharacters
		{"t", "k", "", "", 2, "u-15"},                                            // empty metadata key
	} {
		f.Add(seed.topic, seed.key, seed.metaKey, seed.metaValue, seed.size, seed.uuid)
	}

	f.Fuzz(func(t *testing.T, topic, key, metaKey, metaValue string, size uint16, uuid string) {
		ctx := context.Background()
		payload := make([]byte, int(size)%(4*fuzzPayloadLimit))
		for i := range payload {
			payload[i] = byte(i*31 + 7) // every byte value, NUL included
		}
		msg := message.NewMessage(uuid, payload)
		if key != "" {
			msg.Metadata.Set(txoutbox.MetadataKey, key)
		}
		if metaKey != "" || metaValue != "" {
			msg.Metadata.Set(metaKey, metaValue)
		}
		wantMeta := maps.Clone(msg.Metadata)
		wantKey := msg.Metadata.Get(txoutbox.MetadataKey)
		allowed := expectedErrors(topic, uuid, len(payload), msg.Metadata)

		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		perr := pub.Bind(tx).Publish(topic, msg)
		if err := tx.Commit(); err != nil {
			t.Fatalf("commit: %v", err)
		}
		records := drainFuzzTable(t, store, db)

		if perr != nil {
			if len(allowed) == 0 {
				t.Fatalf("valid input refused: %v", perr)
			}
			if !wrapsAny(perr, allowed) {
				t.Fatalf("Publish error %q wraps none of the expected sentinels %v", perr, allowed)
			}
			if len(records) != 0 {
				t.Fatalf("a refused publish wrote %d records", len(records))
			}
			return
		}
		if len(allowed) > 0 {
			t.Fatalf("invalid input accepted (want one of %v)", allowed)
		}
		if len(records) != 1 {
			t.Fatalf("one publish wrote %d records", len(records))
		}
		r := records[0]
		if r.DecodeError != nil {
			t.Fatalf("stored record does not decode: %v", r.DecodeError)
		}
		if r.UUID != uuid || r.Topic != topic || r.Key != wantKey {
			t.Fatalf("read back uuid %q topic %q key %q, want %q %q %q", r.UUID, r.Topic, r.Key, uuid, topic, wantKey)
		}
		if !bytes.Equal(r.Payload, payload) {
			t.Fatalf("payload of %d bytes read back as %d different bytes", len(payload), len(r.Payload))
		}
		if len(r.Metadata) != len(wantMeta) || (len(wantMeta) > 0 && !maps.Equal(map[string]string(wantMeta), r.Metadata)) {
			t.Fatalf("metadata read back %q, want %q", r.Metadata, wantMeta)
		}
	})
}

// expectedErrors returns the sentinels Publish may return for this input,
// none when the input is valid.
func expectedErrors(topic, uuid string, payloadLen int, metadata message.Metadata) []error {
	var errs []error
	if topic == "" {
		errs = append(errs, txoutbox.ErrEmptyTopic)
	}
	invalid := !storable(topic) || uuid == "" || !storable(uuid)
	for k, v := range metadata {
		invalid = invalid || !storable(k) || !storable(v)
	}
	if invalid {
		errs = append(errs, txoutbox.ErrInvalidMessage)
	}
	if payloadLen > fuzzPayloadLimit {
		errs = append(errs, txoutbox.ErrPayloadTooLarge)
	}
	return errs
}

// storable is the publisher's documented rule for text: valid UTF-8, no NUL.
func storable(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

func wrapsAny(err error, targets []error) bool {
	for _, target := range targets {
		if errors.Is(err, target) {
			return true
		}
	}
	return false
}

// drainFuzzTable claims everything in the table, then empties it so the next
// input starts from nothing.
func drainFuzzTable(t *testing.T, store *sqlite.Storage, db *sql.DB) []storage.Record {
	t.Helper()
	ctx := context.Background()
	records, err := store.Claim(ctx, storage.ClaimParams{BatchSize: 10, Lease: time.Minute, WorkerID: "fuzz"})
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	if _, err := db.ExecContext(ctx, `DELETE FROM "`+store.Table()+`"`); err != nil {
		t.Fatalf("empty the table: %v", err)
	}
	return records
}
