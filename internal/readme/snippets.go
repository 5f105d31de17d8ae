// Package readme holds the README's Go snippets that no example program
// holds, inside functions that declare what they use, so that the compiler
// checks them; its test checks that every Go block of the README is quoted,
// as written, from this file or from another compiled file of the module.
package readme

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/go-sql-driver/mysql" // the "mysql" database/sql driver
	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/console"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/mysql"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// MySQLQuickStart is the README's quick start on MySQL or MariaDB: the
// producer and the relay of examples/mysql, without the demonstration around
// them.
func MySQLQuickStart(ctx context.Context, target message.Publisher, logger watermill.LoggerAdapter) error {
	db, err := sql.Open("mysql", "app:secret@tcp(localhost:3306)/app") // github.com/go-sql-driver/mysql
	if err != nil {
		return err
	}
	outbox, err := mysql.New(db, mysql.Config{Table: "outbox"})
	if err != nil {
		return err
	}
	if err := outbox.CreateSchema(ctx); err != nil { // or put outbox.SchemaSQL() in your migrations
		return err
	}

	// Producer: the business row and the event commit together.
	publisher, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
	if err != nil {
		return err
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() // a no-op after Commit
	res, err := tx.ExecContext(ctx, `INSERT INTO orders (total) VALUES (?)`, 42)
	if err != nil {
		return err
	}
	orderID, err := res.LastInsertId()
	if err != nil {
		return err
	}
	msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"order_id":%d}`, orderID))
	msg.Metadata.Set(txoutbox.MetadataKey, fmt.Sprintf("order-%d", orderID)) // the ordering key
	msg.SetContext(txoutbox.ContextWithTx(ctx, tx))
	if err := publisher.Publish("orders.created", msg); err != nil { // one multi-row INSERT through tx
		return err
	}
	if err := tx.Commit(); err != nil {
		return err
	}

	// Relay: no LISTEN/NOTIFY on MySQL, so the forwarder polls; a process
	// that also produces wakes it after a commit.
	forwarder, err := txoutbox.NewForwarder(outbox, target, txoutbox.ForwarderConfig{}, logger)
	if err != nil {
		return err
	}
	forwarder.Wake()
	return forwarder.Run(ctx) // until ctx is cancelled
}

// BoundPublisher is the README's publisher bound to one transaction.
func BoundPublisher(outbox *postgres.Storage, tx pgx.Tx, msg *message.Message) error {
	pub, err := txoutbox.NewTxPublisher(outbox, tx, txoutbox.PublisherConfig{}) // or longLived.Bind(tx)
	if err != nil {
		return err
	}
	return pub.Publish("orders.created", msg)
}

// OrderPlaced is an event of the README's CQRS snippet.
type OrderPlaced struct {
	OrderID string
}

// EventBus is the README's long-lived publisher under Watermill's CQRS
// event bus.
func EventBus(ctx context.Context, outbox *postgres.Storage, tx pgx.Tx) error {
	pub, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
	if err != nil {
		return err
	}
	bus, err := cqrs.NewEventBusWithConfig(pub, cqrs.EventBusConfig{
		GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) { return "events." + p.EventName, nil },
		Marshaler:            cqrs.JSONMarshaler{},
	})
	if err != nil {
		return err
	}
	return bus.Publish(txoutbox.ContextWithTx(ctx, tx), &OrderPlaced{OrderID: "order-42"})
}

// MountConsole is the README's web console on an application's admin mux.
func MountConsole(store storage.Operator, adminMux *http.ServeMux, isAdmin func(*http.Request) bool) (*console.Handler, error) {
	h, err := console.New(store, console.Config{
		Prefix:        "/admin/outbox",
		Authorize:     isAdmin, // required: your app's check (or console.AllowAll behind your middleware)
		EnableActions: true,    // re-drive and skip; read-only by default
	}, watermill.NewSlogLogger(slog.Default())) // audit lines
	if err != nil {
		return nil, err
	}
	adminMux.Handle("/admin/outbox/", h)
	return h, nil // Close it on shutdown: it stops the stats sampler
}

// DelayedReminder is the README's delayed delivery: a message published now
// and delivered a day later.
func DelayedReminder(pub message.Publisher, msg *message.Message) error {
	txoutbox.Delay(msg, 24*time.Hour) // or txoutbox.DeliverAt(msg, midnight)
	return pub.Publish("reminders.due", msg)
}
