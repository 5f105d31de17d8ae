package txoutbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox/storage"
)

// MaxPayloadBytesDefault is the default of [PublisherConfig.MaxPayloadBytes].
const MaxPayloadBytesDefault = 1 << 20

// NoPayloadLimit turns the payload limit off when set as
// [PublisherConfig.MaxPayloadBytes].
const NoPayloadLimit = -1

// Errors the transactional publisher returns; nothing is written when it
// returns one.
var (
	// ErrNoTransaction: a context-bound publisher got a message whose context
	// holds no transaction (see ContextWithTx). It never autocommits.
	ErrNoTransaction = errors.New("no transaction in the message context (use txoutbox.ContextWithTx)")
	// ErrPublisherClosed: Publish after Close.
	ErrPublisherClosed = errors.New("publisher is closed")
	// ErrEmptyTopic: Publish with an empty topic.
	ErrEmptyTopic = errors.New("empty topic")
	// ErrPayloadTooLarge: a payload over PublisherConfig.MaxPayloadBytes.
	ErrPayloadTooLarge = errors.New("payload too large")
	// ErrInvalidMessage: a message that cannot be stored (a nil message, an
	// empty UUID, text that is not valid UTF-8 or holds NUL bytes, metadata
	// the forwarder reserves, a failing KeyFunc, ...).
	ErrInvalidMessage = errors.New("invalid message")
)

// PublisherConfig configures a [Publisher].
type PublisherConfig struct {
	// KeyMetadata is the metadata key the ordering key is read from when KeyFunc
	// is nil. Defaults to MetadataKey ("txoutbox_key"). Messages without it are
	// keyless: independent of each other.
	KeyMetadata string
	// KeyFunc, if set, computes the ordering key of each message instead.
	KeyFunc func(topic string, msg *message.Message) (string, error)
	// MaxPayloadBytes rejects larger payloads. Defaults to 1 MiB; NoPayloadLimit
	// turns the check off.
	MaxPayloadBytes int
	// Decorate, if set, is called on each message before it is stored; it may
	// add metadata (the tracing middleware stores the producer's trace context
	// this way).
	Decorate func(msg *message.Message) error
}

func (c *PublisherConfig) setDefaults() {
	c.KeyMetadata = cmp.Or(c.KeyMetadata, MetadataKey)
	c.MaxPayloadBytes = cmp.Or(c.MaxPayloadBytes, MaxPayloadBytesDefault)
}

// Validate checks a configuration after defaults were applied.
func (c PublisherConfig) Validate() error {
	if c.MaxPayloadBytes <= 0 && c.MaxPayloadBytes != NoPayloadLimit {
		return fmt.Errorf("invalid publisher config: MaxPayloadBytes must be > 0 or NoPayloadLimit, got %d", c.MaxPayloadBytes)
	}
	return nil
}

// Publisher is the transactional Watermill publisher: Publish writes one outbox
// record per message through a database transaction and never talks to a
// broker. If the transaction rolls back, nothing is ever published.
//
// A publisher from NewPublisher finds the transaction in each message's context
// (put there with ContextWithTx), so one long-lived publisher can be handed to
// Watermill's cqrs.EventBus or any code that takes a message.Publisher. Bind
// returns a publisher bound to one transaction, cheap to make per transaction.
type Publisher struct {
	inserter storage.Inserter
	config   *PublisherConfig
	tx       any // nil: take it from the message context
	closed   atomic.Bool
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher returns a publisher that writes through inserter (a SQL storage
// such as postgres.Storage or sqlite.Storage) in the transaction found in each
// message's context.
func NewPublisher(inserter storage.Inserter, config PublisherConfig) (*Publisher, error) {
	if inserter == nil {
		return nil, errors.New("txoutbox: nil inserter (try a postgres.Storage or sqlite.Storage)")
	}
	config.setDefaults()
	if err := config.Validate(); err != nil {
		return nil, err
	}
	return &Publisher{inserter: inserter, config: &config}, nil
}

// NewTxPublisher returns a publisher bound to tx; shorthand for NewPublisher
// followed by Bind.
func NewTxPublisher(inserter storage.Inserter, tx any, config PublisherConfig) (*Publisher, error) {
	p, err := NewPublisher(inserter, config)
	if err != nil {
		return nil, err
	}
	return p.Bind(tx), nil
}

// Bind returns a publisher that writes through tx (for example a pgx.Tx or a
// *sql.Tx), whatever the messages' contexts hold. It shares p's configuration
// and costs one small allocation.
func (p *Publisher) Bind(tx any) *Publisher {
	return &Publisher{inserter: p.inserter, config: p.config, tx: tx}
}

type txKey struct{}

// ContextWithTx returns a context that carries tx, for a publisher from
// NewPublisher: set it on the message (msg.SetContext) or pass it to
// cqrs.EventBus.Publish, which does.
func ContextWithTx(ctx context.Context, tx any) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}

// TxFromContext returns the transaction ContextWithTx put into ctx.
func TxFromContext(ctx context.Context) (any, bool) {
	tx := ctx.Value(txKey{})
	return tx, tx != nil
}

// Publish writes one outbox record per message in one round trip. It validates
// every message first and writes nothing if any is invalid: a nil message, or
// metadata named MetadataOutboxID, MetadataAttempt or MetadataCreatedAt
// (reserved: the forwarder sets them), is an error wrapping ErrInvalidMessage.
// MetadataKey is not reserved: it is how producers set the ordering key.
// MetadataDeliverAt (or Watermill's delay metadata) delays the record's
// delivery; a value that is not an RFC 3339 time is an error wrapping
// ErrInvalidMessage.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	if p.closed.Load() {
		return ErrPublisherClosed
	}
	if topic == "" {
		return ErrEmptyTopic
	}
	if !validText(topic) {
		return fmt.Errorf("%w: topic %q is not valid UTF-8 or holds a NUL byte", ErrInvalidMessage, topic)
	}
	if len(msgs) == 0 {
		return nil
	}
	for i, msg := range msgs {
		if msg == nil {
			return fmt.Errorf("publish to %q: message %d: %w: nil message", topic, i, ErrInvalidMessage)
		}
	}

	tx := p.tx
	ctx := msgs[0].Context()
	if tx == nil {
		var ok bool
		if tx, ok = TxFromContext(ctx); !ok {
			return fmt.Errorf("publish to %q: %w", topic, ErrNoTransaction)
		}
	}

	records := make([]storage.Record, len(msgs))
	for i, msg := range msgs {
		if p.tx == nil && i > 0 {
			other, ok := TxFromContext(msg.Context())
			if !ok {
				return fmt.Errorf("publish to %q: message %d (%s): %w", topic, i, msg.UUID, ErrNoTransaction)
			}
			if !sameTx(other, tx) {
				return fmt.Errorf("publish to %q: message %d (%s): %w: its context holds another transaction than message 0", topic, i, msg.UUID, ErrInvalidMessage)
			}
		}
		rec, err := p.record(topic, msg)
		if err != nil {
			return fmt.Errorf("publish to %q: message %d (%s): %w", topic, i, msg.UUID, err)
		}
		records[i] = rec
	}
	if err := p.inserter.Insert(ctx, tx, records); err != nil {
		return fmt.Errorf("publish to %q: insert %d outbox records: %w", topic, len(records), err)
	}
	return nil
}

func (p *Publisher) record(topic string, msg *message.Message) (storage.Record, error) {
	if p.config.Decorate != nil {
		if err := p.config.Decorate(msg); err != nil {
			return storage.Record{}, fmt.Errorf("%w: decorate: %w", ErrInvalidMessage, err)
		}
	}
	if msg.UUID == "" {
		return storage.Record{}, fmt.Errorf("%w: empty UUID (make messages with message.NewMessage(watermill.NewUUID(), payload))", ErrInvalidMessage)
	}
	if !validText(msg.UUID) {
		return storage.Record{}, fmt.Errorf("%w: UUID is not valid UTF-8 or holds a NUL byte", ErrInvalidMessage)
	}
	if limit := p.config.MaxPayloadBytes; limit != NoPayloadLimit && len(msg.Payload) > limit {
		return storage.Record{}, fmt.Errorf("%w: %d bytes, limit %d (PublisherConfig.MaxPayloadBytes)", ErrPayloadTooLarge, len(msg.Payload), limit)
	}
	var key string
	if p.config.KeyFunc != nil {
		var err error
		if key, err = p.config.KeyFunc(topic, msg); err != nil {
			return storage.Record{}, fmt.Errorf("%w: KeyFunc: %w", ErrInvalidMessage, err)
		}
	} else {
		key = msg.Metadata.Get(p.config.KeyMetadata)
	}
	if !validText(key) {
		return storage.Record{}, fmt.Errorf("%w: key is not valid UTF-8 or holds a NUL byte", ErrInvalidMessage)
	}
	var metadata map[string]string
	if len(msg.Metadata) > 0 {
		metadata = make(map[string]string, len(msg.Metadata))
		for k, v := range msg.Metadata {
			if reservedMetadata(k) {
				return storage.Record{}, fmt.Errorf("%w: metadata %q is reserved: the forwarder sets it on every message it publishes", ErrInvalidMessage, k)
			}
			if !validText(k) || !validText(v) {
				return storage.Record{}, fmt.Errorf("%w: metadata %q is not valid UTF-8 or holds a NUL byte", ErrInvalidMessage, k)
			}
			metadata[k] = v
		}
	}
	due, err := deliverAt(msg)
	if err != nil {
		return storage.Record{}, err
	}
	return storage.Record{
		UUID:     msg.UUID,
		Topic:    topic,
		Key:      key,
		Payload:  msg.Payload,
		Metadata: metadata,
		DueAt:    due,
	}, nil
}

// reservedMetadata reports whether k is a metadata name the forwarder sets
// itself; MetadataKey is not reserved: it is how producers set the key.
func reservedMetadata(k string) bool {
	return k == MetadataOutboxID || k == MetadataAttempt || k == MetadataCreatedAt
}

// sameTx reports whether a and b are the same transaction; a transaction type
// that is not comparable is never the same (rather than a panic).
func sameTx(a, b any) (same bool) {
	defer func() {
		if recover() != nil {
			same = false
		}
	}()
	return a == b
}

// validText reports whether s can be stored as SQL text: valid UTF-8 without NUL.
func validText(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return false
		}
	}
	return true
}

// Close makes further Publish calls fail with ErrPublisherClosed. It does not
// touch any transaction. Closing a publisher does not close those Bind made
// from it.
func (p *Publisher) Close() error {
	p.closed.Store(true)
	return nil
}
