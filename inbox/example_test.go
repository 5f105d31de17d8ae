package inbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/inbox"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// A handler wrapped by the inbox writes an invoice and publishes an event
// through the outbox in one transaction; the message's redelivery is acked
// without running it again.
func Example() {
	dir, err := os.MkdirTemp("", "inbox-example")
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = os.RemoveAll(dir) }()
	db, err := sqlite.Open(filepath.Join(dir, "app.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = db.Close() }()
	store, err := sqlite.New(db, sqlite.Config{})
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE invoices (order_uuid TEXT)`); err != nil {
		log.Fatal(err)
	}

	in, err := inbox.New(inbox.Config{Consumer: "billing", Store: store.Inbox()})
	if err != nil {
		log.Fatal(err)
	}
	events, err := txoutbox.NewPublisher(store, txoutbox.PublisherConfig{})
	if err != nil {
		log.Fatal(err)
	}
	handler := in.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Println("processing", msg.UUID)
		tx, _ := txoutbox.TxFromContext(msg.Context())
		if _, err := tx.(*sql.Tx).ExecContext(msg.Context(), `INSERT INTO invoices VALUES (?)`, msg.UUID); err != nil {
			return nil, err
		}
		ev := message.NewMessage("invoice-for-"+msg.UUID, []byte(`{}`))
		ev.SetContext(msg.Context())
		return nil, events.Publish("invoices.requested", ev)
	})

	// The same message twice, as a broker redelivers it after a lost ack.
	for range 2 {
		if _, err := handler(message.NewMessage("order-1", []byte(`{}`))); err != nil {
			log.Fatal(err)
		}
	}
	var invoices, records int
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM invoices`).Scan(&invoices)
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM outbox`).Scan(&records)
	fmt.Println("invoices:", invoices, "outbox records:", records)
	// Output:
	// processing order-1
	// invoices: 1 outbox records: 1
}
