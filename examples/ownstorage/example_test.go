package ownstorage_test

import (
	"context"
	"database/sql"
	"log"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/examples/ownstorage"
)

// The storage plugs into txoutbox like a built-in one: the publisher writes
// through it in the application's transaction, the forwarder relays from it.
func ExampleNew() {
	ctx := context.Background()
	db, err := sql.Open("pgx", "postgres://app@localhost/app")
	if err != nil {
		log.Fatal(err)
	}
	outbox, err := ownstorage.New(db, ownstorage.Config{Table: "legacy_events"})
	if err != nil {
		log.Fatal(err)
	}

	publisher, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
	if err != nil {
		log.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback()
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":42}`))
	msg.Metadata.Set(txoutbox.MetadataKey, "order-42")
	msg.SetContext(txoutbox.ContextWithTx(ctx, tx))
	if err := publisher.Publish("orders.created", msg); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}

	var target message.Publisher // your broker's Watermill publisher
	forwarder, err := txoutbox.NewForwarder(outbox, target, txoutbox.ForwarderConfig{}, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	if err := forwarder.Run(ctx); err != nil { // until ctx is cancelled
		log.Fatal(err)
	}
}
