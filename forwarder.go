package txoutbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox/storage"
)

// Metadata keys the forwarder sets on every message it hands to the target and
// to the middleware chain.
const (
	// MetadataKey holds the ordering key (absent for keyless records). The
	// transactional publisher also reads the key from it by default, and
	// PartitionKey returns it for Kafka's partitioning marshaler.
	MetadataKey = "txoutbox_key"
	// MetadataOutboxID holds the record's id in the outbox table.
	MetadataOutboxID = "txoutbox_id"
	// MetadataAttempt holds the attempt number, 1 for the first.
	MetadataAttempt = "txoutbox_attempt"
	// MetadataCreatedAt holds when the record was inserted, RFC 3339 in UTC.
	MetadataCreatedAt = "txoutbox_created_at"
)

// Errors the forwarder returns or records.
var (
	// ErrForwarderRunning is returned by Run when the forwarder is already
	// running.
	ErrForwarderRunning = errors.New("forwarder is already running")
	// ErrPublishTimeout is the recorded error of a publish that outran
	// PublishTimeout.
	ErrPublishTimeout = errors.New("publish timed out")
	// ErrPublishAbandoned is the recorded error of a publish still running when
	// the shutdown bound ran out.
	ErrPublishAbandoned = errors.New("publish abandoned at shutdown")
	// ErrTooManyAbandoned is returned by RunOnce when its claim was refused
	// because MaxAbandonedPublishes publishes of earlier runs still run in the
	// target, which ignored their context: it claimed nothing.
	ErrTooManyAbandoned = errors.New("too many publishes abandoned in the target")
	// ErrLeaseLost is logged when a group stops because its lease ran short
	// or was lost (an extension no longer found a record leased to this
	// forwarder): its untried records are released, never published.
	ErrLeaseLost = errors.New("lease lost or running out")
)

// PartitionKey returns the outbox ordering key of a message the forwarder
// publishes. Its signature is watermill-kafka's GeneratePartitionKey, so
// kafka.NewWithPartitioningMarshaler(txoutbox.PartitionKey) sends every record of
// one key to one partition.
func PartitionKey(_ string, msg *message.Message) (string, error) {
	return msg.Metadata.Get(MetadataKey), nil
}

// Delivery describes the record behind a message in the forwarder's publish
// chain. Middleware reads it with DeliveryFromContext(msg.Context()).
type Delivery struct {
	// Record is the claimed outbox record (Attempts counts this attempt).
	Record storage.Record
	// Topic is the topic the message is published to.
	Topic string
	// WorkerID is the forwarder's worker id.
	WorkerID string
	// MaxAttempts is the forwarder's MaxAttempts: a failure of this publish
	// dead-letters the record when Record.Attempts >= MaxAttempts.
	MaxAttempts int
}

type deliveryKey struct{}

// DeliveryFromContext returns the Delivery of a message in the forwarder's
// publish chain.
func DeliveryFromContext(ctx context.Context) (Delivery, bool) {
	d, ok := ctx.Value(deliveryKey{}).(*Delivery)
	if !ok {
		return Delivery{}, false
	}
	return *d, true
}

// RunOnceResult is what one RunOnce did.
type RunOnceResult struct {
	// Claimed counts records claimed.
	Claimed int
	// Published counts records published and acked.
	Published int
	// Nacked counts failed publishes scheduled for a retry.
	Nacked int
	// Released counts records given back untried: behind a failure of their
	// key, because the context was cancelled before their turn, or because
	// their lease ran short.
	Released int
	// DeadLettered counts records parked: out of attempts, or undecodable.
	DeadLettered int
	// Duration is how long RunOnce took.
	Duration time.Duration
}

// Forwarder is the relay: it claims leased batches from a storage, publishes
// them to a Watermill publisher and writes the outcome back. Any number of
// forwarders, in any number of processes, may run against one table.
type Forwarder struct {
	store   storage.Storage
	target  message.Publisher
	config  ForwarderConfig
	logger  watermill.LoggerAdapter
	handler message.HandlerFunc
	// holdOnDead: the storage holds a key on dead-letter
	// (storage.DeadLetterHolder), so the rest of a group is released, not
	// published, after a dead-letter.
	holdOnDead bool
	// drainer: the storage reports claims that drained it
	// (storage.DrainClaimer), by which a caught-up forwarder paces its
	// claims; nil otherwise.
	drainer storage.DrainClaimer
	// brk tells outages of the target, or of a topic of it, from bad
	// records (breaker.go).
	brk *breaker

	wake    chan struct{}
	running atomic.Bool
	// abandoned counts publishes that outlived their bound and still run in
	// the target; aside waits for them when Run returns.
	abandoned atomic.Int64
	aside     sync.WaitGroup
	// pruned counts the delivered records the retention deleted.
	pruned atomic.Int64
}

// NewForwarder returns a forwarder that relays records of store to target.
// config's zero fields take their defaults; a nil logger logs nothing.
func NewForwarder(store storage.Storage, target message.Publisher, config ForwarderConfig, logger watermill.LoggerAdapter) (*Forwarder, error) {
	if store == nil {
		return nil, errors.New("txoutbox: nil storage (try postgres.New or sqlite.New)")
	}
	if target == nil {
		return nil, errors.New("txoutbox: nil target publisher")
	}
	config.setDefaults()
	if err := config.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	logger = logger.With(watermill.LogFields{"worker_id": config.WorkerID})

	f := &Forwarder{
		store:  store,
		target: target,
		config: config,
		logger: logger,
		wake:   make(chan struct{}, 1),
	}
	if h, ok := store.(storage.DeadLetterHolder); ok {
		f.holdOnDead = h.HoldOnDeadLetter()
	}
	f.drainer, _ = store.(storage.DrainClaimer)
	f.brk = newBreaker(&f.config, logger, f.Wake)
	f.handler = f.publish
	for i := len(config.Middlewares) - 1; i >= 0; i-- {
		f.handler = config.Middlewares[i](f.handler)
	}
	return f, nil
}

// Config returns the forwarder's configuration with defaults applied.
func (f *Forwarder) Config() ForwarderConfig { return f.config }

// AbandonedPublishes returns how many publishes outlived PublishTimeout (or
// the shutdown bound) and still run in the target, which ignored their
// context. While there are MaxAbandonedPublishes of them the forwarder claims
// nothing. The metrics middleware exports it as a gauge.
func (f *Forwarder) AbandonedPublishes() int { return int(f.abandoned.Load()) }

// Wake cuts the current idle sleep short, for example when a LISTEN/NOTIFY
// listener sees new records. It never blocks.
func (f *Forwarder) Wake() {
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

// Run relays until ctx is cancelled. Work flows continuously: it claims as
// lanes free up (at most MaxInFlight records unsettled), publishes key groups
// in parallel, acks finished records in batches and renews the leases of
// records it still holds. When ctx is cancelled it stops claiming, lets
// in-flight publishes finish within ShutdownTimeout, releases what it claimed
// but did not try, and returns nil. Storage errors never end it: it logs them
// and waits StorageErrorDelay.
//
// Run waits up to ShutdownTimeout more for abandoned publishes (see
// AbandonedPublishes) before it returns; a target blocked for ever in
// Publish keeps those goroutines, at most MaxAbandonedPublishes+Concurrency
// of them, after Run returned: nothing can end a call that ignores its
// context.
func (f *Forwarder) Run(ctx context.Context) error {
	if !f.running.CompareAndSwap(false, true) {
		return ErrForwarderRunning
	}
	defer f.running.Store(false)
	if ctx.Err() != nil {
		return nil // stopped before it started: claim nothing
	}

	f.logger.Info("Forwarder started", nil)
	defer f.logger.Info("Forwarder stopped", nil)
	f.join(ctx)
	defer f.leave(ctx)
	defer f.waitAside()

	rctx, stopRetention := context.WithCancel(ctx)
	waitRetention := f.retain(rctx)
	defer waitRetention()
	defer stopRetention()

	s, cancel := f.newSession(ctx, false)
	defer cancel()
	s.run()
	return nil
}

// join tells a storage that tracks its claimers that this one is coming, so
// that the others leave it its share (storage.Membership). A failure is only
// logged: the first claim joins anyway.
func (f *Forwarder) join(ctx context.Context) {
	m, ok := f.store.(storage.Membership)
	if !ok {
		return
	}
	bctx, cancel := f.bookkeepingCtx(ctx)
	defer cancel()
	if err := m.Join(bctx, f.config.WorkerID); err != nil {
		f.logger.Error("Could not join the storage's workers; the first claim will", err, nil)
	}
}

// leave tells a storage that tracks its claimers that this one is gone, so
// the others take over its share at once (storage.Membership).
func (f *Forwarder) leave(ctx context.Context) {
	l, ok := f.store.(storage.Membership)
	if !ok {
		return
	}
	bctx, cancel := f.bookkeepingCtx(ctx)
	defer cancel()
	if err := l.Leave(bctx, f.config.WorkerID); err != nil {
		f.logger.Error("Could not leave the storage's workers; the others take over its share after a timeout", err, nil)
	}
}

// waitAside waits, at most ShutdownTimeout, for abandoned publishes.
func (f *Forwarder) waitAside() {
	done := make(chan struct{})
	go func() { f.aside.Wait(); close(done) }()
	t := time.NewTimer(f.config.ShutdownTimeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		f.logger.Error("Forwarder stopped with publishes still running in the target", ErrPublishAbandoned, watermill.LogFields{"abandoned": f.abandoned.Load()})
	}
}

// RunOnce claims one batch, publishes it key group by key group and writes
// every outcome back (published, acked, nacked, released or dead-lettered)
// before it returns: for cron jobs. Cancelling ctx stops it starting new
// publishes; the records it did not try are released before it returns. The
// error is a storage error of the claim or an ack, or ErrTooManyAbandoned
// when MaxAbandonedPublishes publishes of earlier runs still run in the
// target (it then claims nothing and returns at once); failed publishes are
// not errors.
func (f *Forwarder) RunOnce(ctx context.Context) (RunOnceResult, error) {
	start := time.Now()
	if err := ctx.Err(); err != nil {
		return RunOnceResult{}, nil
	}
	s, cancel := f.newSession(ctx, true)
	defer cancel()
	s.run()
	// A claim counts its worker as a member (storage.Membership): a cron
	// job's RunOnce, often with a fresh WorkerID each time, leaves at once
	// rather than holding a share of the keys until it times out.
	f.leave(ctx)
	res := s.result
	res.Duration = time.Since(start)
	f.logger.Trace("Forwarder RunOnce done", watermill.LogFields{
		"claimed": res.Claimed, "published": res.Published, "nacked": res.Nacked,
		"released": res.Released, "dead_lettered": res.DeadLettered, "duration": res.Duration,
	})
	return res, s.err
}

func (f *Forwarder) bookkeepingCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), f.config.BookkeepingTimeout)
}

// OutcomeKind is what became of a claimed record.
type OutcomeKind int

// The outcomes of a claimed record.
const (
	// OutcomePublished: published and acked (StorageErr: the ack failed).
	OutcomePublished OutcomeKind = iota + 1
	// OutcomeNacked: the publish failed; retried at RetryAt.
	OutcomeNacked
	// OutcomeReleased: given back untried (behind a failure of its key, at
	// shutdown, or with its lease running short); due again at RetryAt.
	OutcomeReleased
	// OutcomeDeadLettered: parked for good (out of attempts, undecodable).
	OutcomeDeadLettered
)

func (k OutcomeKind) String() string {
	switch k {
	case OutcomePublished:
		return "published"
	case OutcomeNacked:
		return "nacked"
	case OutcomeReleased:
		return "released"
	case OutcomeDeadLettered:
		return "dead_lettered"
	}
	return "unknown"
}

// Outcome reports what became of one record, after its write-back. It is
// passed to ForwarderConfig.OnOutcome.
type Outcome struct {
	Kind OutcomeKind
	// Record is the claimed record; do not keep or modify it.
	Record *storage.Record
	// Err is the publish error (nacked) or the reason (dead-lettered).
	Err error
	// RetryAt is when a nacked or released record is due again.
	RetryAt time.Time
	// StorageErr is set when the write-back itself failed; the record is then
	// recovered by lease expiry.
	StorageErr error
}

// publishOne runs one record through the middleware chain to the target. The
// message's context carries the publish deadline (now + PublishTimeout) for
// targets and middleware that honour it.
func (f *Forwarder) publishOne(parent context.Context, rec *storage.Record, now time.Time) error {
	msg := message.NewMessage(rec.UUID, rec.Payload)
	msg.Metadata = make(message.Metadata, len(rec.Metadata)+4)
	for k, v := range rec.Metadata {
		msg.Metadata[k] = v
	}
	msg.Metadata[MetadataOutboxID] = strconv.FormatInt(rec.ID, 10)
	msg.Metadata[MetadataAttempt] = strconv.Itoa(rec.Attempts)
	msg.Metadata[MetadataCreatedAt] = rec.CreatedAt.UTC().Format(time.RFC3339Nano)
	if rec.Key != "" {
		msg.Metadata[MetadataKey] = rec.Key
	}
	ctx := &deliveryContext{Context: parent, rec: rec, f: f}
	if f.config.PublishTimeout > 0 {
		ctx.deadline = now.Add(f.config.PublishTimeout)
		defer ctx.release()
	}
	msg.SetContext(ctx)
	return f.callHandler(msg)
}

// deliveryContext is the context of a message in the publish chain: it
// carries the record and the publish deadline in one small allocation (the
// Delivery is built only for middleware that asks for it). The timer behind
// the deadline is only made when someone waits on Done (a target or
// middleware that honours the context); the lane enforces the deadline either
// way.
type deliveryContext struct {
	context.Context // the session's publish context
	rec             *storage.Record
	f               *Forwarder
	deadline        time.Time // zero: no publish timeout

	once     sync.Once
	timed    context.Context
	cancel   context.CancelFunc
	released atomic.Bool
}

func (c *deliveryContext) Value(key any) any {
	if key == (deliveryKey{}) {
		return &Delivery{Record: *c.rec, Topic: c.rec.Topic, WorkerID: c.f.config.WorkerID, MaxAttempts: c.f.config.MaxAttempts}
	}
	return c.Context.Value(key)
}

func (c *deliveryContext) Deadline() (time.Time, bool) {
	if c.deadline.IsZero() {
		return c.Context.Deadline()
	}
	return c.deadline, true
}

func (c *deliveryContext) Done() <-chan struct{} {
	if c.deadline.IsZero() {
		return c.Context.Done()
	}
	c.once.Do(func() { c.timed, c.cancel = context.WithDeadline(c.Context, c.deadline) })
	return c.timed.Done()
}

func (c *deliveryContext) Err() error {
	if c.deadline.IsZero() {
		return c.Context.Err()
	}
	if c.released.Load() {
		return context.Canceled
	}
	if err := c.Context.Err(); err != nil {
		return err
	}
	if !time.Now().Before(c.deadline) {
		return context.DeadlineExceeded
	}
	return nil
}

// release ends the context when its publish returned, like the cancel of a
// context.WithTimeout: a target that kept it sees it done.
func (c *deliveryContext) release() {
	c.released.Store(true)
	c.once.Do(func() { c.timed = doneContext })
	if c.cancel != nil {
		c.cancel()
	}
}

// doneContext is an already cancelled context.
var doneContext = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()

// callHandler runs the chain and turns a panic in it into an error, so one bad
// message or middleware cannot kill the relay.
func (f *Forwarder) callHandler(msg *message.Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("publish panicked: %v", p)
		}
	}()
	_, err = f.handler(msg)
	return err
}

// publish is the innermost handler: the publish to the target.
func (f *Forwarder) publish(msg *message.Message) ([]*message.Message, error) {
	var topic string
	if c, ok := msg.Context().(*deliveryContext); ok {
		topic = c.rec.Topic // the context as the forwarder made it
	} else {
		d, _ := DeliveryFromContext(msg.Context()) // a middleware wrapped it
		topic = d.Topic
	}
	if topic == "" {
		return nil, errors.New("message has no outbox delivery in its context (did a middleware replace the context?)")
	}
	if err := f.target.Publish(topic, msg); err != nil {
		return nil, fmt.Errorf("publish to %q: %w", topic, err)
	}
	return nil, nil
}

func (s *session) nack(g *group, rec *storage.Record, cause error, retryAt time.Time) {
	f := s.f
	s.settleLocal(g, 1)
	if g.isGone(rec.ID) {
		return // a later claim holds the record now (see group.gone)
	}
	ctx, cancel := f.bookkeepingCtx(s.stop)
	defer cancel()
	err := f.store.Nack(ctx, storage.NackParams{Record: rec.Ref(), WorkerID: f.config.WorkerID, Error: cause.Error(), RetryAt: retryAt})
	s.count(func(res *RunOnceResult) { res.Nacked++ })
	if f.config.OnOutcome != nil {
		f.config.OnOutcome(Outcome{Kind: OutcomeNacked, Record: rec, Err: cause, RetryAt: retryAt, StorageErr: err})
	}
	fields := watermill.LogFields{"outbox_id": rec.ID, "uuid": rec.UUID, "topic": rec.Topic, "key": rec.Key, "attempt": rec.Attempts, "retry_at": retryAt}
	if err != nil {
		f.logger.Error("Nack failed; the record is retried when its lease expires", err, fields)
		return
	}
	f.logger.Debug("Publish failed, retry scheduled: "+cause.Error(), fields)
}

func (s *session) release(recs []storage.Record, retryAt time.Time, why string) {
	if len(recs) == 0 {
		return
	}
	f := s.f
	ctx, cancel := f.bookkeepingCtx(s.stop)
	defer cancel()
	err := f.store.Release(ctx, storage.ReleaseParams{Records: storage.Refs(recs), WorkerID: f.config.WorkerID, RetryAt: retryAt})
	s.count(func(res *RunOnceResult) { res.Released += len(recs) })
	if f.config.OnOutcome != nil {
		for i := range recs {
			f.config.OnOutcome(Outcome{Kind: OutcomeReleased, Record: &recs[i], RetryAt: retryAt, StorageErr: err})
		}
	}
	if err != nil {
		f.logger.Error("Release failed; the records are claimable when their lease expires", err, watermill.LogFields{"count": len(recs), "reason": why})
	}
}

func (s *session) deadLetter(g *group, rec *storage.Record, reason string) {
	f := s.f
	s.settleLocal(g, 1)
	if g.isGone(rec.ID) {
		return // a later claim holds the record now (see group.gone)
	}
	ctx, cancel := f.bookkeepingCtx(s.stop)
	defer cancel()
	err := f.store.DeadLetter(ctx, storage.DeadLetterParams{Record: rec.Ref(), WorkerID: f.config.WorkerID, Error: reason})
	s.count(func(res *RunOnceResult) { res.DeadLettered++ })
	if f.config.OnOutcome != nil {
		f.config.OnOutcome(Outcome{Kind: OutcomeDeadLettered, Record: rec, Err: errors.New(reason), StorageErr: err})
	}
	fields := watermill.LogFields{"outbox_id": rec.ID, "uuid": rec.UUID, "topic": rec.Topic, "key": rec.Key, "attempt": rec.Attempts, "reason": reason}
	if err != nil {
		f.logger.Error("Dead-letter failed; the record is claimed again when its lease expires", err, fields)
		return
	}
	f.logger.Error("Record dead-lettered", errors.New(reason), fields)
}

// groupByKey splits records (in id order) into groups: one per non-empty key,
// in id order inside each, and one per keyless record. Groups come in the order
// of their first record.
func groupByKey(records []storage.Record) [][]storage.Record {
	groups := make([][]storage.Record, 0, len(records))
	index := make(map[string]int)
	for i := range records {
		key := records[i].Key
		if key == "" {
			groups = append(groups, records[i:i+1:i+1])
			continue
		}
		if g, ok := index[key]; ok {
			groups[g] = append(groups[g], records[i])
			continue
		}
		index[key] = len(groups)
		groups = append(groups, []storage.Record{records[i]})
	}
	return groups
}
