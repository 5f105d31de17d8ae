package brokers_test

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/txoutbox/txoutbox"
)

func amqpURL(t *testing.T) string {
	t.Helper()
	return need(t, "AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/", "rabbitmq-server -detached")
}

// deleteQueue removes a durable test queue so that runs leave nothing behind.
func deleteQueue(t *testing.T, url, queue string) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Logf("delete queue %s: %v", queue, err)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Logf("delete queue %s: %v", queue, err)
		return
	}
	if _, err := ch.QueueDelete(queue, false, false, false); err != nil {
		t.Logf("delete queue %s: %v", queue, err)
	}
}

// TestAMQP: events committed with their orders reach one durable RabbitMQ
// queue through watermill-amqp; per key in order, rolled-back ones never, UUID
// and metadata intact.
func TestAMQP(t *testing.T) {
	t.Parallel()
	url := amqpURL(t)
	f := newFixture(t)
	queue := uniqueName("txoutbox_orders")
	t.Cleanup(func() { deleteQueue(t, url, queue) })

	cfg := amqp.NewDurableQueueConfig(url)
	// The forwarder acks a record once Publish returns: with confirms that
	// means RabbitMQ has taken the message, so the next one of its key cannot
	// overtake it.
	cfg.Publish.ConfirmDelivery = true

	sub, err := amqp.NewSubscriber(cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	// Subscribing declares the queue; publishing to a queue that does not
	// exist yet would drop the messages.
	msgs, err := sub.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}

	pub, err := amqp.NewPublisher(cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })

	start := time.Now()
	committed, rolledBack := f.produce(t, queue, 4, 5, 25)
	runForwarders(t, f.store, pub, 2, txoutbox.ForwarderConfig{
		BatchSize: 20, Concurrency: 4, PollMin: 10 * time.Millisecond, PollMax: 100 * time.Millisecond,
	})
	got := collect(t, msgs, len(committed), time.Minute, func(m *message.Message) received {
		return received{UUID: m.UUID, Key: m.Metadata.Get(txoutbox.MetadataKey), Metadata: maps.Clone(m.Metadata), Payload: m.Payload}
	})
	t.Logf("%d committed events (%d rolled back) produced and consumed from RabbitMQ in %s", len(committed), len(rolledBack), time.Since(start))
	checkDelivery(t, committed, rolledBack, got)
}
