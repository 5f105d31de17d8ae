package main

import (
	"context"
	"errors"
	"fmt"
	"runtime/pprof"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// benchApp is the application_name of the bench's connections.
const benchApp = "txoutbox-bench"

// destTopic is the topic both relays re-publish to.
const destTopic = "bench_orders"

// relayConfig is one relay set-up of one run.
type relayConfig struct {
	url         string
	name        string // unique table base name
	batch       int
	concurrency int // txoutbox only
	strict      bool
	notify      bool          // txoutbox: LISTEN/NOTIFY wake-ups
	poll        time.Duration // idle poll interval
	producers   int
	forwarders  int
	deleteOnAck bool // txoutbox only
	// txoutbox only, 0 for the defaults
	lease, publishTimeout time.Duration
	// txoutbox only, zero for the defaults: the retry settings and an
	// outcome hook (the outage scenario)
	maxAttempts     int
	outageThreshold int
	backoff         txoutbox.Backoff
	onOutcome       func(txoutbox.Outcome)
}

// relay is one system under test.
type relay interface {
	// Setup creates the tables.
	Setup(ctx context.Context) error
	// PublishTx writes msgs in one transaction through the relay's
	// transactional publisher and commits.
	PublishTx(ctx context.Context, msgs []*message.Message) error
	// Start runs the configured number of forwarders into target until stop.
	Start(ctx context.Context, target message.Publisher) (stop func(), err error)
	// Teardown drops the tables and closes the connections.
	Teardown(ctx context.Context) error
}

// ---- txoutbox ----

type txoRelay struct {
	cfg      relayConfig
	prodPool *pgxpool.Pool
	fwdPool  *pgxpool.Pool
	store    *postgres.Storage
	pub      *txoutbox.Publisher
}

func newPool(ctx context.Context, url string, conns int) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse database URL: %w", err)
	}
	pc.MaxConns = int32(conns)
	// The bench's own connections are told apart in pg_stat_activity
	// (heldBack).
	pc.ConnConfig.RuntimeParams["application_name"] = benchApp
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect: %w", err)
	}
	return pool, nil
}

func newTxoRelay(cfg relayConfig) *txoRelay { return &txoRelay{cfg: cfg} }

func (r *txoRelay) Setup(ctx context.Context) error {
	var err error
	if r.prodPool, err = newPool(ctx, r.cfg.url, max(r.cfg.producers, 1)+1); err != nil {
		return err
	}
	// A forwarder may hold three connections at once: its claim, its ack and
	// its lease extension run concurrently (plus a lane's nack or release).
	// An ack or an extension that waits for a connection behind the claims
	// can land after the lease.
	if r.fwdPool, err = newPool(ctx, r.cfg.url, 4*max(r.cfg.forwarders, 1)+1); err != nil {
		return err
	}
	pc := postgres.Config{Table: r.cfg.name, DisableStrictOrdering: !r.cfg.strict, DeleteOnAck: r.cfg.deleteOnAck}
	if r.cfg.notify {
		pc.NotifyChannel = r.cfg.name
	}
	if r.store, err = postgres.New(r.fwdPool, pc); err != nil {
		return err
	}
	if err := r.store.CreateSchema(ctx); err != nil {
		return err
	}
	r.pub, err = txoutbox.NewPublisher(r.store, txoutbox.PublisherConfig{})
	return err
}

func (r *txoRelay) PublishTx(ctx context.Context, msgs []*message.Message) error {
	tx, err := r.prodPool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	if err := r.pub.Bind(tx).Publish(destTopic, msgs...); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

func (r *txoRelay) Start(ctx context.Context, target message.Publisher) (func(), error) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var fwds []*txoutbox.Forwarder
	for i := range max(r.cfg.forwarders, 1) {
		f, err := txoutbox.NewForwarder(r.store, target, txoutbox.ForwarderConfig{
			BatchSize:       r.cfg.batch,
			Concurrency:     r.cfg.concurrency,
			WorkerID:        fmt.Sprintf("bench-%d", i),
			PollMin:         r.cfg.poll,
			PollMax:         max(r.cfg.poll, 100*time.Millisecond),
			Lease:           r.cfg.lease,
			PublishTimeout:  r.cfg.publishTimeout,
			MaxAttempts:     r.cfg.maxAttempts,
			OutageThreshold: r.cfg.outageThreshold,
			Backoff:         r.cfg.backoff,
			OnOutcome:       r.cfg.onOutcome,
		}, nil)
		if err != nil {
			cancel()
			return nil, err
		}
		fwds = append(fwds, f)
	}
	for _, f := range fwds {
		// The label lets a -cpuprofile be read for the forwarders alone
		// (go tool pprof -tagfocus role=forwarder).
		wg.Go(func() { pprof.Do(ctx, pprof.Labels("role", "forwarder"), func(ctx context.Context) { _ = f.Run(ctx) }) })
	}
	if r.cfg.notify {
		wg.Go(func() {
			_ = r.store.Listen(ctx, func() {
				for _, f := range fwds {
					f.Wake()
				}
			})
		})
	}
	return func() { cancel(); wg.Wait() }, nil
}

func (r *txoRelay) Teardown(ctx context.Context) error {
	var err error
	if r.fwdPool != nil && r.store != nil {
		fn := pgx.Identifier{r.cfg.name + "_notify"}.Sanitize()
		_, err = r.fwdPool.Exec(ctx, fmt.Sprintf("DROP TABLE IF EXISTS %s, %s, %s, %s, %s, %s, %s; DROP FUNCTION IF EXISTS %s()",
			r.store.Table(), r.store.LeaseTable(), r.store.WorkerTable(), r.store.DeliveredTable(), r.store.MigrationTable(), r.store.SkippedTable(), r.store.InboxTable(), fn), pgx.QueryExecModeSimpleProtocol)
	}
	if r.fwdPool != nil {
		r.fwdPool.Close()
	}
	if r.prodPool != nil {
		r.prodPool.Close()
	}
	return err
}

// ---- Watermill components/forwarder over watermill-sql v4, native pgx ----

// wmRelay is Watermill's forwarder over watermill-sql v4 on pgx, as a user
// starting today writes it: the producers' Publisher on TxFromPgx of their
// pgx.Tx, the subscriber on BeginnerFromPgx of a pgxpool.
type wmRelay struct {
	cfg      relayConfig
	prodPool *pgxpool.Pool
	fwdPool  *pgxpool.Pool
	schema   wmsql.DefaultPostgreSQLSchema
	offsets  wmsql.DefaultPostgreSQLOffsetsAdapter
	topic    string
}

func newWmRelay(cfg relayConfig) *wmRelay {
	r := &wmRelay{cfg: cfg, topic: cfg.name}
	r.schema = wmsql.DefaultPostgreSQLSchema{
		GenerateMessagesTableName: func(string) string { return pgx.Identifier{cfg.name}.Sanitize() },
		SubscribeBatchSize:        cfg.batch,
	}
	r.offsets = wmsql.DefaultPostgreSQLOffsetsAdapter{
		GenerateMessagesOffsetsTableName: func(string) string { return pgx.Identifier{cfg.name + "_offsets"}.Sanitize() },
	}
	return r
}

func (r *wmRelay) Setup(ctx context.Context) error {
	var err error
	if r.prodPool, err = newPool(ctx, r.cfg.url, max(r.cfg.producers, 1)+1); err != nil {
		return err
	}
	if r.fwdPool, err = newPool(ctx, r.cfg.url, 2*max(r.cfg.forwarders, 1)+1); err != nil {
		return err
	}
	sub, err := r.subscriber()
	if err != nil {
		return err
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(r.topic); err != nil {
		return fmt.Errorf("initialize watermill-sql schema: %w", err)
	}
	return nil
}

func (r *wmRelay) subscriber() (*wmsql.Subscriber, error) {
	return wmsql.NewSubscriber(wmsql.BeginnerFromPgx(r.fwdPool), wmsql.SubscriberConfig{
		ConsumerGroup:  "bench",
		PollInterval:   r.cfg.poll,
		ResendInterval: r.cfg.poll,
		SchemaAdapter:  r.schema,
		OffsetsAdapter: r.offsets,
	}, watermill.NopLogger{})
}

func (r *wmRelay) PublishTx(ctx context.Context, msgs []*message.Message) error {
	tx, err := r.prodPool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	// The wrapper's own Commit and Rollback panic (it keeps no context):
	// the pgx transaction is committed instead.
	p, err := wmsql.NewPublisher(wmsql.TxFromPgx(tx), wmsql.PublisherConfig{SchemaAdapter: r.schema}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	if err := forwarder.NewPublisher(p, forwarder.PublisherConfig{ForwarderTopic: r.topic}).Publish(destTopic, msgs...); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// onceSubscriber closes its subscriber once, whoever calls Close first: the
// router of a Watermill forwarder closes its subscriber when it stops, from a
// goroutine that can outlive Run, and watermill-sql's Subscriber.Close called
// twice at once is a data race (seen under -race).
type onceSubscriber struct {
	message.Subscriber
	once sync.Once
	err  error
}

func (s *onceSubscriber) Close() error {
	s.once.Do(func() { s.err = s.Subscriber.Close() })
	return s.err
}

func (r *wmRelay) Start(ctx context.Context, target message.Publisher) (func(), error) {
	return startWatermill(ctx, target, r.cfg.forwarders, r.topic, r.subscriber)
}

// startWatermill runs n of Watermill's forwarders (at least one), each on a
// subscriber of its own, until the returned function is called; it returns
// once every one is running.
func startWatermill(ctx context.Context, target message.Publisher, n int, topic string, subscriber func() (*wmsql.Subscriber, error)) (func(), error) {
	var fwds []*forwarder.Forwarder
	var subs []*onceSubscriber
	var wg sync.WaitGroup
	closeAll := func() {
		for _, f := range fwds {
			_ = f.Close()
		}
		wg.Wait()
		for _, s := range subs {
			_ = s.Close()
		}
	}
	for range max(n, 1) {
		wsub, err := subscriber()
		if err != nil {
			closeAll()
			return nil, err
		}
		sub := &onceSubscriber{Subscriber: wsub}
		subs = append(subs, sub)
		f, err := forwarder.NewForwarder(sub, target, watermill.NopLogger{}, forwarder.Config{ForwarderTopic: topic})
		if err != nil {
			closeAll()
			return nil, err
		}
		fwds = append(fwds, f)
	}
	for _, f := range fwds {
		wg.Go(func() { _ = f.Run(ctx) })
	}
	for _, f := range fwds {
		select {
		case <-f.Running():
		case <-time.After(10 * time.Second):
			closeAll()
			return nil, errors.New("watermill forwarder did not start within 10s")
		}
	}
	return closeAll, nil
}

func (r *wmRelay) Teardown(ctx context.Context) error {
	var err error
	if r.fwdPool != nil {
		_, err = r.fwdPool.Exec(ctx, fmt.Sprintf("DROP TABLE IF EXISTS %s, %s",
			pgx.Identifier{r.cfg.name}.Sanitize(), pgx.Identifier{r.cfg.name + "_offsets"}.Sanitize()))
		r.fwdPool.Close()
	}
	if r.prodPool != nil {
		r.prodPool.Close()
	}
	return err
}
