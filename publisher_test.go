package txoutbox_test

import (
	"context"
	"errors"
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
