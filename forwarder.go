package txoutbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
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

// RoundResult is what one round did.
type RoundResult struct {
	// Claimed counts records claimed this round.
	Claimed int
	// Published counts records published and acked.
	Published int
	// Nacked counts failed publishes scheduled for a retry.
	Nacked int
	// Released counts records given back untried: behind a failure of their key,
	// or because the context was cancelled before their turn.
	Released int
	// DeadLettered counts records parked: out of attempts, or undecodable.
	DeadLettered int
	// Duration is how long the round took.
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

	wake    chan struct{}
	running atomic.Bool
	// aside counts publishes run in their own goroutine, so Run can wait for
	// those that outlived their timeout before it returns.
	aside sync.WaitGroup
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
	if worst := config.worstCaseRound(); worst > config.Lease {
		logger.Error("Forwarder config can outrun its lease: records may be delivered twice", ErrLeaseTooShort, watermill.LogFields{
			"lease":           config.Lease,
			"worst_round":     worst,
			"batch_size":      config.BatchSize,
			"concurrency":     config.Concurrency,
			"publish_timeout": config.PublishTimeout,
			"fix":             "raise Lease or Concurrency, or lower BatchSize or PublishTimeout",
		})
	}

	f := &Forwarder{
		store:  store,
		target: target,
		config: config,
		logger: logger,
		wake:   make(chan struct{}, 1),
	}
	f.handler = f.publish
	for i := len(config.Middlewares) - 1; i >= 0; i-- {
		f.handler = config.Middlewares[i](f.handler)
	}
	return f, nil
}

// Config returns the forwarder's configuration with defaults applied.
func (f *Forwarder) Config() ForwarderConfig { return f.config }

// Wake cuts the current idle sleep short, for example when a LISTEN/NOTIFY
// listener sees new records. It never blocks.
func (f *Forwarder) Wake() {
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

// Run relays until ctx is cancelled, then stops claiming, lets in-flight
// publishes finish within ShutdownTimeout, releases what it claimed but did not
// try, and returns nil. Storage errors never end it: it logs them and waits
// StorageErrorDelay.
func (f *Forwarder) Run(ctx context.Context) error {
	if !f.running.CompareAndSwap(false, true) {
		return ErrForwarderRunning
	}
	defer f.running.Store(false)

	f.logger.Info("Forwarder started", nil)
	defer f.logger.Info("Forwarder stopped", nil)
	defer f.waitAside()

	poll := f.config.PollMin
	for ctx.Err() == nil {
		res, err := f.RunOnce(ctx)
		if err != nil {
			f.logger.Error("Forwarder round failed; waiting before the next one", err, watermill.LogFields{"delay": f.config.StorageErrorDelay})
			sleep(ctx, nil, f.config.StorageErrorDelay)
			continue
		}
		if res.Claimed > 0 {
			poll = f.config.PollMin
			continue
		}
		if woken := sleep(ctx, f.wake, poll); woken {
			poll = f.config.PollMin
		} else {
			poll = min(time.Duration(float64(poll)*f.config.PollFactor), f.config.PollMax)
		}
	}
	return nil
}

// waitAside waits, at most ShutdownTimeout, for publishes abandoned at their
// timeout whose target ignored the context.
func (f *Forwarder) waitAside() {
	done := make(chan struct{})
	go func() { f.aside.Wait(); close(done) }()
	t := time.NewTimer(f.config.ShutdownTimeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		f.logger.Error("Forwarder stopped with publishes still running in the target", ErrPublishAbandoned, nil)
	}
}

// sleep waits d, or until ctx is done, or until wake fires (then it reports true).
func sleep(ctx context.Context, wake <-chan struct{}, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return false
	case <-wake:
		return true
	}
}

// RunOnce runs one round: it claims a batch, publishes it group by group and
// writes the outcomes back. Cancelling ctx stops it starting new publishes;
// the records it did not try are released before it returns. The error is a
// storage error of the claim or the ack; failed publishes are not errors.
func (f *Forwarder) RunOnce(ctx context.Context) (RoundResult, error) {
	start := time.Now()
	if err := ctx.Err(); err != nil {
		return RoundResult{}, nil
	}
	// The claim is not cancelled with ctx: a claim cancelled on the wire may
	// have committed its leases, which nobody would then release.
	cctx, ccancel := f.bookkeepingCtx(ctx)
	records, err := f.store.Claim(cctx, storage.ClaimParams{
		BatchSize: f.config.BatchSize,
		Lease:     f.config.Lease,
		WorkerID:  f.config.WorkerID,
	})
	ccancel()
	if err != nil {
		return RoundResult{}, fmt.Errorf("claim outbox records: %w", err)
	}
	if len(records) == 0 {
		return RoundResult{}, nil
	}

	r := &round{f: f, stop: ctx}
	// Publishes outlive ctx by ShutdownTimeout so that a graceful stop lets
	// them finish; write-backs outlive it by BookkeepingTimeout.
	var hardCancel context.CancelFunc
	r.publishCtx, hardCancel = context.WithCancel(context.WithoutCancel(ctx))
	defer hardCancel()
	stopGrace := context.AfterFunc(ctx, func() {
		t := time.AfterFunc(f.config.ShutdownTimeout, hardCancel)
		context.AfterFunc(r.publishCtx, func() { t.Stop() })
	})
	defer stopGrace()

	r.run(records)

	res := r.result
	res.Claimed = len(records)
	if len(r.acked) > 0 {
		ids := make([]int64, len(r.acked))
		for i, rec := range r.acked {
			ids[i] = rec.ID
		}
		bctx, cancel := f.bookkeepingCtx(ctx)
		err = f.store.Ack(bctx, storage.AckParams{IDs: ids, WorkerID: f.config.WorkerID})
		cancel()
		if err != nil {
			err = fmt.Errorf("ack %d published outbox records (they will be redelivered when their lease expires): %w", len(ids), err)
		} else {
			res.Published = len(ids)
		}
		if f.config.OnOutcome != nil {
			for _, rec := range r.acked {
				f.config.OnOutcome(Outcome{Kind: OutcomePublished, Record: rec, StorageErr: err})
			}
		}
	}
	res.Duration = time.Since(start)
	if res.Duration > f.config.Lease {
		f.logger.Error("Forwarder round outran its lease: its records may have been delivered twice", ErrLeaseTooShort, watermill.LogFields{
			"lease":    f.config.Lease,
			"duration": res.Duration,
			"claimed":  res.Claimed,
		})
	}
	if f.config.OnRound != nil {
		f.config.OnRound(res)
	}
	f.logger.Trace("Forwarder round done", watermill.LogFields{
		"claimed": res.Claimed, "published": res.Published, "nacked": res.Nacked,
		"released": res.Released, "dead_lettered": res.DeadLettered, "duration": res.Duration,
	})
	return res, err
}

func (f *Forwarder) bookkeepingCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), f.config.BookkeepingTimeout)
}

// round is the state of one RunOnce.
type round struct {
	f          *Forwarder
	stop       context.Context // cancelled: start no new publish
	publishCtx context.Context // cancelled: abandon in-flight publishes

	groups [][]storage.Record
	next   atomic.Int64 // index of the next group to publish

	mu     sync.Mutex
	acked  []*storage.Record // published, to ack at the end of the round
	result RoundResult
}

// run publishes the claimed records: groups of one key in parallel up to
// Concurrency, one after another inside a group, keyless records alone.
func (r *round) run(records []storage.Record) {
	groups := groupByKey(records)
	r.groups = groups
	lanes := min(r.f.config.Concurrency, len(groups))
	if lanes == 1 {
		r.supervise()
		return
	}
	// Longest groups first: a key with many records in the batch publishes
	// them one after another, and pulled last it would hold the round (and
	// the next claim) long after the other lanes ran dry. Groups are
	// different keys, so their order is free; with one lane the batch keeps
	// id order.
	slices.SortStableFunc(groups, func(a, b []storage.Record) int { return len(b) - len(a) })
	var wg sync.WaitGroup
	for range lanes {
		wg.Go(func() { r.supervise() })
	}
	wg.Wait()
}

// A lane publishes key groups one after another, pulling them from the round.
// Without a publish timeout the lane runs on the supervising goroutine. With
// one, it runs on its own goroutine and the supervisor watches the publish in
// flight: one that outruns PublishTimeout (the target may ignore the context:
// Sarama's sync producer and JetStream do) is abandoned with its lane, its
// outcome recorded as a timeout, and a fresh lane goes on with the rest. The
// watch costs a mutex per publish and no goroutine or channel per message.
type lane struct {
	r *round

	mu        sync.Mutex
	busy      bool      // a publish is in flight
	started   time.Time // when it started
	group     []storage.Record
	pos       int  // index in group of the publish in flight
	abandoned bool // the supervisor gave up on this lane
	acked     []*storage.Record

	done chan struct{} // closed when work returns
	// first is a group remainder to publish before pulling new groups.
	first []storage.Record
}

func (r *round) newLane(first []storage.Record) *lane {
	return &lane{r: r, done: make(chan struct{}), first: first}
}

// work publishes groups until none is left or the lane is abandoned.
func (l *lane) work() {
	defer close(l.done)
	if len(l.first) > 0 && !l.publishGroup(l.first) {
		return
	}
	for {
		i := int(l.r.next.Add(1)) - 1
		if i >= len(l.r.groups) {
			return
		}
		if !l.publishGroup(l.r.groups[i]) {
			return
		}
	}
}

// supervise runs lanes until the groups are done, replacing abandoned ones.
func (r *round) supervise() {
	timeout := r.f.config.PublishTimeout
	l := r.newLane(nil)
	defer func() { r.mergeAcked(l) }()
	if timeout <= 0 {
		l.work()
		return
	}
	go l.work()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		select {
		case <-l.done:
			return
		case <-timer.C:
		case <-r.publishCtx.Done():
		}
		l.mu.Lock()
		overdue := l.busy && time.Since(l.started) >= timeout
		hard := r.publishCtx.Err() != nil
		if !(overdue || hard && l.busy) {
			wait := timeout
			if l.busy {
				wait = timeout - time.Since(l.started)
			}
			l.mu.Unlock()
			if hard {
				// Nothing in flight: the lane is releasing what is left.
				<-l.done
				return
			}
			timer.Reset(wait)
			continue
		}
		l.abandoned = true
		group, pos := l.group, l.pos
		l.mu.Unlock()
		r.mergeAcked(l)
		r.f.aside.Add(1)
		go func(old *lane) { <-old.done; r.f.aside.Done() }(l)

		err := fmt.Errorf("%w after %s", ErrPublishTimeout, timeout)
		if hard {
			err = ErrPublishAbandoned
		}
		var rest []storage.Record
		if r.fail(group, pos, err) {
			rest = group[pos+1:]
		}
		l = r.newLane(rest)
		go l.work()
		timer.Reset(timeout)
	}
}

// OutcomeKind is what became of a claimed record in a round.
type OutcomeKind int

// The outcomes of a claimed record.
const (
	// OutcomePublished: published and acked (StorageErr: the ack failed).
	OutcomePublished OutcomeKind = iota + 1
	// OutcomeNacked: the publish failed; retried at RetryAt.
	OutcomeNacked
	// OutcomeReleased: given back untried (behind a failure of its key, or
	// at shutdown); due again at RetryAt.
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

func (r *round) mergeAcked(l *lane) {
	l.mu.Lock()
	acked := l.acked
	l.acked = nil
	l.mu.Unlock()
	if len(acked) > 0 {
		r.mu.Lock()
		r.acked = append(r.acked, acked...)
		r.mu.Unlock()
	}
}

// publishGroup publishes the records of one key in order. It returns false if
// the lane was abandoned meanwhile.
func (l *lane) publishGroup(group []storage.Record) bool {
	r, f := l.r, l.r.f
	for i := range group {
		rec := &group[i]
		if r.stop.Err() != nil {
			r.release(group[i:], time.Now(), "stopping")
			return true
		}
		if rec.DecodeError != nil {
			r.deadLetter(rec, fmt.Sprintf("undecodable record: %v", rec.DecodeError))
			continue
		}
		if rec.Attempts > f.config.MaxAttempts {
			// Claimed more often than allowed without an outcome recorded: the
			// process died while publishing it (maybe because of it).
			r.deadLetter(rec, fmt.Sprintf("claimed %d times without a recorded outcome (MaxAttempts %d)", rec.Attempts, f.config.MaxAttempts))
			continue
		}
		now := time.Now()
		l.mu.Lock()
		if l.abandoned {
			l.mu.Unlock()
			return false
		}
		l.busy, l.started, l.group, l.pos = true, now, group, i
		l.mu.Unlock()

		err := f.publishOne(r.publishCtx, rec, now)

		l.mu.Lock()
		abandoned := l.abandoned
		l.busy = false
		if err == nil && !abandoned {
			l.acked = append(l.acked, rec)
		}
		l.mu.Unlock()
		if abandoned {
			return false // the supervisor recorded this record's outcome
		}
		if err != nil && !r.fail(group, i, err) {
			return true
		}
	}
	return true
}

// fail records the failed publish of group[i]: dead-letter when out of
// attempts (and report true: the rest of the group may go on), else nack with
// backoff and release the rest of the group untried with the same retry time.
func (r *round) fail(group []storage.Record, i int, err error) bool {
	f := r.f
	rec := &group[i]
	if rec.Attempts >= f.config.MaxAttempts {
		r.deadLetter(rec, fmt.Sprintf("attempt %d of %d failed: %v", rec.Attempts, f.config.MaxAttempts, err))
		return true
	}
	retryAt := time.Now().Add(f.config.Backoff.Delay(rec.Attempts))
	r.nack(rec, err, retryAt)
	// The rest of this key waits behind the failure, untried.
	r.release(group[i+1:], retryAt, "behind a failed record of the same key")
	return false
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
	context.Context // the round's publish context
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

func (r *round) nack(rec *storage.Record, cause error, retryAt time.Time) {
	f := r.f
	ctx, cancel := f.bookkeepingCtx(r.stop)
	defer cancel()
	err := f.store.Nack(ctx, storage.NackParams{ID: rec.ID, WorkerID: f.config.WorkerID, Error: cause.Error(), RetryAt: retryAt})
	r.count(func(res *RoundResult) { res.Nacked++ })
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

func (r *round) release(recs []storage.Record, retryAt time.Time, why string) {
	if len(recs) == 0 {
		return
	}
	f := r.f
	ids := make([]int64, len(recs))
	for i := range recs {
		ids[i] = recs[i].ID
	}
	ctx, cancel := f.bookkeepingCtx(r.stop)
	defer cancel()
	err := f.store.Release(ctx, storage.ReleaseParams{IDs: ids, WorkerID: f.config.WorkerID, RetryAt: retryAt})
	r.count(func(res *RoundResult) { res.Released += len(ids) })
	if f.config.OnOutcome != nil {
		for i := range recs {
			f.config.OnOutcome(Outcome{Kind: OutcomeReleased, Record: &recs[i], RetryAt: retryAt, StorageErr: err})
		}
	}
	if err != nil {
		f.logger.Error("Release failed; the records are claimable when their lease expires", err, watermill.LogFields{"count": len(ids), "reason": why})
	}
}

func (r *round) deadLetter(rec *storage.Record, reason string) {
	f := r.f
	ctx, cancel := f.bookkeepingCtx(r.stop)
	defer cancel()
	err := f.store.DeadLetter(ctx, storage.DeadLetterParams{ID: rec.ID, WorkerID: f.config.WorkerID, Error: reason})
	r.count(func(res *RoundResult) { res.DeadLettered++ })
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

func (r *round) count(update func(*RoundResult)) {
	r.mu.Lock()
	update(&r.result)
	r.mu.Unlock()
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
