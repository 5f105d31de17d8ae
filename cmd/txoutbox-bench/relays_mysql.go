package main

import (
	"context"
	"database/sql"
	"fmt"
	"runtime/pprof"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/go-sql-driver/mysql"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/mysql"
)

// The -db mysql relays: txoutbox on storage/mysql, and Watermill's
// forwarder over watermill-sql's MySQL schema, on the same server. MySQL
// has no LISTEN/NOTIFY: both poll.

func openMySQL(dsn string, conns int) (*sql.DB, error) {
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		return nil, fmt.Errorf("open MySQL: %w", err)
	}
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	return db, nil
}

type txoMyRelay struct {
	cfg    relayConfig
	prodDB *sql.DB
	fwdDB  *sql.DB
	store  *mysql.Storage
	pub    *txoutbox.Publisher
}

func newTxoMyRelay(cfg relayConfig) *txoMyRelay { return &txoMyRelay{cfg: cfg} }

func (r *txoMyRelay) Setup(ctx context.Context) error {
	var err error
	if r.prodDB, err = openMySQL(r.cfg.url, max(r.cfg.producers, 1)+1); err != nil {
		return err
	}
	if r.fwdDB, err = openMySQL(r.cfg.url, 2*max(r.cfg.forwarders, 1)+1); err != nil {
		return err
	}
	if err := r.fwdDB.PingContext(ctx); err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	if r.store, err = mysql.New(r.fwdDB, mysql.Config{Table: r.cfg.name, DisableStrictOrdering: !r.cfg.strict, DeleteOnAck: r.cfg.deleteOnAck}); err != nil {
		return err
	}
	if err := r.store.CreateSchema(ctx); err != nil {
		return err
	}
	r.pub, err = txoutbox.NewPublisher(r.store, txoutbox.PublisherConfig{})
	return err
}

func (r *txoMyRelay) PublishTx(ctx context.Context, msgs []*message.Message) error {
	tx, err := r.prodDB.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after commit
	if err := r.pub.Bind(tx).Publish(destTopic, msgs...); err != nil {
		return err
	}
	return tx.Commit()
}

func (r *txoMyRelay) Start(ctx context.Context, target message.Publisher) (func(), error) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var fwds []*txoutbox.Forwarder
	for i := range max(r.cfg.forwarders, 1) {
		f, err := txoutbox.NewForwarder(r.store, target, txoutbox.ForwarderConfig{
			BatchSize:   r.cfg.batch,
			Concurrency: r.cfg.concurrency,
			WorkerID:    fmt.Sprintf("bench-%d", i),
			PollMin:     r.cfg.poll,
			PollMax:     max(r.cfg.poll, 100*time.Millisecond),
		}, nil)
		if err != nil {
			cancel()
			return nil, err
		}
		fwds = append(fwds, f)
	}
	for _, f := range fwds {
		wg.Go(func() { pprof.Do(ctx, pprof.Labels("role", "forwarder"), func(ctx context.Context) { _ = f.Run(ctx) }) })
	}
	return func() { cancel(); wg.Wait() }, nil
}

func (r *txoMyRelay) Teardown(ctx context.Context) error {
	var err error
	if r.fwdDB != nil {
		_, err = r.fwdDB.ExecContext(ctx, "DROP TABLE IF EXISTS `"+r.cfg.name+"`, `"+r.cfg.name+"_skipped`, `"+r.cfg.name+"_migrations`, `"+r.cfg.name+"_keys`, `"+r.cfg.name+"_inbox`")
		_ = r.fwdDB.Close()
	}
	if r.prodDB != nil {
		_ = r.prodDB.Close()
	}
	return err
}

type wmMyRelay struct {
	cfg     relayConfig
	prodDB  *sql.DB
	fwdDB   *sql.DB
	schema  wmsql.DefaultMySQLSchema
	offsets wmsql.DefaultMySQLOffsetsAdapter
	topic   string
}

func newWmMyRelay(cfg relayConfig) *wmMyRelay {
	r := &wmMyRelay{cfg: cfg, topic: cfg.name}
	r.schema = wmsql.DefaultMySQLSchema{
		GenerateMessagesTableName: func(string) string { return "`" + cfg.name + "`" },
		SubscribeBatchSize:        cfg.batch,
	}
	r.offsets = wmsql.DefaultMySQLOffsetsAdapter{
		GenerateMessagesOffsetsTableName: func(string) string { return "`" + cfg.name + "_offsets`" },
	}
	return r
}

func (r *wmMyRelay) Setup(ctx context.Context) error {
	var err error
	if r.prodDB, err = openMySQL(r.cfg.url, max(r.cfg.producers, 1)+1); err != nil {
		return err
	}
	if r.fwdDB, err = openMySQL(r.cfg.url, 2*max(r.cfg.forwarders, 1)+1); err != nil {
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

func (r *wmMyRelay) subscriber() (*wmsql.Subscriber, error) {
	return wmsql.NewSubscriber(wmsql.BeginnerFromStdSQL(r.fwdDB), wmsql.SubscriberConfig{
		ConsumerGroup:  "bench",
		PollInterval:   r.cfg.poll,
		ResendInterval: r.cfg.poll,
		SchemaAdapter:  r.schema,
		OffsetsAdapter: r.offsets,
	}, watermill.NopLogger{})
}

func (r *wmMyRelay) PublishTx(ctx context.Context, msgs []*message.Message) error {
	tx, err := r.prodDB.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after commit
	p, err := wmsql.NewPublisher(wmsql.TxFromStdSQL(tx), wmsql.PublisherConfig{SchemaAdapter: r.schema}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	if err := forwarder.NewPublisher(p, forwarder.PublisherConfig{ForwarderTopic: r.topic}).Publish(destTopic, msgs...); err != nil {
		return err
	}
	return tx.Commit()
}

func (r *wmMyRelay) Start(ctx context.Context, target message.Publisher) (func(), error) {
	return startWatermill(ctx, target, r.cfg.forwarders, r.topic, r.subscriber)
}

func (r *wmMyRelay) Teardown(ctx context.Context) error {
	var err error
	if r.fwdDB != nil {
		_, err = r.fwdDB.ExecContext(ctx, "DROP TABLE IF EXISTS `"+r.cfg.name+"`, `"+r.cfg.name+"_offsets`")
		_ = r.fwdDB.Close()
	}
	if r.prodDB != nil {
		_ = r.prodDB.Close()
	}
	return err
}
