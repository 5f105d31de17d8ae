// Command postgres is the README's quick start on PostgreSQL, runnable: it
// writes orders and their events in one transaction each, and a forwarder
// relays the events to RabbitMQ with watermill-amqp.
//
// It creates the orders table and the outbox (in the schema that the
// connection's search_path names), places three orders, waits until RabbitMQ
// has delivered their three events to a queue of its own, and exits.
//
//	rabbitmq-server -detached   # if RabbitMQ is not running
//	DATABASE_URL=postgres://postgres@127.0.0.1:5432/test?sslmode=disable \
//	AMQP_URL=amqp://guest:guest@127.0.0.1:5672/ go run ./examples/postgres
package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// topic is the Watermill topic of the events: with watermill-amqp's pub/sub
// config, the name of a fanout exchange that every subscriber's queue is
// bound to.
const topic = "orders.created"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	databaseURL := cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	amqpURL := cmp.Or(os.Getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
	if err := run(ctx, databaseURL, amqpURL, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "postgres example:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, databaseURL, amqpURL string, out io.Writer) error {
	pool, outbox, err := setup(ctx, databaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	logger := watermill.NewStdLogger(false, false) // on stderr

	// A queue of this run's own on the topic's exchange, bound before any
	// event is relayed: RabbitMQ drops what reaches an exchange with no queue.
	deliveries, closeSubscriber, err := subscribe(ctx, amqpURL, logger)
	if err != nil {
		return err
	}
	defer closeSubscriber()

	// The relay, in the background until run returns.
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayed := make(chan error, 1)
	go func() { relayed <- relay(relayCtx, outbox, amqpURL, logger); close(relayed) }()
	defer func() { stopRelay(); <-relayed }()

	// The producer: three orders, each with its event, each in one transaction.
	publisher, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
	if err != nil {
		return err
	}
	defer publisher.Close()
	placed := map[string]int64{} // event UUID -> order id
	for _, total := range []int{42, 7, 1999} {
		orderID, eventID, err := placeOrder(ctx, pool, publisher, total)
		if err != nil {
			return err
		}
		placed[eventID] = orderID
		fmt.Fprintf(out, "placed order %d (total %d), event %s\n", orderID, total, eventID)
	}

	timeout := time.After(30 * time.Second)
	for len(placed) > 0 {
		select {
		case msg := <-deliveries:
			msg.Ack()
			if _, ours := placed[msg.UUID]; !ours {
				continue // another run's event on the same exchange
			}
			delete(placed, msg.UUID)
			fmt.Fprintf(out, "RabbitMQ delivered %s key %s: %s\n", topic, msg.Metadata.Get(txoutbox.MetadataKey), msg.Payload)
		case err := <-relayed:
			return fmt.Errorf("the relay stopped: %w", err)
		case <-timeout:
			return fmt.Errorf("%d events not delivered within 30s", len(placed))
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	fmt.Fprintln(out, "all 3 orders' events delivered")
	return nil
}

// setup connects, creates the business table if it is missing, and migrates
// the outbox (or put outbox.SchemaSQL() in your migrations).
func setup(ctx context.Context, databaseURL string) (*pgxpool.Pool, *postgres.Storage, error) {
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		return nil, nil, fmt.Errorf("connect: %w", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (
		id    bigserial PRIMARY KEY,
		total integer NOT NULL CHECK (total > 0))`); err != nil {
		pool.Close()
		return nil, nil, fmt.Errorf("create orders: %w", err)
	}
	outbox, err := postgres.New(pool, postgres.Config{Table: "outbox", NotifyChannel: "outbox"})
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	if err := outbox.CreateSchema(ctx); err != nil {
		pool.Close()
		return nil, nil, fmt.Errorf("migrate the outbox: %w", err)
	}
	return pool, outbox, nil
}

// placeOrder writes an order and its event in one transaction: both commit,
// or neither does.
func placeOrder(ctx context.Context, pool *pgxpool.Pool, publisher *txoutbox.Publisher, total int) (orderID int64, eventID string, err error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return 0, "", err
	}
	defer tx.Rollback(ctx) // a no-op after Commit

	if err := tx.QueryRow(ctx, `INSERT INTO orders (total) VALUES ($1) RETURNING id`, total).Scan(&orderID); err != nil {
		return 0, "", fmt.Errorf("insert order: %w", err)
	}
	msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"order_id":%d,"total":%d}`, orderID, total))
	msg.Metadata.Set(txoutbox.MetadataKey, fmt.Sprintf("order-%d", orderID)) // the ordering key
	msg.SetContext(txoutbox.ContextWithTx(ctx, tx))
	if err := publisher.Publish(topic, msg); err != nil { // one INSERT through tx; no broker involved
		return 0, "", fmt.Errorf("publish the event of order %d: %w", orderID, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, "", fmt.Errorf("commit order %d: %w", orderID, err)
	}
	return orderID, msg.UUID, nil
}

// relay forwards the outbox to RabbitMQ until ctx is cancelled. Run it in as
// many processes as you like; each takes its share of the keys.
func relay(ctx context.Context, outbox *postgres.Storage, amqpURL string, logger watermill.LoggerAdapter) error {
	cfg := amqp.NewDurablePubSubConfig(amqpURL, nil)
	cfg.Publish.ConfirmDelivery = true // Publish returns once RabbitMQ has the message: per-key order holds
	target, err := amqp.NewPublisher(cfg, logger)
	if err != nil {
		return fmt.Errorf("connect to RabbitMQ: %w", err)
	}
	defer target.Close()

	forwarder, err := txoutbox.NewForwarder(outbox, target, txoutbox.ForwarderConfig{}, logger)
	if err != nil {
		return err
	}
	listening := make(chan error, 1)
	go func() { listening <- outbox.Listen(ctx, forwarder.Wake) }() // LISTEN/NOTIFY: wake on commit instead of polling
	err = forwarder.Run(ctx)                                        // until ctx is cancelled; then it releases what it holds
	return errors.Join(err, <-listening)
}

// subscribe binds a queue of this run's own to the topic's exchange and
// returns its messages; the queue goes away with its consumer.
func subscribe(ctx context.Context, amqpURL string, logger watermill.LoggerAdapter) (<-chan *message.Message, func(), error) {
	cfg := amqp.NewDurablePubSubConfig(amqpURL, amqp.GenerateQueueNameTopicNameWithSuffix("example-"+watermill.NewShortUUID()))
	cfg.Queue.AutoDelete = true
	subscriber, err := amqp.NewSubscriber(cfg, logger)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to RabbitMQ: %w", err)
	}
	deliveries, err := subscriber.Subscribe(ctx, topic)
	if err != nil {
		subscriber.Close()
		return nil, nil, fmt.Errorf("subscribe to %s: %w", topic, err)
	}
	return deliveries, func() { subscriber.Close() }, nil
}
