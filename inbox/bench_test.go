package inbox_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/inbox"
)

// BenchmarkInbox is the cost per message of the inbox: the same handler
// (an order row and an outbox record, one transaction) run without the
// inbox, in a transaction of its own, and with it, one message after
// another. The difference is the inbox's insert (and, on PostgreSQL, its
// index entries).
//
//	flock /tmp/txoutbox-measure.lock go test -run '^$' -bench BenchmarkInbox -benchtime 2000x -count 3 ./inbox/
func BenchmarkInbox(b *testing.B) {
	for _, mk := range []struct {
		name string
		new  func(t testing.TB) *backend
	}{
		{"postgres", func(t testing.TB) *backend { return newPostgres(t, false) }},
		{"mysql", newMySQL},
		{"sqlite", newSQLite},
	} {
		for _, withInbox := range []bool{false, true} {
			name := mk.name + "/without"
			if withInbox {
				name = mk.name + "/with"
			}
			b.Run(name, func(b *testing.B) {
				be := mk.new(b)
				var calls countMap
				h := orderHandler(be, &calls)
				if withInbox {
					in, err := inbox.New(inbox.Config{Consumer: "billing", Store: be.store})
					if err != nil {
						b.Fatal(err)
					}
					h = in.Middleware(h)
				} else {
					h = ownTx(b, be, h)
				}
				msgs := make([]*message.Message, b.N)
				for i := range msgs {
					msgs[i] = message.NewMessage(watermill.NewUUID(), []byte("{}"))
				}
				b.ResetTimer()
				for i := range b.N {
					if _, err := h(msgs[i]); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// ownTx runs h in a transaction of its own, as a handler does without the
// inbox.
func ownTx(b *testing.B, be *backend, h message.HandlerFunc) message.HandlerFunc {
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
