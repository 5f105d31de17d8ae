// Command cqrs backs Watermill's CQRS event bus with the outbox. ONE
// long-lived txoutbox publisher is handed to cqrs.EventBus; a command handler
// writes its row and publishes its events in one pgx transaction by passing
// txoutbox.ContextWithTx(ctx, tx) to EventBus.Publish. A forwarder relays the
// events to a Watermill pub/sub (Go channels here; any broker works), where a
// cqrs EventProcessor handles them.
//
// It places three orders (a fourth rolls back, and its event never reaches a
// handler), shows that publishing outside a transaction is refused, and exits
// once every committed event was handled.
//
//	DATABASE_URL=postgres://postgres@127.0.0.1:5432/test go run ./examples/cqrs
package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// OrderPlaced is the event the PlaceOrder command emits.
type OrderPlaced struct {
	OrderID string `json:"order_id"`
	Total   int    `json:"total"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "cqrs example:", err)
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
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS example_cqrs CASCADE; CREATE SCHEMA example_cqrs;
		CREATE TABLE example_cqrs.orders (id TEXT PRIMARY KEY, total INT NOT NULL)`); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA example_cqrs CASCADE`)
	outbox, err := postgres.New(pool, postgres.Config{Table: "example_cqrs.outbox", NotifyChannel: "example_cqrs_outbox"})
	if err != nil {
		return err
	}
	if err := outbox.CreateSchema(ctx); err != nil {
		return err
	}

	// The event bus publishes into the outbox, never to the broker.
	publisher, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
	if err != nil {
		return err
	}
	marshaler := cqrs.JSONMarshaler{}
	eventBus, err := cqrs.NewEventBusWithConfig(publisher, cqrs.EventBusConfig{
		GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) { return "events." + p.EventName, nil },
		// The order id is the ordering key: one order's events stay in order.
		OnPublish: func(p cqrs.OnEventSendParams) error {
			p.Message.Metadata.Set(txoutbox.MetadataKey, p.Event.(*OrderPlaced).OrderID)
			return nil
		},
		Marshaler: marshaler,
	})
	if err != nil {
		return err
	}

	// The consumer side: a pub/sub and a cqrs EventProcessor on a Router.
	// BlockPublishUntilSubscriberAck keeps gochannel in order.
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true, BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer broker.Close()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	processor, err := cqrs.NewEventProcessorWithConfig(router, cqrs.EventProcessorConfig{
		GenerateSubscribeTopic: func(p cqrs.EventProcessorGenerateSubscribeTopicParams) (string, error) {
			return "events." + p.EventName, nil
		},
		SubscriberConstructor: func(cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) { return broker, nil },
		Marshaler:             marshaler,
	})
	if err != nil {
		return err
	}
	handled := make(chan *OrderPlaced)
	if err := processor.AddHandlers(cqrs.NewEventHandler("notify-warehouse", func(ctx context.Context, e *OrderPlaced) error {
		handled <- e
		return nil
	})); err != nil {
		return err
	}
	routerCtx, stopRouter := context.WithCancel(ctx)
	defer stopRouter()
	go router.Run(routerCtx) //nolint:errcheck // it returns when routerCtx is cancelled; the example is about the publishing side
	<-router.Running()

	// The relay: outbox -> broker.
	forwarder, err := txoutbox.NewForwarder(outbox, broker, txoutbox.ForwarderConfig{}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	done := make(chan error, 2)
	go func() { done <- forwarder.Run(relayCtx) }()
	go func() { done <- outbox.Listen(relayCtx, forwarder.Wake) }()
	defer func() { stopRelay(); <-done; <-done }()

	// The command side.
	want := 0
	for i, total := range []int{42, 17, -1, 8} { // a negative total fails validation after the publish
		err := placeOrder(ctx, pool, eventBus, fmt.Sprintf("order-%d", i+1), total)
		if err != nil {
			fmt.Printf("order-%d rejected: %v (its event is rolled back with it)\n", i+1, err)
			continue
		}
		want++
	}
	// Outside a transaction the bus refuses to publish: no silent autocommit.
	if err := eventBus.Publish(ctx, &OrderPlaced{OrderID: "order-x"}); errors.Is(err, txoutbox.ErrNoTransaction) {
		fmt.Println("publish without a transaction refused:", err)
	} else {
		return fmt.Errorf("publish without a transaction: got %v, want ErrNoTransaction", err) //nolint:errorlint // err may be nil here, which %w would print as %!w(<nil>)
	}

	timeout := time.After(30 * time.Second)
	for got := 0; got < want; got++ {
		select {
		case e := <-handled:
			fmt.Printf("handled OrderPlaced %s total %d\n", e.OrderID, e.Total)
		case <-timeout:
			return fmt.Errorf("only %d of %d events handled", got, want)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	fmt.Printf("all %d committed events handled\n", want)
	return nil
}

// placeOrder is the command handler: the order row and its event commit
// together, or neither does.
func placeOrder(ctx context.Context, pool *pgxpool.Pool, eventBus *cqrs.EventBus, id string, total int) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) // no-op after Commit
	if _, err := tx.Exec(ctx, `INSERT INTO example_cqrs.orders VALUES ($1, $2)`, id, total); err != nil {
		return err
	}
	if err := eventBus.Publish(txoutbox.ContextWithTx(ctx, tx), &OrderPlaced{OrderID: id, Total: total}); err != nil {
		return err
	}
	if total < 0 {
		return errors.New("negative total")
	}
	return tx.Commit(ctx)
}
