package brokers_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/txoutbox/txoutbox"
)

// OrderPlaced is the CQRS test's event.
type OrderPlaced struct {
	OrderID string `json:"order_id"`
	Seq     int    `json:"seq"`
}

// TestCQRSEventBus: ONE long-lived transactional publisher backs Watermill's
// cqrs.EventBus; a handler writes its row and publishes through the bus in one
// pgx transaction; a forwarder relays to a gochannel pub/sub where a cqrs
// EventProcessor receives the events. A context without a transaction is an
// error that writes nothing.
func TestCQRSEventBus(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	prefix := uniqueName("cqrs") + "."

	publisher, err := txoutbox.NewPublisher(f.store, txoutbox.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	marshaler := cqrs.JSONMarshaler{}
	topic := func(eventName string) string { return prefix + eventName }
	bus, err := cqrs.NewEventBusWithConfig(publisher, cqrs.EventBusConfig{
		GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) { return topic(p.EventName), nil },
		// The order id is the ordering key: one order's events stay in order.
		OnPublish: func(p cqrs.OnEventSendParams) error {
			p.Message.Metadata.Set(txoutbox.MetadataKey, p.Event.(*OrderPlaced).OrderID)
			return nil
		},
		Marshaler: marshaler,
	})
	if err != nil {
		t.Fatal(err)
	}

	// The consumer side: a gochannel pub/sub (the forwarder's target) and a
	// cqrs EventProcessor on a Router.
	// BlockPublishUntilSubscriberAck keeps order: without it gochannel hands
	// each message to its subscribers from a new goroutine.
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true, BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	t.Cleanup(func() { broker.Close() })
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	processor, err := cqrs.NewEventProcessorWithConfig(router, cqrs.EventProcessorConfig{
		GenerateSubscribeTopic: func(p cqrs.EventProcessorGenerateSubscribeTopicParams) (string, error) {
			return topic(p.EventName), nil
		},
		SubscriberConstructor: func(cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) { return broker, nil },
		Marshaler:             marshaler,
	})
	if err != nil {
		t.Fatal(err)
	}
	type got struct {
		event OrderPlaced
		uuid  string
		key   string
	}
	var mu sync.Mutex
	var handled []got
	if err := processor.AddHandlers(cqrs.NewEventHandler("record-order-placed", func(ctx context.Context, e *OrderPlaced) error {
		msg := cqrs.OriginalMessageFromCtx(ctx)
		mu.Lock()
		handled = append(handled, got{*e, msg.UUID, msg.Metadata.Get(txoutbox.MetadataKey)})
		mu.Unlock()
		return nil
	})); err != nil {
		t.Fatal(err)
	}
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-routerDone })
	<-router.Running()

	runForwarders(t, f.store, broker, 1, txoutbox.ForwarderConfig{PollMin: 10 * time.Millisecond, PollMax: 100 * time.Millisecond})

	// The command side: each call is one business transaction.
	placeOrder := func(orderID string, seq int, rollback bool) error {
		tx, err := f.pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "INSERT INTO "+f.schema+".orders (key, seq) VALUES ($1, $2)", orderID, seq); err != nil {
			return err
		}
		if err := bus.Publish(txoutbox.ContextWithTx(ctx, tx), &OrderPlaced{OrderID: orderID, Seq: seq}); err != nil {
			return fmt.Errorf("publish event: %w", err)
		}
		if rollback {
			return tx.Rollback(ctx)
		}
		return tx.Commit(ctx)
	}
	want := map[string][]int{}
	total := 0
	for i := range 30 {
		orderID := fmt.Sprintf("order-%d", i%3)
		seq := len(want[orderID])
		rollback := i%4 == 3
		if err := placeOrder(orderID, seq, rollback); err != nil {
			t.Fatal(err)
		}
		if !rollback {
			want[orderID] = append(want[orderID], seq)
			total++
		}
	}

	waitFor(t, 30*time.Second, fmt.Sprintf("%d events handled", total), func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(handled) >= total
	})
	mu.Lock()
	byKey := map[string][]int{}
	for _, h := range handled {
		if h.key != h.event.OrderID {
			t.Errorf("event %s: key %q, want %q", h.uuid, h.key, h.event.OrderID)
		}
		byKey[h.event.OrderID] = append(byKey[h.event.OrderID], h.event.Seq)
	}
	mu.Unlock()
	for id, seqs := range want {
		if fmt.Sprint(byKey[id]) != fmt.Sprint(seqs) {
			t.Errorf("order %s: handled seqs %v, want %v (each committed once, in order, rolled-back ones never)", id, byKey[id], seqs)
		}
	}

	t.Run("no transaction in the context", func(t *testing.T) {
		// The records of order-x, pending or already delivered (the
		// forwarders run meanwhile, and ack the earlier orders' records
		// between two counts of the whole table).
		count := func() (n int) {
			q := fmt.Sprintf("SELECT (SELECT count(*) FROM %s WHERE key = $1) + (SELECT count(*) FROM %s WHERE key = $1)", f.store.Table(), f.store.DeliveredTable())
			if err := f.pool.QueryRow(ctx, q, "order-x").Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
		err := bus.Publish(ctx, &OrderPlaced{OrderID: "order-x"})
		if !errors.Is(err, txoutbox.ErrNoTransaction) {
			t.Fatalf("Publish without a transaction: %v, want an error wrapping ErrNoTransaction", err)
		}
		if n := count(); n != 0 {
			t.Errorf("the outbox holds %d records of order-x: something was written", n)
		}
	})
}
