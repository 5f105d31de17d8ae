package inbox_test

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/mysql"
	"github.com/txoutbox/txoutbox/storage/postgres"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// backend is one database the inbox runs on: its inbox table, its outbox,
// and a business table "orders" (one row per processed message).
type backend struct {
	name   string
	store  storage.InboxStore
	outbox storage.Inserter
	// query runs a statement outside any transaction; ? placeholders.
	db *sql.DB
	// orders, outboxTable are the business and outbox tables, quoted.
	orders, outboxTable string
	// placeholder renders the n-th (1-based) bind parameter.
	placeholder func(n int) string
	// holdsLock reports whether a session waits for a row lock now (nil:
	// the backend cannot tell).
	waitsForLock func(ctx context.Context) (bool, error)
}

// writeOrder inserts a business row for uuid through tx (pgx.Tx or *sql.Tx).
func (b *backend) writeOrder(ctx context.Context, tx any, uuid string) error {
	q := fmt.Sprintf("INSERT INTO %s (uuid) VALUES (%s)", b.orders, b.placeholder(1))
	switch tx := tx.(type) {
	case pgx.Tx:
		_, err := tx.Exec(ctx, q, uuid)
		return err
	case *sql.Tx:
		_, err := tx.ExecContext(ctx, q, uuid)
		return err
	}
	return fmt.Errorf("unexpected transaction %T", tx)
}

// orderRows counts the business rows of each uuid.
func (b *backend) orderRows(t *testing.T) map[string]int {
	t.Helper()
	return b.countBy(t, "SELECT uuid, count(*) FROM "+b.orders+" GROUP BY uuid")
}

// outboxRows counts the outbox records of each uuid.
func (b *backend) outboxRows(t *testing.T) map[string]int {
	t.Helper()
	return b.countBy(t, "SELECT uuid, count(*) FROM "+b.outboxTable+" GROUP BY uuid")
}

func (b *backend) countBy(t *testing.T, q string) map[string]int {
	t.Helper()
	rows, err := b.db.QueryContext(context.Background(), q)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var u string
		var n int
		if err := rows.Scan(&u, &n); err != nil {
			t.Fatal(err)
		}
		out[u] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

var (
	poolOnce sync.Once
	pool     *pgxpool.Pool
	poolErr  error
)

func pgPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	poolOnce.Do(func() {
		url := cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			poolErr = err
			return
		}
		cfg.MaxConns = 20
		pool, poolErr = pgxpool.NewWithConfig(context.Background(), cfg)
		if poolErr == nil {
			poolErr = pool.Ping(context.Background())
		}
	})
	if poolErr != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("Postgres unreachable: %v", poolErr)
		}
		t.Skipf("Postgres unreachable: %v", poolErr)
	}
	return pool
}

func uniqueName(prefix string) string {
	return prefix + "_" + strings.ToLower(watermill.NewShortUUID())
}

func dollar(n int) string { return fmt.Sprintf("$%d", n) }
func question(int) string { return "?" }
func pgLockWait(p *pgxpool.Pool, marker string) func(ctx context.Context) (bool, error) {
	return func(ctx context.Context) (bool, error) {
		var n int
		err := p.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid()", marker).Scan(&n)
		return n > 0, err
	}
}

func newPostgres(t testing.TB, useSQL bool) *backend {
	t.Helper()
	p := pgPool(t)
	ctx := context.Background()
	schema := uniqueName("txi")
	if _, err := p.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	s, err := postgres.New(p, postgres.Config{Table: schema + ".outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Exec(ctx, "CREATE TABLE "+schema+".orders (uuid TEXT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	db := stdlib.OpenDBFromPool(p)
	t.Cleanup(func() { db.Close() })
	b := &backend{name: "postgres-pgx", store: s.Inbox(), outbox: s, db: db, orders: schema + ".orders",
		outboxTable: s.Table(), placeholder: dollar, waitsForLock: pgLockWait(p, s.InboxTable())}
	if useSQL {
		b.name, b.store = "postgres-sql", s.InboxDB(db)
	}
	return b
}

var (
	mysqlOnce sync.Once
	mysqlErr  error
)

func newMySQL(t testing.TB) *backend {
	t.Helper()
	dsn := cmp.Or(os.Getenv("TEST_MYSQL_DSN"), "root@tcp(127.0.0.1:3306)/test")
	mysqlOnce.Do(func() {
		db, err := sql.Open("mysql", dsn)
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			err = db.PingContext(ctx)
			cancel()
			db.Close()
		}
		mysqlErr = err
	})
	if mysqlErr != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("MySQL unreachable: %v", mysqlErr)
		}
		t.Skipf("MySQL unreachable: %v", mysqlErr)
	}
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(16)
	table := uniqueName("txi")
	t.Cleanup(func() {
		db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_skipped, " + table + "_migrations, " + table + "_keys, " + table + "_inbox, " + table + "_orders")
		db.Close()
	})
	s, err := mysql.New(db, mysql.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec("CREATE TABLE " + table + "_orders (uuid VARCHAR(255) NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return &backend{name: "mysql", store: s.Inbox(), outbox: s, db: db, orders: table + "_orders",
		outboxTable: s.Table(), placeholder: question,
		waitsForLock: func(ctx context.Context) (bool, error) {
			var n int
			// innodb_trx did not always list the waiting transaction under
			// load; the process list shows the INSERT still running.
			err := db.QueryRowContext(ctx, `SELECT (SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE ?)
    + (SELECT count(*) FROM information_schema.processlist WHERE info LIKE 'INSERT IGNORE%' AND info LIKE ?)`, "%"+table+"_inbox%", "%"+table+"_inbox%").Scan(&n)
			return n > 0, err
		}}
}

func newSQLite(t testing.TB) *backend {
	t.Helper()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "inbox.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	s, err := sqlite.New(db, sqlite.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE orders (uuid TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return &backend{name: "sqlite", store: s.Inbox(), outbox: s, db: db, orders: "orders",
		outboxTable: `"` + s.Table() + `"`, placeholder: question}
}

// eachBackend runs f on every database, each in a parallel subtest.
func eachBackend(t *testing.T, f func(t *testing.T, b *backend)) {
	for _, mk := range []struct {
		name string
		new  func(t testing.TB) *backend
	}{
		{"postgres-pgx", func(t testing.TB) *backend { return newPostgres(t, false) }},
		{"postgres-sql", func(t testing.TB) *backend { return newPostgres(t, true) }},
		{"mysql", newMySQL},
		{"sqlite", newSQLite},
	} {
		t.Run(mk.name, func(t *testing.T) {
			t.Parallel()
			f(t, mk.new(t))
		})
	}
}

// awaitTrue polls cond until it holds or the deadline passes.
func awaitTrue(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func amqpURL(t *testing.T) string {
	t.Helper()
	url := cmp.Or(os.Getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
	conn, err := amqp091.Dial(url)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("RabbitMQ unreachable: %v", err)
		}
		t.Skipf("RabbitMQ unreachable: %v", err)
	}
	conn.Close()
	return url
}

// broker is a RabbitMQ with durable queues, deleted when the test ends.
type broker struct {
	url string
	cfg amqp.Config
}

func newBroker(t *testing.T) *broker {
	url := amqpURL(t)
	return &broker{url: url, cfg: amqp.NewDurableQueueConfig(url)}
}

func (b *broker) queue(t *testing.T, prefix string) string {
	q := uniqueName(prefix)
	t.Cleanup(func() {
		conn, err := amqp091.Dial(b.url)
		if err != nil {
			return
		}
		defer conn.Close()
		if ch, err := conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
	})
	return q
}

func (b *broker) subscriber(t *testing.T) *amqp.Subscriber {
	sub, err := amqp.NewSubscriber(b.cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Close() })
	return sub
}

func (b *broker) publisher(t *testing.T) *amqp.Publisher {
	cfg := b.cfg
	cfg.Publish.ConfirmDelivery = true
	pub, err := amqp.NewPublisher(cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	return pub
}

// next returns the next message of ch, or fails after d.
func next(t *testing.T, ch <-chan *message.Message, d time.Duration) *message.Message {
	t.Helper()
	select {
	case m := <-ch:
		return m
	case <-time.After(d):
		t.Fatalf("no message within %s", d)
		return nil
	}
}

// orderHandler writes an order row for each message and publishes a
// follow-up event through the outbox, both in the inbox's transaction.
func orderHandler(b *backend, calls *countMap) message.HandlerFunc {
	pub, err := txoutbox.NewPublisher(b.outbox, txoutbox.PublisherConfig{})
	if err != nil {
		panic(err)
	}
	return func(msg *message.Message) ([]*message.Message, error) {
		calls.inc(msg.UUID)
		tx, ok := txoutbox.TxFromContext(msg.Context())
		if !ok {
			return nil, fmt.Errorf("no transaction in the message context")
		}
		if err := b.writeOrder(msg.Context(), tx, msg.UUID); err != nil {
			return nil, err
		}
		ev := message.NewMessage(msg.UUID, []byte("invoice"))
		ev.SetContext(msg.Context())
		return nil, pub.Publish("invoices.requested", ev)
	}
}

type countMap struct {
	mu sync.Mutex
	m  map[string]int
}

func (c *countMap) inc(k string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]int{}
	}
	c.m[k]++
	return c.m[k]
}

func (c *countMap) get(k string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m[k]
}
