// Command quickstart shows txoutbox end to end with no database server: it
// makes a SQLite file in a temporary directory, commits orders and their events
// in one transaction each (and rolls one back, which is never published), and
// runs a forwarder that re-publishes the events to Watermill's Go channel
// pub/sub, where a subscriber prints them. It exits 0 once every committed
// event is delivered; Ctrl-C stops it gracefully.
//
//	go run ./examples/quickstart
package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

// run is the whole example; the test calls it too.
func run(ctx context.Context, out io.Writer) error {
	dir, err := os.MkdirTemp("", "txoutbox-quickstart-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	// The database: your business tables and the outbox table, in one file.
	db, err := sqlite.Open(filepath.Join(dir, "shop.db"))
	if err != nil {
		return err
	}
	defer db.Close()
	outbox, err := sqlite.New(db, sqlite.Config{})
	if err != nil {
		return err
	}
	if err := outbox.CreateSchema(ctx); err != nil { // or put outbox.SchemaSQL() in your migrations
		return err
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, total INTEGER NOT NULL)`); err != nil {
		return err
	}

	// Producer side: one long-lived transactional publisher; each order and its
	// events commit (or roll back) together.
	publisher, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
	if err != nil {
		return err
	}
	orders := []struct {
		customer string
		total    int
		rollback bool
	}{
		{"alice", 42, false},
		{"bob", 17, false},
		{"mallory", 999, true}, // rolled back: its event is never published
		{"alice", 8, false},
	}
	committed := 0
	for _, o := range orders {
		n, err := placeOrder(ctx, db, publisher, o.customer, o.total, o.rollback)
		if err != nil {
			return err
		}
		committed += n
	}
	fmt.Fprintf(out, "committed %d events (one order rolled back)\n", committed)

	// The broker: Watermill's Go channel pub/sub stands in for Kafka, RabbitMQ, ...
	// Publish returns once the subscriber acked, like a broker confirming a write.
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true, BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer broker.Close()
	type event struct {
		topic string
		msg   *message.Message
	}
	delivered := make(chan event)
	for _, topic := range []string{"orders.placed", "orders.paid"} {
		msgs, err := broker.Subscribe(ctx, topic)
		if err != nil {
			return err
		}
		go func() {
			for msg := range msgs {
				delivered <- event{topic, msg}
				msg.Ack()
			}
		}()
	}

	// Relay side: the forwarder claims leased batches and re-publishes them.
	forwarder, err := txoutbox.NewForwarder(outbox, broker, txoutbox.ForwarderConfig{
		PollMin: 10 * time.Millisecond,
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- forwarder.Run(relayCtx) }()
	defer func() { stopRelay(); <-relayDone }()

	for seen := 0; seen < committed; seen++ {
		select {
		case e := <-delivered:
			fmt.Fprintf(out, "delivered %-13s key=%-8s attempt=%s uuid=%s payload=%s\n",
				e.topic, e.msg.Metadata.Get(txoutbox.MetadataKey),
				e.msg.Metadata.Get(txoutbox.MetadataAttempt), e.msg.UUID, e.msg.Payload)
		case <-ctx.Done():
			return fmt.Errorf("stopped after %d of %d events: %w", seen, committed, ctx.Err())
		case <-time.After(30 * time.Second):
			return fmt.Errorf("only %d of %d events delivered in 30s", seen, committed)
		}
	}
	fmt.Fprintf(out, "all %d committed events delivered\n", committed)
	return nil
}

// placeOrder writes an order and its two events in one transaction, and
// returns how many events it committed.
func placeOrder(ctx context.Context, db *sql.DB, publisher *txoutbox.Publisher, customer string, total int, rollback bool) (int, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback() // no-op after Commit

	var id int64
	if err := tx.QueryRowContext(ctx, `INSERT INTO orders (customer, total) VALUES (?, ?) RETURNING id`, customer, total).Scan(&id); err != nil {
		return 0, err
	}
	key := fmt.Sprintf("order-%d", id) // events of one order are delivered in order
	for _, topic := range []string{"orders.placed", "orders.paid"} {
		msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"order_id":%d,"customer":%q,"total":%d}`, id, customer, total))
		msg.Metadata.Set(txoutbox.MetadataKey, key)
		msg.SetContext(txoutbox.ContextWithTx(ctx, tx))
		if err := publisher.Publish(topic, msg); err != nil {
			return 0, err
		}
	}
	if rollback {
		return 0, errors.Join(tx.Rollback())
	}
	return 2, tx.Commit()
}
