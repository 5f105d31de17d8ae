package txoutbox_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// ExamplePublisher writes an event in the same transaction as the business
// data; a rollback would discard both.
func ExamplePublisher() {
	ctx := context.Background()
	dir, _ := os.MkdirTemp("", "txoutbox-example-")
	defer os.RemoveAll(dir)
	db, _ := sqlite.Open(filepath.Join(dir, "app.db"))
	defer db.Close()
	outbox, _ := sqlite.New(db, sqlite.Config{})
	_ = outbox.CreateSchema(ctx)

	publisher, _ := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})

	tx, _ := db.BeginTx(ctx, nil)
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":1}`))
	msg.Metadata.Set(txoutbox.MetadataKey, "order-1")
	msg.SetContext(txoutbox.ContextWithTx(ctx, tx))
	if err := publisher.Publish("orders.placed", msg); err != nil {
		fmt.Println(err)
	}
	_ = tx.Commit()

	stats, _ := outbox.Stats(ctx)
	fmt.Println("pending:", stats.Pending)
	// Output: pending: 1
}

// ExampleForwarder relays committed events to a Watermill publisher.
func ExampleForwarder() {
	ctx := context.Background()
	dir, _ := os.MkdirTemp("", "txoutbox-example-")
	defer os.RemoveAll(dir)
	db, _ := sqlite.Open(filepath.Join(dir, "app.db"))
	defer db.Close()
	outbox, _ := sqlite.New(db, sqlite.Config{})
	_ = outbox.CreateSchema(ctx)

	tx, _ := db.BeginTx(ctx, nil)
	pub, _ := txoutbox.NewTxPublisher(outbox, tx, txoutbox.PublisherConfig{})
	_ = pub.Publish("orders.placed", message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":1}`)))
	_ = tx.Commit()

	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	defer broker.Close()
	received, _ := broker.Subscribe(ctx, "orders.placed")

	forwarder, _ := txoutbox.NewForwarder(outbox, broker, txoutbox.ForwarderConfig{}, nil)
	res, _ := forwarder.RunOnce(ctx) // Run(ctx) loops until ctx is cancelled
	fmt.Println("published:", res.Published)

	select {
	case msg := <-received:
		fmt.Println(string(msg.Payload), "attempt", msg.Metadata.Get(txoutbox.MetadataAttempt))
		msg.Ack()
	case <-time.After(5 * time.Second):
		fmt.Println("nothing received")
	}
	// Output:
	// published: 1
	// {"order_id":1} attempt 1
}
