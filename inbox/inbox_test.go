package inbox_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/inbox"
	"github.com/txoutbox/txoutbox/storage"
)

func newInbox(t *testing.T, b *backend, consumer string) *inbox.Inbox {
	t.Helper()
	in, err := inbox.New(inbox.Config{Consumer: consumer, Store: b.store})
	if err != nil {
		t.Fatal(err)
	}
	return in
}

// TestRedeliveryAfterCommitBeforeAck: a consumer commits a message's effects
// and dies before its ack reaches RabbitMQ (the delivery is nacked back to
// the queue instead); the redelivery is acked without running the handler,
// so the order row and the follow-up event exist once.
func TestRedeliveryAfterCommitBeforeAck(t *testing.T) {
	t.Parallel()
	br := newBroker(t)
	eachBackend(t, func(t *testing.T, b *backend) {
		queue := br.queue(t, "orders_created")
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		msgs, err := br.subscriber(t).Subscribe(ctx, queue)
		if err != nil {
			t.Fatal(err)
		}
		sent := message.NewMessage(watermill.NewUUID(), []byte(`{"order":1}`))
		if err := br.publisher(t).Publish(queue, sent); err != nil {
			t.Fatal(err)
		}
		var calls countMap
		h := newInbox(t, b, "billing").Middleware(orderHandler(b, &calls))

		first := next(t, msgs, 30*time.Second)
		if first.UUID != sent.UUID {
			t.Fatalf("received UUID %q, published %q", first.UUID, sent.UUID)
		}
		if _, err := h(first); err != nil {
			t.Fatal(err)
		}
		first.Nack() // the ack never arrives: RabbitMQ delivers it again

		again := next(t, msgs, 30*time.Second)
		if again.UUID != sent.UUID {
			t.Fatalf("redelivered UUID %q, published %q", again.UUID, sent.UUID)
		}
		if _, err := h(again); err != nil {
			t.Fatalf("redelivery: %v", err)
		}
		again.Ack()
		if n := calls.get(sent.UUID); n != 1 {
			t.Fatalf("handler ran %d times, want 1", n)
		}
		if n := b.orderRows(t)[sent.UUID]; n != 1 {
			t.Fatalf("%d order rows, want 1", n)
		}
		if n := b.outboxRows(t)[sent.UUID]; n != 1 {
			t.Fatalf("%d outbox records, want 1", n)
		}
	})
}

// TestRouterRetryRecovererPoison runs the inbox innermost in a Watermill
// router over RabbitMQ, under Recoverer, PoisonQueue and Retry: a handler
// that panics, then fails, then succeeds writes its row once; a handler
// that always fails sends its message to the poison queue with nothing
// written, and its inbox entry rolled back too; a message without a UUID
// goes to the poison queue without reaching the handler.
func TestRouterRetryRecovererPoison(t *testing.T) {
	t.Parallel()
	br := newBroker(t)
	eachBackend(t, func(t *testing.T, b *backend) {
		queue, poison := br.queue(t, "orders_created"), br.queue(t, "orders_poison")
		pub := br.publisher(t)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		poisoned, err := br.subscriber(t).Subscribe(ctx, poison)
		if err != nil {
			t.Fatal(err)
		}

		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		pq, err := middleware.PoisonQueue(pub, poison)
		if err != nil {
			t.Fatal(err)
		}
		r.AddMiddleware(middleware.Recoverer, pq,
			middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}.Middleware)

		var calls countMap
		const (
			flaky   = "flaky"
			broken  = "broken"
			healthy = "healthy"
		)
		inner := orderHandler(b, &calls)
		handler := func(msg *message.Message) ([]*message.Message, error) {
			out, err := inner(msg) // the row is written, then:
			if err != nil {
				return out, err
			}
			switch kind := string(msg.Payload); {
			case kind == broken:
				return nil, errors.New("broken for ever")
			case kind == flaky && calls.get(msg.UUID) == 1:
				panic("flaky handler panics on its first call")
			case kind == flaky && calls.get(msg.UUID) == 2:
				return nil, errors.New("flaky handler fails on its second call")
			}
			return out, nil
		}
		h := r.AddConsumerHandler("billing", queue, br.subscriber(t), func(msg *message.Message) error {
			_, err := handler(msg)
			return err
		})
		h.AddMiddleware(newInbox(t, b, "billing").Middleware)
		go func() { _ = r.Run(ctx) }()
		<-r.Running()
		t.Cleanup(func() { r.Close() })

		msgs := map[string]*message.Message{
			flaky:     message.NewMessage(watermill.NewUUID(), []byte(flaky)),
			broken:    message.NewMessage(watermill.NewUUID(), []byte(broken)),
			healthy:   message.NewMessage(watermill.NewUUID(), []byte(healthy)),
			"no-uuid": message.NewMessage("", []byte(healthy)),
		}
		for _, m := range msgs {
			if err := pub.Publish(queue, m); err != nil {
				t.Fatal(err)
			}
		}
		// watermill-amqp carries the UUID in a header; the message without
		// one arrives with an empty UUID, and the poison queue keeps it so.
		got := map[string]string{}
		for range 2 {
			m := next(t, poisoned, 30*time.Second)
			got[string(m.Payload)+"/"+m.UUID] = m.Metadata.Get(middleware.ReasonForPoisonedKey)
			m.Ack()
		}
		if _, ok := got[broken+"/"+msgs[broken].UUID]; !ok {
			t.Fatalf("poison queue got %v, want the broken message", got)
		}
		if reason, ok := got[healthy+"/"]; !ok || reason != inbox.ErrNoUUID.Error() {
			t.Fatalf("poison queue got %v, want the message without a UUID, poisoned for %q", got, inbox.ErrNoUUID)
		}
		awaitTrue(t, "the flaky and healthy orders", 30*time.Second, func() bool {
			rows := b.orderRows(t)
			return rows[msgs[flaky].UUID] > 0 && rows[msgs[healthy].UUID] > 0
		})
		r.Close()
		rows, events := b.orderRows(t), b.outboxRows(t)
		for kind, want := range map[string]int{flaky: 1, healthy: 1, broken: 0} {
			u := msgs[kind].UUID
			if rows[u] != want || events[u] != want {
				t.Errorf("%s message: %d order rows and %d outbox records, want %d of each", kind, rows[u], events[u], want)
			}
		}
		if n := calls.get(msgs[flaky].UUID); n != 3 {
			t.Errorf("flaky handler ran %d times, want 3", n)
		}
		if n := calls.get(msgs[broken].UUID); n != 4 {
			t.Errorf("broken handler ran %d times, want 4 (1 + 3 retries)", n)
		}
		if n := calls.get(""); n != 0 {
			t.Errorf("the handler ran %d times for the message without a UUID", n)
		}
	})
}

// TestRacingConsumers: two instances of a consumer get one UUID at once.
// The second waits on the first's entry; when the first commits, the second
// acks without running the handler; when the first rolls back, the second
// processes the message. Either way one row.
func TestRacingConsumers(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, b *backend) {
		for _, firstFails := range []bool{false, true} {
			var calls countMap
			inner := orderHandler(b, &calls)
			entered := make(chan struct{}, 2)
			release := make(chan struct{})
			var releaseOnce sync.Once
			// A failed check must not leave the first instance holding its
			// transaction: the backend's clean-up would wait for it.
			t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) })
			var failed atomic.Bool
			h := newInbox(t, b, "billing").Middleware(func(msg *message.Message) ([]*message.Message, error) {
				entered <- struct{}{}
				out, err := inner(msg)
				<-release
				if firstFails && failed.CompareAndSwap(false, true) {
					return nil, errors.New("first instance fails")
				}
				return out, err
			})
			uuid := watermill.NewUUID()
			errs := make(chan error, 2)
			run := func() {
				_, err := h(message.NewMessage(uuid, []byte("x")))
				errs <- err
			}
			go run()
			<-entered // the first holds its entry
			go run()
			if b.waitsForLock != nil {
				awaitTrue(t, "the second instance to wait for the first's entry", 30*time.Second, func() bool {
					select {
					case err := <-errs:
						t.Fatalf("the second instance returned (%v) while the first held the message", err)
					default:
					}
					w, err := b.waitsForLock(context.Background())
					if err != nil {
						t.Fatal(err)
					}
					return w
				})
			}
			select {
			case <-entered:
				t.Fatal("the second instance ran the handler while the first held the message")
			default:
			}
			releaseOnce.Do(func() { close(release) })
			e1, e2 := <-errs, <-errs
			wantCalls, errCount := 1, 0
			if firstFails {
				wantCalls, errCount = 2, 1
			}
			if n := btoi(e1 != nil) + btoi(e2 != nil); n != errCount {
				t.Fatalf("first fails %v: errors %v and %v", firstFails, e1, e2)
			}
			if n := calls.get(uuid); n != wantCalls {
				t.Fatalf("first fails %v: handler ran %d times, want %d", firstFails, n, wantCalls)
			}
			if n := b.orderRows(t)[uuid]; n != 1 {
				t.Fatalf("first fails %v: %d order rows, want 1", firstFails, n)
			}
		}
	})
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestConsumersAreSeparate: a message processed by one consumer is still
// processed by another; and a handler error rolls back the handler's row
// and the entry, so the next delivery runs it again.
func TestConsumersAreSeparate(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, b *backend) {
		var calls countMap
		inner := orderHandler(b, &calls)
		fail := true
		billing := newInbox(t, b, "billing").Middleware(func(msg *message.Message) ([]*message.Message, error) {
			out, err := inner(msg)
			if err == nil && fail {
				fail = false
				return nil, errors.New("fails once")
			}
			return out, err
		})
		shipping := newInbox(t, b, "shipping").Middleware(inner)
		uuid := watermill.NewUUID()
		if _, err := billing(message.NewMessage(uuid, nil)); err == nil {
			t.Fatal("the failing handler's error did not come back")
		}
		for _, h := range []message.HandlerFunc{billing, shipping, billing, shipping} {
			if _, err := h(message.NewMessage(uuid, nil)); err != nil {
				t.Fatal(err)
			}
		}
		if n := calls.get(uuid); n != 3 {
			t.Fatalf("handler ran %d times, want 3 (billing twice, shipping once)", n)
		}
		if n := b.orderRows(t)[uuid]; n != 2 {
			t.Fatalf("%d order rows, want 2 (one per consumer)", n)
		}
	})
}

// TestPrune deletes the consumer's entries older than the retention, in
// batches, and neither newer ones nor another consumer's; a message whose
// entry was pruned is processed again.
func TestPrune(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, b *backend) {
		ctx := context.Background()
		old := time.Now().Add(-48 * time.Hour)
		record := func(consumer, uuid string, at time.Time) {
			tx, seen, err := b.store.BeginInbox(ctx, storage.InboxParams{Consumer: consumer, UUID: uuid, ReceivedAt: at})
			if err != nil || seen {
				t.Fatalf("BeginInbox: seen %v, %v", seen, err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}
		for i := range 7 {
			record("billing", "old-"+string(rune('a'+i)), old)
			record("shipping", "old-"+string(rune('a'+i)), old)
		}
		record("billing", "new", time.Now())
		in, err := inbox.New(inbox.Config{Consumer: "billing", Store: b.store, Retention: 24 * time.Hour, PruneBatch: 3})
		if err != nil {
			t.Fatal(err)
		}
		n, err := in.Prune(ctx)
		if err != nil || n != 7 {
			t.Fatalf("Prune = %d, %v; want 7", n, err)
		}
		st, err := in.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Entries != 8 || st.Oldest.After(old.Add(time.Millisecond)) || st.Oldest.Before(old.Add(-time.Millisecond)) {
			t.Fatalf("Stats = %+v, want 8 entries, the oldest at %s", st, old)
		}
		var calls countMap
		h := in.Middleware(orderHandler(b, &calls))
		for _, u := range []string{"old-a", "new"} {
			if _, err := h(message.NewMessage(u, nil)); err != nil {
				t.Fatal(err)
			}
		}
		if calls.get("old-a") != 1 || calls.get("new") != 0 {
			t.Fatalf("calls %v: want the pruned message processed again, the kept one not", calls.m)
		}
	})
}

// TestBadInput: a message the inbox cannot record fails before the handler,
// with an error naming why; a bad config names its field.
func TestBadInput(t *testing.T) {
	t.Parallel()
	b := newSQLite(t)
	var calls countMap
	h := newInbox(t, b, "billing").Middleware(orderHandler(b, &calls))
	for _, tc := range []struct {
		uuid string
		want error
	}{
		{"", inbox.ErrNoUUID},
		{string(make([]byte, 256)), inbox.ErrInvalidUUID},
		{"a\x00b", inbox.ErrInvalidUUID},
		{"\xff", inbox.ErrInvalidUUID},
	} {
		if _, err := h(message.NewMessage(tc.uuid, nil)); !errors.Is(err, tc.want) {
			t.Errorf("UUID %q: %v, want %v", tc.uuid, err, tc.want)
		}
	}
	if len(calls.m) != 0 || len(b.orderRows(t)) != 0 {
		t.Fatalf("bad messages reached the handler: %v", calls.m)
	}
	for _, c := range []inbox.Config{
		{Store: b.store},
		{Consumer: "x\x00", Store: b.store},
		{Consumer: "billing"},
		{Consumer: "billing", Store: b.store, PruneBatch: -1},
	} {
		if _, err := inbox.New(c); err == nil {
			t.Errorf("New(%+v) accepted", c)
		}
	}
	_ = txoutbox.ContextWithTx
}
