// Command kafka relays outbox records from PostgreSQL to Kafka with
// watermill-kafka. The outbox key becomes the Kafka partition key, so the
// events of one order land on one partition, in order.
//
// It commits three orders (and rolls a fourth back, whose event never
// leaves the database), relays their events and reads them back through a
// watermill-kafka consumer group, then exits. Without KAFKA_BROKERS it starts
// an in-process Kafka (franz-go's kfake) so it runs anywhere Postgres does.
//
//	DATABASE_URL=postgres://postgres@127.0.0.1:5432/test go run ./examples/kafka
//	KAFKA_BROKERS=localhost:9092 go run ./examples/kafka   # a real cluster
package main

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

const topic = "orders"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "kafka example:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	brokers := strings.Split(os.Getenv("KAFKA_BROKERS"), ",")
	if brokers[0] == "" {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, topic))
		if err != nil {
			return err
		}
		defer cluster.Close()
		brokers = cluster.ListenAddrs()
	}

	// The outbox table, in a throwaway schema, with LISTEN/NOTIFY wake-ups.
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS example_kafka CASCADE; CREATE SCHEMA example_kafka;
		CREATE TABLE example_kafka.orders (id TEXT PRIMARY KEY)`); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA example_kafka CASCADE`)
	outbox, err := postgres.New(pool, postgres.Config{Table: "example_kafka.outbox", NotifyChannel: "example_kafka_outbox"})
	if err != nil {
		return err
	}
	if err := outbox.CreateSchema(ctx); err != nil {
		return err
	}

	// Producer side: each order and its events commit together, or not at all.
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

	// Relay side: watermill-kafka's publisher with the outbox key as partition key.
	kafkaPublisher, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers:   brokers,
		Marshaler: kafka.NewWithPartitioningMarshaler(txoutbox.PartitionKey),
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer kafkaPublisher.Close()
	forwarder, err := txoutbox.NewForwarder(outbox, kafkaPublisher, txoutbox.ForwarderConfig{}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	done := make(chan error, 2)
	go func() { done <- forwarder.Run(relayCtx) }()
	go func() { done <- outbox.Listen(relayCtx, forwarder.Wake) }() // wake on commit, not on the next poll
	defer func() { stopRelay(); <-done; <-done }()

	// Consumer side: any Kafka consumer; here a watermill-kafka consumer group.
	saramaConfig := kafka.DefaultSaramaSubscriberConfig()
	saramaConfig.Consumer.Offsets.Initial = sarama.OffsetOldest
	subscriber, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:               brokers,
		Unmarshaler:           kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: saramaConfig,
		ConsumerGroup:         "example-" + watermill.NewShortUUID(),
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer subscriber.Close()
	msgs, err := subscriber.Subscribe(ctx, topic)
	if err != nil {
		return err
	}
	timeout := time.After(time.Minute)
	for got := 0; got < want; got++ {
		select {
		case msg := <-msgs:
			partition, _ := kafka.MessagePartitionFromCtx(msg.Context())
			fmt.Printf("partition %d  key %-8s %s\n", partition, msg.Metadata.Get(txoutbox.MetadataKey), msg.Payload)
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
	if _, err := tx.Exec(ctx, `INSERT INTO example_kafka.orders VALUES ($1)`, id); err != nil {
		return 0, err
	}
	for _, step := range []string{"placed", "paid"} {
		msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"order":%q,"event":%q}`, id, step))
		msg.Metadata.Set(txoutbox.MetadataKey, id) // the ordering key, and the Kafka partition key
		msg.SetContext(txoutbox.ContextWithTx(ctx, tx))
		if err := publisher.Publish(topic, msg); err != nil {
			return 0, err
		}
	}
	if rollback {
		return 0, nil // the deferred Rollback discards the order and its events
	}
	return 2, tx.Commit(ctx)
}
