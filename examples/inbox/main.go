// Command inbox consumes orders.created from RabbitMQ and, for each order,
// writes an invoice row and publishes invoices.requested through the outbox
// in one PostgreSQL transaction, guarded by the inbox: a message delivered
// twice (here: published twice with one UUID, as a broker redelivers after
// a lost ack) is processed once. A forwarder relays the invoices.requested
// events to RabbitMQ, where the program reads them back, and exits.
//
//	rabbitmq-server -detached   # if RabbitMQ is not running
//	AMQP_URL=amqp://guest:guest@127.0.0.1:5672/ go run ./examples/inbox
package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/inbox"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

const (
	ordersCreated     = "txoutbox_example_orders.created"
	invoicesRequested = "txoutbox_example_invoices.requested"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "inbox example:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	// The billing service's database: its invoices, its outbox and its
	// inbox (Migrate creates both), in a throwaway schema.
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS example_inbox CASCADE; CREATE SCHEMA example_inbox;
		CREATE TABLE example_inbox.invoices (order_id TEXT PRIMARY KEY)`); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA example_inbox CASCADE`)
	store, err := postgres.New(pool, postgres.Config{Table: "example_inbox.outbox"})
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}

	cfg := amqp.NewDurableQueueConfig(cmp.Or(os.Getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/"))
	cfg.Publish.ConfirmDelivery = true
	cfg.Queue.AutoDelete = true // demo only: the queues go away with their consumers
	logger := watermill.NopLogger{}
	amqpPublisher, err := amqp.NewPublisher(cfg, logger)
	if err != nil {
		return err
	}
	defer amqpPublisher.Close()
	ordersSub, err := amqp.NewSubscriber(cfg, logger)
	if err != nil {
		return err
	}
	invoicesSub, err := amqp.NewSubscriber(cfg, logger)
	if err != nil {
		return err
	}
	defer invoicesSub.Close()
	// Subscribing declares the queue: RabbitMQ drops messages sent to a
	// queue that does not exist yet.
	invoices, err := invoicesSub.Subscribe(ctx, invoicesRequested)
	if err != nil {
		return err
	}

	var handled atomic.Int64 // deliveries the handler chain settled, duplicates included

	// The consumer: the inbox runs innermost, so each retry is a new
	// transaction; Recoverer turns a panic into an error (a rollback, a nack).
	in, err := inbox.New(inbox.Config{Consumer: "billing", Store: store.Inbox()})
	if err != nil {
		return err
	}
	go func() { _ = in.Run(ctx) }() // retention: deletes entries older than 7 days
	events, err := txoutbox.NewPublisher(store, txoutbox.PublisherConfig{})
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	router.AddMiddleware(middleware.Recoverer, middleware.Retry{MaxRetries: 3, InitialInterval: 10 * time.Millisecond}.Middleware)
	router.AddConsumerHandler("billing", ordersCreated, ordersSub, func(msg *message.Message) error {
		tx, ok := txoutbox.TxFromContext(msg.Context()) // a pgx.Tx (a *sql.Tx with InboxDB, MySQL, SQLite)
		if !ok {
			return errors.New("no transaction: is the inbox middleware on?")
		}
		order := string(msg.Payload)
		if _, err := tx.(pgx.Tx).Exec(msg.Context(), `INSERT INTO example_inbox.invoices VALUES ($1)`, order); err != nil {
			return err // rolls back, nacks: Retry runs it again
		}
		fmt.Printf("billing: invoiced %s (message %s)\n", order, msg.UUID)
		ev := message.NewMessage(watermill.NewUUID(), []byte(order))
		ev.SetContext(msg.Context()) // the inbox's transaction
		return events.Publish(invoicesRequested, ev)
	}).AddMiddleware(counted(&handled), in.Middleware) // the inbox innermost
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	defer func() { _ = router.Close(); <-routerDone }()
	select {
	case <-router.Running():
	case err := <-routerDone:
		return err
	}

	// The relay of billing's outbox.
	forwarder, err := txoutbox.NewForwarder(store, amqpPublisher, txoutbox.ForwarderConfig{PollMax: 100 * time.Millisecond}, logger)
	if err != nil {
		return err
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- forwarder.Run(relayCtx) }()
	defer func() { stopRelay(); <-relayDone }()

	// Upstream: three orders; order-2's message arrives twice.
	var sent []*message.Message
	for _, id := range []string{"order-1", "order-2", "order-3"} {
		sent = append(sent, message.NewMessage(watermill.NewUUID(), []byte(id)))
	}
	sent = append(sent, sent[1].Copy())
	if err := amqpPublisher.Publish(ordersCreated, sent...); err != nil {
		return err
	}

	timeout := time.After(30 * time.Second)
	for got := 0; got < 3; got++ {
		select {
		case msg := <-invoices:
			fmt.Printf("invoices.requested for %s\n", msg.Payload)
			msg.Ack()
		case <-timeout:
			return fmt.Errorf("only %d of 3 invoices.requested events arrived", got)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	for handled.Load() < int64(len(sent)) {
		select {
		case <-timeout:
			return fmt.Errorf("only %d of %d deliveries handled", handled.Load(), len(sent))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM example_inbox.invoices`).Scan(&n); err != nil {
		return err
	}
	fmt.Printf("%d deliveries, %d invoices: the duplicate was acked without running the handler\n", len(sent), n)
	return nil
}

// counted counts the messages h settles without an error.
func counted(n *atomic.Int64) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				n.Add(1)
			}
			return out, err
		}
	}
}
