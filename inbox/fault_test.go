package inbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/inbox"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// The environment of a consumer process started by TestKilledConsumers.
const (
	envChild    = "TXOUTBOX_INBOX_FAULT_CHILD"
	envDB       = "TXOUTBOX_INBOX_FAULT_DB"
	envSchema   = "TXOUTBOX_INBOX_FAULT_SCHEMA"
	envAMQP     = "TXOUTBOX_INBOX_FAULT_AMQP"
	envQueue    = "TXOUTBOX_INBOX_FAULT_QUEUE"
	envKillRate = "TXOUTBOX_INBOX_FAULT_KILL_RATE"
)

func TestMain(m *testing.M) {
	if os.Getenv(envChild) == "1" {
		if err := faultConsumer(); err != nil {
			fmt.Fprintln(os.Stderr, "fault consumer:", err)
			os.Exit(2)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// faultConsumer is one consumer process: orders.created from RabbitMQ, an
// order row and a follow-up outbox record per message, in the inbox's
// transaction. With probability rate per message it SIGKILLs itself after
// the handler's writes and before the commit, and with the same
// probability after the commit and before the ack.
func faultConsumer() error {
	rate, err := strconv.ParseFloat(os.Getenv(envKillRate), 64)
	if err != nil {
		return err
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv(envDB))
	if err != nil {
		return err
	}
	schema := os.Getenv(envSchema)
	store, err := postgres.New(pool, postgres.Config{Table: schema + ".outbox"})
	if err != nil {
		return err
	}
	in, err := inbox.New(inbox.Config{Consumer: "billing", Store: store.Inbox()})
	if err != nil {
		return err
	}
	events, err := txoutbox.NewPublisher(store, txoutbox.PublisherConfig{})
	if err != nil {
		return err
	}
	sub, err := amqp.NewSubscriber(amqp.NewDurableQueueConfig(os.Getenv(envAMQP)), watermill.NopLogger{})
	if err != nil {
		return err
	}
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	die := func() { _ = syscall.Kill(os.Getpid(), syscall.SIGKILL); select {} }
	r.AddMiddleware(middleware.Recoverer, func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && rand.Float64() < rate {
				die() // committed, not acked
			}
			return out, err
		}
	})
	r.AddConsumerHandler("billing", os.Getenv(envQueue), sub, func(msg *message.Message) error {
		tx, _ := txoutbox.TxFromContext(msg.Context())
		if _, err := tx.(pgx.Tx).Exec(msg.Context(), "INSERT INTO "+schema+".orders (uuid) VALUES ($1)", msg.UUID); err != nil {
			return err
		}
		ev := message.NewMessage("invoice-"+msg.UUID, nil)
		ev.SetContext(msg.Context())
		if err := events.Publish("invoices.requested", ev); err != nil {
			return err
		}
		if rand.Float64() < rate {
			die() // written, not committed
		}
		return nil
	}).AddMiddleware(in.Middleware)
	return r.Run(ctx)
}

// TestKilledConsumers: three consumer processes share a RabbitMQ queue of
// several thousand orders and die by SIGKILL at random points: before the
// commit, after the commit and before the ack (both from inside), and
// anywhere (from the test). Dead ones are restarted. Every order row and
// every follow-up outbox record is there exactly once.
func TestKilledConsumers(t *testing.T) {
	if testing.Short() {
		t.Skip("runs consumer processes for a while")
	}
	t.Parallel()
	pool := pgPool(t)
	br := newBroker(t)
	ctx := context.Background()
	schema := uniqueName("txi_fault")
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema+"; CREATE TABLE "+schema+".orders (uuid TEXT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	store, err := postgres.New(pool, postgres.Config{Table: schema + ".outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	queue := br.queue(t, "orders_fault")
	// Declare the queue before publishing into it.
	declare, err := amqp.NewSubscriber(br.cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if err := declare.SubscribeInitialize(queue); err != nil {
		t.Fatal(err)
	}
	declare.Close()

	const messages = 3000
	pub := br.publisher(t)
	batch := make([]*message.Message, 0, 100)
	for i := range messages {
		m := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
		if batch = append(batch, m); len(batch) == cap(batch) || i == messages-1 {
			if err := pub.Publish(queue, batch...); err != nil {
				t.Fatal(err)
			}
			batch = batch[:0]
		}
	}

	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dbURL := pool.Config().ConnString()
	var mu sync.Mutex
	procs := map[int]*exec.Cmd{}
	exited := make(chan int, 64)
	starts, deaths, externalKills := 0, 0, 0
	start := func(slot int) {
		cmd := exec.Command(exe, "-test.run=^$")
		cmd.Env = append(os.Environ(), envChild+"=1", envDB+"="+dbURL, envSchema+"="+schema,
			envAMQP+"="+br.url, envQueue+"="+queue, envKillRate+"=0.004")
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		procs[slot] = cmd
		starts++
		mu.Unlock()
		go func() {
			err := cmd.Wait()
			if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() {
				t.Errorf("consumer exited without being killed: %v", err)
			}
			exited <- slot
		}()
	}
	for slot := range 3 {
		start(slot)
	}
	stop := make(chan struct{})
	var killer sync.WaitGroup
	killer.Add(1)
	go func() { // kills from outside, at random moments
		defer killer.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(200+rand.IntN(800)) * time.Millisecond):
			}
			mu.Lock()
			if p := procs[rand.IntN(3)]; p != nil && p.Process.Kill() == nil {
				externalKills++
			}
			mu.Unlock()
		}
	}()

	deadline := time.After(4 * time.Minute)
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	var done int
	for done < messages {
		select {
		case slot := <-exited:
			mu.Lock()
			deaths++
			mu.Unlock()
			start(slot)
		case <-tick.C:
			if err := pool.QueryRow(ctx, "SELECT count(DISTINCT uuid) FROM "+schema+".orders").Scan(&done); err != nil {
				t.Fatal(err)
			}
		case <-deadline:
			t.Fatalf("after 4 minutes %d of %d orders processed", done, messages)
		}
	}
	close(stop)
	killer.Wait()
	mu.Lock()
	for _, p := range procs {
		_ = p.Process.Kill()
	}
	mu.Unlock()
	for range 3 {
		<-exited
	}

	var rows, distinct, records, distinctRecords, entries int
	if err := pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT uuid) FROM "+schema+".orders").Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT uuid) FROM "+store.Table()).Scan(&records, &distinctRecords); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+store.InboxTable()).Scan(&entries); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d messages, %d consumer processes started, %d died (about %d of them killed from outside, the others by themselves before a commit or before an ack)", messages, starts, deaths, externalKills)
	if rows != messages || distinct != messages || records != messages || distinctRecords != messages || entries != messages {
		t.Fatalf("%d order rows (%d distinct), %d outbox records (%d distinct), %d inbox entries; want %d of each, each once",
			rows, distinct, records, distinctRecords, entries, messages)
	}
	if deaths < 10 || deaths-externalKills < 5 {
		t.Fatalf("%d consumer deaths, %d from outside: the faults did not happen", deaths, externalKills)
	}
}
