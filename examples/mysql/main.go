// Command mysql shows txoutbox on MySQL or MariaDB: it creates an orders table
// and the outbox table (both named with a random suffix, dropped at the end),
// commits orders and their events in one transaction each (and rolls one
// back, which is never published), and runs a forwarder that re-publishes
// the events to Watermill's Go channel pub/sub, where a subscriber prints
// them. MySQL has no LISTEN/NOTIFY: the forwarder polls, and since this
// process also produces, it calls Wake after each commit so the events go
// out at once. It exits 0 once every committed event is delivered.
//
//	MYSQL_DSN='root@tcp(127.0.0.1:3306)/test' go run ./examples/mysql
package main

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "github.com/go-sql-driver/mysql"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/mysql"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	dsn := cmp.Or(os.Getenv("MYSQL_DSN"), "root@tcp(127.0.0.1:3306)/test")
	if err := run(ctx, dsn, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "mysql example:", err)
		os.Exit(1)
	}
}

// run is the whole example; the test calls it too.
func run(ctx context.Context, dsn string, out io.Writer) error {
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	suffix := strings.ToLower(watermill.NewShortUUID())
	ordersTable, outboxTable := "orders_"+suffix, "outbox_"+suffix
	defer db.ExecContext(context.WithoutCancel(ctx), "DROP TABLE IF EXISTS "+ordersTable+", "+outboxTable+", "+outboxTable+"_skipped, "+outboxTable+"_migrations, "+outboxTable+"_keys") //nolint:errcheck // example clean-up

	// The database: your business table and the outbox table.
	outbox, err := mysql.New(db, mysql.Config{Table: outboxTable})
	if err != nil {
		return err
	}
	if err := outbox.CreateSchema(ctx); err != nil { // or put outbox.SchemaSQL() in your migrations
		return err
	}
	if _, err := db.ExecContext(ctx, "CREATE TABLE "+ordersTable+" (id BIGINT AUTO_INCREMENT PRIMARY KEY, customer VARCHAR(64) NOT NULL, total INT NOT NULL)"); err != nil {
		return err
	}

	// The broker: Watermill's Go channel pub/sub stands in for Kafka,
	// RabbitMQ, ... Publish returns once the subscriber acked.
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

	// Relay side: the forwarder polls (no NOTIFY on MySQL) with its idle
	// backoff between PollMin and PollMax.
	forwarder, err := txoutbox.NewForwarder(outbox, broker, txoutbox.ForwarderConfig{
		PollMin: 10 * time.Millisecond,
		PollMax: time.Second,
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- forwarder.Run(relayCtx) }()
	defer func() { stopRelay(); <-relayDone }()

	// Producer side: each order and its events commit (or roll back)
	// together; after a commit, Wake cuts the forwarder's idle sleep short.
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
		{"mallory", 999, true}, // rolled back: its events are never published
		{"alice", 8, false},
	}
	committed := 0
	for _, o := range orders {
		n, err := placeOrder(ctx, db, ordersTable, publisher, o.customer, o.total, o.rollback)
		if err != nil {
			return err
		}
		if n > 0 {
			forwarder.Wake()
		}
		committed += n
	}
	fmt.Fprintf(out, "committed %d events (one order rolled back)\n", committed)

	for seen := 0; seen < committed; seen++ {
		select {
		case e := <-delivered:
			fmt.Fprintf(out, "delivered %-13s key=%-8s attempt=%s payload=%s\n",
				e.topic, e.msg.Metadata.Get(txoutbox.MetadataKey), e.msg.Metadata.Get(txoutbox.MetadataAttempt), e.msg.Payload)
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
func placeOrder(ctx context.Context, db *sql.DB, table string, publisher *txoutbox.Publisher, customer string, total int, rollback bool) (int, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit

	res, err := tx.ExecContext(ctx, "INSERT INTO "+table+" (customer, total) VALUES (?, ?)", customer, total) //nolint:gosec // the example's own table name
	if err != nil {
		return 0, err
	}
	id, err := res.LastInsertId()
	if err != nil {
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
		return 0, tx.Rollback()
	}
	return 2, tx.Commit()
}
