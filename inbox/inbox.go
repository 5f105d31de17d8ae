package inbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
)

// Defaults of [Config].
const (
	// RetentionDefault is the default of [Config.Retention].
	RetentionDefault = 7 * 24 * time.Hour
	// PruneIntervalDefault is the default of [Config.PruneInterval].
	PruneIntervalDefault = time.Minute
	// PruneBatchDefault is the default of [Config.PruneBatch].
	PruneBatchDefault = 1000
	// MaxNameBytes bounds a consumer name and a message UUID: the SQL
	// storages keep both in columns of 255 bytes.
	MaxNameBytes = 255
)

// Errors the middleware returns for a message it cannot record. They are
// permanent: the same message fails the same way however often it comes
// back, so route them to a poison queue.
var (
	// ErrNoUUID: the message has an empty UUID, so nothing identifies its
	// redeliveries. The handler is not called.
	ErrNoUUID = errors.New("inbox: message has no UUID")
	// ErrInvalidUUID: the UUID is longer than MaxNameBytes, not valid UTF-8,
	// or holds a NUL byte. The handler is not called.
	ErrInvalidUUID = errors.New("inbox: invalid message UUID")
)

// Config configures an [Inbox].
type Config struct {
	// Consumer names the consumer: a message is processed once per consumer
	// name, so two handlers that each must see every message need two names,
	// and every instance of one handler shares one. Required; at most
	// MaxNameBytes of valid UTF-8.
	Consumer string
	// Store is the inbox table, in the database the handler writes to: a
	// SQL storage's Inbox (postgres.Storage.Inbox for a pgx pool,
	// postgres.Storage.InboxDB for database/sql, mysql.Storage.Inbox,
	// sqlite.Storage.Inbox). Required.
	Store storage.InboxStore
	// Retention is how long an entry is kept: a message redelivered later
	// than that after it was processed is processed again. Keep it well
	// above the longest redelivery your broker and the outbox allow (the
	// forwarder's retries, a consumer down for a weekend). Defaults to
	// RetentionDefault (7 days).
	Retention time.Duration
	// PruneInterval is how often [Inbox.Run] deletes expired entries.
	// Defaults to PruneIntervalDefault (1 minute).
	PruneInterval time.Duration
	// PruneBatch bounds the entries one delete statement removes, so that
	// pruning never holds many locks at once. Defaults to
	// PruneBatchDefault (1000).
	PruneBatch int
	// Logger logs pruning errors. Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *Config) setDefaults() {
	c.Retention = cmp.Or(c.Retention, RetentionDefault)
	c.PruneInterval = cmp.Or(c.PruneInterval, PruneIntervalDefault)
	c.PruneBatch = cmp.Or(c.PruneBatch, PruneBatchDefault)
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate checks a configuration after defaults were applied.
func (c Config) Validate() error {
	switch {
	case c.Consumer == "":
		return errors.New("invalid inbox config: Consumer is empty (name the handler, e.g. \"billing.orders-created\")")
	case !validText(c.Consumer):
		return fmt.Errorf("invalid inbox config: Consumer %q is longer than %d bytes, not valid UTF-8 or holds a NUL byte", c.Consumer, MaxNameBytes)
	case c.Store == nil:
		return errors.New("invalid inbox config: Store is nil (try postgres.Storage.Inbox, mysql.Storage.Inbox or sqlite.Storage.Inbox)")
	case c.Retention < 0:
		return fmt.Errorf("invalid inbox config: Retention must be > 0, got %s", c.Retention)
	case c.PruneInterval < 0:
		return fmt.Errorf("invalid inbox config: PruneInterval must be > 0, got %s", c.PruneInterval)
	case c.PruneBatch < 0:
		return fmt.Errorf("invalid inbox config: PruneBatch must be > 0, got %d", c.PruneBatch)
	}
	return nil
}

func validText(s string) bool {
	if len(s) > MaxNameBytes || !utf8.ValidString(s) {
		return false
	}
	for i := range len(s) {
		if s[i] == 0 {
			return false
		}
	}
	return true
}

// Inbox processes each message once per consumer: see the package
// documentation. It is safe for concurrent use.
type Inbox struct {
	config Config
}

// New returns an inbox for config.
func New(config Config) (*Inbox, error) {
	config.setDefaults()
	if err := config.Validate(); err != nil {
		return nil, err
	}
	return &Inbox{config: config}, nil
}

// Middleware is the inbox as a Watermill handler middleware. For each
// message it begins a transaction on the store's database, records the
// message's UUID for the consumer in it, calls h with the transaction in
// the message's context (txoutbox.ContextWithTx: read it with
// txoutbox.TxFromContext, or publish through a txoutbox.Publisher from
// NewPublisher), and commits when h succeeds. The router acks after that.
//
//   - A UUID the consumer already committed: h is not called and the
//     message is acked.
//   - h returns an error or panics: the transaction rolls back, the entry
//     with it, and the error (or the panic) goes up, so the message is
//     nacked and Retry, PoisonQueue and Recoverer work as without the inbox.
//   - Another instance holds the same UUID in an open transaction: the
//     insert waits for it; when it commits the message is acked as seen,
//     when it rolls back this one processes it.
//   - The commit fails: the error goes up and the message is nacked; if
//     the commit did reach the database, the redelivery is acked as seen.
//
// Add it as the innermost middleware (the handler's own, after the
// router's), so that every retry is a fresh transaction. Messages h
// returns are published by the router after the commit, outside it: if
// that publish fails, the redelivery is acked as seen and they are lost.
// Publish through the outbox inside the transaction instead.
func (in *Inbox) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (_ []*message.Message, err error) {
		if msg.UUID == "" {
			return nil, ErrNoUUID
		}
		if !validText(msg.UUID) {
			return nil, fmt.Errorf("%w: %q is longer than %d bytes, not valid UTF-8 or holds a NUL byte", ErrInvalidUUID, msg.UUID, MaxNameBytes)
		}
		ctx := msg.Context()
		tx, seen, err := in.config.Store.BeginInbox(ctx, storage.InboxParams{
			Consumer: in.config.Consumer, UUID: msg.UUID, ReceivedAt: time.Now(),
		})
		if err != nil {
			return nil, fmt.Errorf("inbox %s: message %s: %w", in.config.Consumer, msg.UUID, err)
		}
		if seen {
			return nil, nil
		}
		committed := false
		defer func() {
			msg.SetContext(ctx)
			if !committed {
				// Also on a panic, which goes on up to Recoverer.
				_ = tx.Rollback(context.WithoutCancel(ctx))
			}
		}()
		msg.SetContext(txoutbox.ContextWithTx(ctx, tx.Tx()))
		out, err := h(msg)
		if err != nil {
			return out, err
		}
		if err := tx.Commit(ctx); err != nil {
			return nil, fmt.Errorf("inbox %s: commit message %s: %w", in.config.Consumer, msg.UUID, err)
		}
		committed = true
		return out, nil
	}
}

// Prune deletes the consumer's entries older than Retention, PruneBatch at a
// time, until none is left or ctx is done, and returns how many it deleted.
func (in *Inbox) Prune(ctx context.Context) (int64, error) {
	before := time.Now().Add(-in.config.Retention)
	var total int64
	for {
		n, err := in.config.Store.PruneInbox(ctx, storage.InboxPruneParams{
			Consumer: in.config.Consumer, Before: before, Limit: in.config.PruneBatch,
		})
		total += n
		if err != nil {
			return total, fmt.Errorf("inbox %s: %w", in.config.Consumer, err)
		}
		if n < int64(in.config.PruneBatch) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}

// Run prunes every PruneInterval (the first time at once) until ctx is
// done, then returns nil. Errors are logged and tried again at the next
// interval. Run it beside the router in every instance, or in one: a delete
// of entries another instance just deleted deletes nothing.
func (in *Inbox) Run(ctx context.Context) error {
	t := time.NewTicker(in.config.PruneInterval)
	defer t.Stop()
	for {
		n, err := in.Prune(ctx)
		if err != nil && ctx.Err() == nil {
			in.config.Logger.Error("Inbox prune failed", err, watermill.LogFields{"consumer": in.config.Consumer})
		} else if n > 0 {
			in.config.Logger.Debug("Inbox pruned", watermill.LogFields{"consumer": in.config.Consumer, "deleted": n})
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Stats reports the inbox table: its entries (every consumer) and when the
// oldest was received.
func (in *Inbox) Stats(ctx context.Context) (storage.InboxStats, error) {
	return in.config.Store.InboxStats(ctx)
}
