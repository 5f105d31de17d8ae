// Command amqp relays outbox records from PostgreSQL to RabbitMQ with
// watermill-amqp. One durable queue carries the events; the outbox key rides
// along in the message headers (txoutbox_key), and each key's events arrive in
// commit order.
//
// It commits three orders (a fourth rolls back and is never published),
// relays their events, consumes them from the queue, and exits.
//
//	rabbitmq-server -detached   # if RabbitMQ is not running
//	AMQP_URL=amqp://guest:guest@127.0.0.1:5672/ go run ./examples/amqp
package main

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"os/signal"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

const queue = "txoutbox_example_orders"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "amqp example:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	// The outbox table, in a throwaway schema, with LISTEN/NOTIFY wake-ups.
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS example_amqp CASCADE; CREATE SCHEMA example_amqp;
		CREATE TABLE example_amqp.orders (id TEXT PRIMARY KEY)`); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA example_amqp CASCADE`)
	outbox, err := postgres.New(pool, postgres.Config{Table: "example_amqp.outbox", NotifyChannel: "example_amqp_outbox"})
	if err != nil {
		return err
	}
	if err := outbox.CreateSchema(ctx); err != nil {
		return err
	}

	// RabbitMQ: a durable queue named after the topic. ConfirmDelivery makes
	// Publish wait for the broker's confirm, so the forwarder acks a record
	// only once RabbitMQ holds it, and the next event of its key cannot
	// overtake it.
	cfg := amqp.NewDurableQueueConfig(cmp.Or(os.Getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/"))
	cfg.Publish.ConfirmDelivery = true
	cfg.Queue.AutoDelete = true // demo only: the queue goes away with its consumer

	// Subscribe first: it declares the queue, and RabbitMQ drops messages sent
	// to a queue that does not exist yet.
	subscriber, err := amqp.NewSubscriber(cfg, watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer subscriber.Close()
	msgs, err := subscriber.Subscribe(ctx, queue)
	if err != nil {
		return err
	}

	// Producer side: one long-lived publisher; the transaction rides in the context.
	publisher, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
	if err != nil {
		return err
	}
	want := 0
	for i, rollback := range []bool{false, false, true, false} {
		n, err := placeOrder(ctx, pool, publisher, fmt.Sprintf("order-%d", i+1), rollback)
		if err != nil {
			return err
		}
		want += n
	}

	// Relay side: the forwarder publishes through watermill-amqp.
	amqpPublisher, err := amqp.NewPublisher(cfg, watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer amqpPublisher.Close()
	forwarder, err := txoutbox.NewForwarder(outbox, amqpPublisher, txoutbox.ForwarderConfig{}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	done := make(chan error, 2)
	go func() { done <- forwarder.Run(relayCtx) }()
	go func() { done <- outbox.Listen(relayCtx, forwarder.Wake) }()
	defer func() { stopRelay(); <-done; <-done }()

	timeout := time.After(30 * time.Second)
	for got := 0; got < want; got++ {
		select {
		case msg := <-msgs:
			fmt.Printf("key %-8s uuid %s  %s\n", msg.Metadata.Get(txoutbox.MetadataKey), msg.UUID, msg.Payload)
			msg.Ack()
		case <-timeout:
			return fmt.Errorf("only %d of %d events arrived", got, want)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	fmt.Printf("all %d committed events delivered; the rolled-back order's never were\n", want)
	return nil
}

// placeOrder writes an order and its two events in one transaction and
// returns how many events it committed.
func placeOrder(ctx context.Context, pool *pgxpool.Pool, publisher *txoutbox.Publisher, id string, rollback bool) (int, error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(ctx) // no-op after Commit
	if _, err := tx.Exec(ctx, `INSERT INTO example_amqp.orders VALUES ($1)`, id); err != nil {
		return 0, err
	}
	for _, step := range []string{"placed", "paid"} {
		msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"order":%q,"event":%q}`, id, step))
		msg.Metadata.Set(txoutbox.MetadataKey, id)
		msg.SetContext(txoutbox.ContextWithTx(ctx, tx))
		if err := publisher.Publish(queue, msg); err != nil {
			return 0, err
		}
	}
	if rollback {
		return 0, nil // the deferred Rollback discards the order and its events
	}
	return 2, tx.Commit(ctx)
}
