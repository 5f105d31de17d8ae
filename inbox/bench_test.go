package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/inbox"
)

// BenchmarkInbox is the cost per message of the inbox: the same handler
// (an order row and an outbox record, one transaction) run without the
// inbox, in a transaction of its own, and with it, one message after
// another. The two alternate message by message, so that both see the same
// load on a shared machine; without-ms/op and with-ms/op are their means,
// and ns/op is their sum. The difference is the inbox's insert.
//
//	go test -run '^$' -bench BenchmarkInbox -benchtime 300x -count 5 ./inbox/
func BenchmarkInbox(b *testing.B) {
	for _, mk := range []struct {
		name string
		new  func(t testing.TB) *backend
	}{
		{"postgres", func(t testing.TB) *backend { return newPostgres(t, false) }},
		{"mysql", newMySQL},
		{"sqlite", newSQLite},
	} {
		b.Run(mk.name, func(b *testing.B) {
			be := mk.new(b)
			var calls countMap
			in, err := inbox.New(inbox.Config{Consumer: "billing", Store: be.store})
			if err != nil {
				b.Fatal(err)
			}
			handlers := [2]message.HandlerFunc{ownTx(be, orderHandler(be, &calls)), in.Middleware(orderHandler(be, &calls))}
			msgs := make([]*message.Message, 2*b.N)
			for i := range msgs {
				msgs[i] = message.NewMessage(watermill.NewUUID(), []byte("{}"))
			}
			var took [2]time.Duration
			b.ResetTimer()
			for i := range b.N {
				for k, h := range handlers {
					start := time.Now()
					if _, err := h(msgs[2*i+k]); err != nil {
						b.Fatal(err)
					}
					took[k] += time.Since(start)
				}
			}
			b.ReportMetric(float64(took[0].Microseconds())/1000/float64(b.N), "without-ms/op")
			b.ReportMetric(float64(took[1].Microseconds())/1000/float64(b.N), "with-ms/op")
		})
	}
}

// ownTx runs h in a transaction of its own, as a handler does without the
// inbox.
func ownTx(be *backend, h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		var tx any
		var commit, rollback func() error
		if be.name == "postgres-pgx" {
			ptx, err := pool.Begin(ctx)
			if err != nil {
				return nil, err
			}
			tx, commit, rollback = ptx, func() error { return ptx.Commit(ctx) }, func() error { return ptx.Rollback(context.Background()) }
		} else {
			stx, err := be.db.BeginTx(ctx, nil)
			if err != nil {
				return nil, err
			}
			tx, commit, rollback = stx, stx.Commit, stx.Rollback
		}
		msg.SetContext(txoutbox.ContextWithTx(ctx, tx))
		defer msg.SetContext(ctx)
		out, err := h(msg)
		if err != nil {
			_ = rollback()
			return nil, err
		}
		return out, commit()
	}
}
