package brokers_test

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/txoutbox/txoutbox"
)

// TestNATSJetStream: events committed with their orders reach a JetStream
// stream through watermill-nats with TrackMsgId, so the outbox UUID is the
// Nats-Msg-Id and a redelivery of the same record is dropped by the stream's
// duplicate window.
func TestNATSJetStream(t *testing.T) {
	t.Parallel()
	url := need(t, "NATS_URL", "nats://127.0.0.1:4222",
		"start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log")
	f := newFixture(t)
	subject := uniqueName("orders")

	// The stream is created up front (watermill-nats' AutoProvision would
	// look it up on every publish).
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := nc.JetStream()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.AddStream(&nats.StreamConfig{Name: subject, Subjects: []string{subject}, Duplicates: time.Minute}); err != nil {
		t.Fatalf("JetStream not enabled? (nats-server needs -js): %v", err)
	}
	t.Cleanup(func() { js.DeleteStream(subject) })

	jsCfg := wmnats.JetStreamConfig{
		TrackMsgId:       true,
		SubscribeOptions: []nats.SubOpt{nats.DeliverAll(), nats.AckExplicit()},
	}
	pub, err := wmnats.NewPublisher(wmnats.PublisherConfig{URL: url, JetStream: jsCfg}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	sub, err := wmnats.NewSubscriber(wmnats.SubscriberConfig{URL: url, JetStream: jsCfg, CloseTimeout: time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	msgs, err := sub.Subscribe(ctx, subject)
	if err != nil {
		t.Fatal(err)
	}

	start := time.Now()
	committed, rolledBack := f.produce(t, subject, 4, 5, 25)
	runForwarders(t, f.store, pub, 2, txoutbox.ForwarderConfig{
		BatchSize: 20, Concurrency: 4, PollMin: 10 * time.Millisecond, PollMax: 100 * time.Millisecond,
	})
	got := collect(t, msgs, len(committed), time.Minute, func(m *message.Message) received {
		return received{UUID: m.UUID, Key: m.Metadata.Get(txoutbox.MetadataKey), Metadata: maps.Clone(m.Metadata), Payload: m.Payload}
	})
	t.Logf("%d committed events (%d rolled back) produced and consumed from JetStream in %s", len(committed), len(rolledBack), time.Since(start))
	checkDelivery(t, committed, rolledBack, got)

	// The stream itself holds each key's events in order.
	var stored []received
	for seq := uint64(1); seq <= uint64(len(committed)); seq++ {
		m, err := js.GetMsg(subject, seq)
		if err != nil {
			t.Fatalf("stream message %d: %v", seq, err)
		}
		md := map[string]string{}
		for k := range m.Header {
			md[k] = m.Header.Get(k)
		}
		stored = append(stored, received{UUID: m.Header.Get(wmnats.WatermillUUIDHdr), Key: md[txoutbox.MetadataKey], Metadata: md, Payload: m.Data})
	}
	t.Log("checking the stream's order")
	checkDelivery(t, committed, rolledBack, stored)

	// The stream holds each committed event once, and its Nats-Msg-Id is the
	// outbox UUID.
	first, err := js.GetMsg(subject, 1)
	if err != nil {
		t.Fatal(err)
	}
	if id, want := first.Header.Get(nats.MsgIdHdr), first.Header.Get(wmnats.WatermillUUIDHdr); id == "" || id != want {
		t.Errorf("Nats-Msg-Id %q, want the message UUID %q", id, want)
	}
	// A redelivery (as after a crash between publish and ack) keeps its UUID
	// and is dropped by the stream.
	again := message.NewMessage(first.Header.Get(wmnats.WatermillUUIDHdr), first.Data)
	if err := pub.Publish(subject, again); err != nil {
		t.Fatal(err)
	}
	info, err := js.StreamInfo(subject)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != uint64(len(committed)) {
		t.Errorf("stream holds %d messages, want %d (one per committed event)", info.State.Msgs, len(committed))
	}
}
