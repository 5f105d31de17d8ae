package txoutbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
)

// fakeInserter records what the publisher hands to the storage; the real
// storages are covered by TestPublisherPostgres and FuzzPublish (SQLite).
type fakeInserter struct {
	calls int
	txs   []any
}

func (f *fakeInserter) Insert(_ context.Context, tx any, recs []storage.Record) error {
	f.calls++
	f.txs = append(f.txs, tx)
	return nil
}

func TestPublisherContextBinding(t *testing.T) {
	ins := &fakeInserter{}
	pub, err := txoutbox.NewPublisher(ins, txoutbox.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	msg := func(tx any) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte("x"))
		if tx != nil {
			m.SetContext(txoutbox.ContextWithTx(context.Background(), tx))
		}
		return m
	}
	txA, txB := new(int), new(int)
	if err := pub.Publish("t", msg(txA), msg(txA)); err != nil || ins.calls != 1 || ins.txs[0] != any(txA) {
		t.Fatalf("same tx: err %v, %d inserts: want one insert through txA", err, ins.calls)
	}
	if err := pub.Publish("t", msg(txA), msg(txB)); !errors.Is(err, txoutbox.ErrInvalidMessage) {
		t.Errorf("two transactions in one Publish: %v, want ErrInvalidMessage", err)
	}
	if err := pub.Publish("t", msg(txA), msg(nil)); !errors.Is(err, txoutbox.ErrNoTransaction) {
		t.Errorf("second message without tx: %v, want ErrNoTransaction", err)
	}
	// An uncomparable transaction value is an error, not a panic.
	type weird struct{ _ []int }
	if err := pub.Publish("t", msg(weird{}), msg(weird{})); !errors.Is(err, txoutbox.ErrInvalidMessage) {
		t.Errorf("uncomparable tx: %v, want ErrInvalidMessage", err)
	}
	if ins.calls != 1 {
		t.Errorf("%d inserts, want only the first Publish to write", ins.calls)
	}
	if _, err := txoutbox.NewPublisher(nil, txoutbox.PublisherConfig{}); err == nil {
		t.Error("nil inserter accepted")
	}
	if _, err := txoutbox.NewPublisher(ins, txoutbox.PublisherConfig{MaxPayloadBytes: -5}); err == nil {
		t.Error("negative MaxPayloadBytes accepted")
	}
}

// A nil message used to panic (nil pointer in Publish); the forwarder's own
// metadata names used to be silently overwritten. Both are refused now, with
// nothing written; MetadataKey stays the producer's way to set the key.
func TestPublisherRefusesNilAndReservedMetadata(t *testing.T) {
	ins := &fakeInserter{}
	pub, err := txoutbox.NewTxPublisher(ins, new(int), txoutbox.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	ok := message.NewMessage(watermill.NewUUID(), []byte("x"))
	for name, msgs := range map[string][]*message.Message{
		"nil":        {nil},
		"nil second": {ok, nil},
		"nil first":  {nil, ok},
	} {
		if err := pub.Publish("t", msgs...); !errors.Is(err, txoutbox.ErrInvalidMessage) {
			t.Errorf("%s: %v, want ErrInvalidMessage", name, err)
		}
	}
	// The context-bound publisher reads msgs[0].Context(): no panic either.
	ctxPub, err := txoutbox.NewPublisher(ins, txoutbox.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if err := ctxPub.Publish("t", nil); !errors.Is(err, txoutbox.ErrInvalidMessage) {
		t.Errorf("context-bound, nil: %v, want ErrInvalidMessage", err)
	}
	for _, name := range []string{txoutbox.MetadataOutboxID, txoutbox.MetadataAttempt, txoutbox.MetadataCreatedAt} {
		m := message.NewMessage(watermill.NewUUID(), []byte("x"))
		m.Metadata.Set(name, "producer's")
		err := pub.Publish("t", ok, m)
		if !errors.Is(err, txoutbox.ErrInvalidMessage) || !strings.Contains(err.Error(), name) || !strings.Contains(err.Error(), "reserved") {
			t.Errorf("metadata %q: %v, want ErrInvalidMessage naming it reserved", name, err)
		}
	}
	if ins.calls != 0 {
		t.Fatalf("%d inserts, want nothing written", ins.calls)
	}
	m := message.NewMessage(watermill.NewUUID(), []byte("x"))
	m.Metadata.Set(txoutbox.MetadataKey, "order-1")
	if err := pub.Publish("t", m); err != nil || ins.calls != 1 {
		t.Fatalf("MetadataKey set by the producer: %v, %d inserts; want it accepted", err, ins.calls)
	}
}
