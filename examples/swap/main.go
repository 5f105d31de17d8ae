// Command swap shows the few lines that change when code that published
// straight to Kafka moves to txoutbox, and one thing it gains: a poison
// message does not block the rest.
//
// OrderService is ordinary application code that takes a message.Publisher.
// Before, it was given watermill-kafka's publisher and published after its
// commit (an event lost if Kafka was down then, or sent for a rollback if it
// published before). Now it is given txoutbox's publisher and publishes
// inside its transaction; a forwarder owns the Kafka publisher.
//
// One event is larger than the topic accepts: it fails three times and is
// dead-lettered, while the other orders flow and the same order's next event
// waits behind it, in order. Without KAFKA_BROKERS an in-process Kafka
// (franz-go's kfake) is started.
//
//	go run ./examples/swap
package main

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// OrderService is application code: it knows a database and a
// message.Publisher, nothing about the outbox.
type OrderService struct {
	db     *pgxpool.Pool
	events message.Publisher
}

// PlaceOrder stores an order and publishes its events.
func (s OrderService) PlaceOrder(ctx context.Context, id string, events ...[]byte) error {
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) // no-op after Commit
	if _, err := tx.Exec(ctx, `INSERT INTO example_swap.orders VALUES ($1)`, id); err != nil {
		return err
	}
	for _, payload := range events {
		msg := message.NewMessage(watermill.NewUUID(), payload)
		msg.Metadata.Set(txoutbox.MetadataKey, id)      // changed: was "partition_key" for the Kafka marshaler
		msg.SetContext(txoutbox.ContextWithTx(ctx, tx)) // added: the event joins the transaction
		if err := s.events.Publish("orders", msg); err != nil {
			return err
		}
	}
	return tx.Commit(ctx) // moved: Publish used to come after Commit
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "swap example:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	brokers := strings.Split(os.Getenv("KAFKA_BROKERS"), ",")
	if brokers[0] == "" {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, "orders"))
		if err != nil {
			return err
		}
		defer cluster.Close()
		brokers = cluster.ListenAddrs()
	}
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS example_swap CASCADE; CREATE SCHEMA example_swap;
		CREATE TABLE example_swap.orders (id TEXT PRIMARY KEY)`); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA example_swap CASCADE`)

	// The Kafka publisher, as before. Messages over 64 KiB are refused: they
	// stand for any message the broker will never take.
	saramaConfig := kafka.DefaultSaramaSyncPublisherConfig()
	saramaConfig.Producer.MaxMessageBytes = 64 << 10
	kafkaPublisher, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers:               brokers,
		Marshaler:             kafka.NewWithPartitioningMarshaler(txoutbox.PartitionKey), // was: a func reading "partition_key"
		OverwriteSaramaConfig: saramaConfig,
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer kafkaPublisher.Close()

	// Before:
	//	service := OrderService{db: pool, events: kafkaPublisher}
	// After: the outbox table, the transactional publisher, and a forwarder.
	outbox, err := postgres.New(pool, postgres.Config{Table: "example_swap.outbox", NotifyChannel: "example_swap_outbox"})
	if err != nil {
		return err
	}
	if err := outbox.CreateSchema(ctx); err != nil {
		return err
	}
	publisher, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
	if err != nil {
		return err
	}
	service := OrderService{db: pool, events: publisher}
	forwarder, err := txoutbox.NewForwarder(outbox, kafkaPublisher, txoutbox.ForwarderConfig{
		MaxAttempts: 3,                                              // then dead-letter
		Backoff:     txoutbox.Backoff{Base: 200 * time.Millisecond}, // quick retries for the demo
		Middlewares: []message.HandlerMiddleware{printOutcome},
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	done := make(chan error, 2)
	go func() { done <- forwarder.Run(relayCtx) }()
	go func() { done <- outbox.Listen(relayCtx, forwarder.Wake) }()
	defer func() { stopRelay(); <-done; <-done }()

	poison := bytes.Repeat([]byte("x"), 100<<10)
	for _, o := range []struct {
		id     string
		events [][]byte
	}{
		{"order-1", [][]byte{[]byte("order-1 placed"), []byte("order-1 paid")}},
		{"order-2", [][]byte{poison, []byte("order-2 paid")}}, // the first event is too large
		{"order-3", [][]byte{[]byte("order-3 placed"), []byte("order-3 paid")}},
	} {
		if err := service.PlaceOrder(ctx, o.id, o.events...); err != nil {
			return err
		}
	}

	// Wait until nothing is pending: delivered or dead-lettered.
	deadline := time.Now().Add(30 * time.Second)
	for {
		stats, err := outbox.Stats(ctx)
		if err != nil {
			return err
		}
		if stats.Pending == 0 {
			fmt.Printf("done: %d delivered, %d dead-lettered (a dead record stays in the table until outbox.Redrive puts it back)\n", stats.Delivered, stats.Dead)
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("still %d pending after 30s", stats.Pending)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// printOutcome is a forwarder middleware that prints each publish attempt.
func printOutcome(next message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := next(msg)
		what := string(msg.Payload)
		if len(what) > 20 {
			what = fmt.Sprintf("%d-byte event", len(msg.Payload))
		}
		if err != nil {
			fmt.Printf("attempt %s  %-8s %-15s failed: %v\n", msg.Metadata.Get(txoutbox.MetadataAttempt), msg.Metadata.Get(txoutbox.MetadataKey), what, err)
		} else {
			fmt.Printf("attempt %s  %-8s %-15s published\n", msg.Metadata.Get(txoutbox.MetadataAttempt), msg.Metadata.Get(txoutbox.MetadataKey), what)
		}
		return out, err
	}
}
