// Command nats relays outbox records from PostgreSQL to a NATS JetStream
// stream with watermill-nats. TrackMsgId sends each message's UUID as its
// Nats-Msg-Id, so the stream drops the duplicate when the relay redelivers a
// record (after a crash between publish and ack) inside its duplicate window.
//
// It commits three orders (a fourth rolls back and is never published),
// relays their events, consumes them, deletes its stream, and exits.
//
//	nats-server -js &   # JetStream must be enabled
//	NATS_URL=nats://127.0.0.1:4222 go run ./examples/nats
package main

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"os/signal"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// subject is the Watermill topic, the NATS subject and the stream name
// (stream names allow no dots).
const subject = "txoutbox_example_orders"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "nats example:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	natsURL := cmp.Or(os.Getenv("NATS_URL"), "nats://127.0.0.1:4222")

	// The outbox table, in a throwaway schema, with LISTEN/NOTIFY wake-ups.
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS example_nats CASCADE; CREATE SCHEMA example_nats;
		CREATE TABLE example_nats.orders (id TEXT PRIMARY KEY)`); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA example_nats CASCADE`)
	outbox, err := postgres.New(pool, postgres.Config{Table: "example_nats.outbox", NotifyChannel: "example_nats_outbox"})
	if err != nil {
		return err
	}
	if err := outbox.CreateSchema(ctx); err != nil {
		return err
	}

	// The stream, made once up front (AutoProvision on the publisher would
	// look it up before every publish).
	nc, err := nats.Connect(natsURL)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		return err
	}
	if _, err := js.AddStream(&nats.StreamConfig{Name: subject, Subjects: []string{subject}, Duplicates: 10 * time.Minute}); err != nil {
		return fmt.Errorf("create stream (is JetStream on? nats-server -js): %w", err)
	}
	defer js.DeleteStream(subject)

	jetStream := wmnats.JetStreamConfig{
		TrackMsgId:       true, // UUID -> Nats-Msg-Id: broker-side dedup of redeliveries
		SubscribeOptions: []nats.SubOpt{nats.DeliverAll(), nats.AckExplicit()},
	}
	subscriber, err := wmnats.NewSubscriber(wmnats.SubscriberConfig{URL: natsURL, JetStream: jetStream, CloseTimeout: time.Second}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer subscriber.Close()
	msgs, err := subscriber.Subscribe(ctx, subject)
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

	// Relay side: the forwarder publishes to JetStream; Publish returns once
	// the stream has stored the message.
	natsPublisher, err := wmnats.NewPublisher(wmnats.PublisherConfig{URL: natsURL, JetStream: jetStream}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer natsPublisher.Close()
	forwarder, err := txoutbox.NewForwarder(outbox, natsPublisher, txoutbox.ForwarderConfig{}, watermill.NopLogger{})
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
			fmt.Printf("key %-8s Nats-Msg-Id %s  %s\n", msg.Metadata.Get(txoutbox.MetadataKey), msg.UUID, msg.Payload)
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
	if _, err := tx.Exec(ctx, `INSERT INTO example_nats.orders VALUES ($1)`, id); err != nil {
		return 0, err
	}
	for _, step := range []string{"placed", "paid"} {
		msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"order":%q,"event":%q}`, id, step))
		msg.Metadata.Set(txoutbox.MetadataKey, id)
		msg.SetContext(txoutbox.ContextWithTx(ctx, tx))
		if err := publisher.Publish(subject, msg); err != nil {
			return 0, err
		}
	}
	if rollback {
		return 0, nil // the deferred Rollback discards the order and its events
	}
	return 2, tx.Commit(ctx)
}
