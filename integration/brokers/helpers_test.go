package brokers_test

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// need returns the service URL from env (or def) and skips the test when the
// service does not accept TCP connections, failing instead with CI=true.
func need(t *testing.T, env, def, howto string) string {
	t.Helper()
	raw := cmp.Or(os.Getenv(env), def)
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatalf("%s=%q: %v", env, raw, err)
	}
	conn, err := net.DialTimeout("tcp", u.Host, 2*time.Second)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s unreachable at %s (%s): %v", env, u.Host, raw, err)
		}
		t.Skipf("%s unreachable at %s (%v); start it with `%s` or set %s", env, u.Host, err, howto, env)
	}
	conn.Close()
	return raw
}

var (
	poolOnce sync.Once
	pool     *pgxpool.Pool
	poolErr  error
)

// testPool returns the shared pool on TEST_DATABASE_URL.
func testPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	url := need(t, "TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable",
		"pg_ctlcluster --skip-systemctl-redirect 15 main start")
	poolOnce.Do(func() {
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
		t.Fatalf("Postgres at TEST_DATABASE_URL: %v", poolErr)
	}
	return pool
}

// fixture is one test's database: a fresh schema holding the business table
// (orders) and the outbox, dropped when the test ends.
type fixture struct {
	pool   *pgxpool.Pool
	schema string
	store  *postgres.Storage
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	p := testPool(t)
	ctx := context.Background()
	schema := "txo_" + strings.ToLower(watermill.NewShortUUID())
	if _, err := p.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	if _, err := p.Exec(ctx, "CREATE TABLE "+schema+".orders (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL, seq INT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	store, err := postgres.New(p, postgres.Config{Table: schema + ".outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.CreateSchema(ctx); err != nil {
		t.Fatal(err)
	}
	return &fixture{pool: p, schema: schema, store: store}
}

// event is what the producers wrote and what the tests expect to receive.
type event struct {
	UUID string
	Key  string
	Seq  int // position of the event within its key, from 0
}

type payload struct {
	Key string `json:"key"`
	Seq int    `json:"seq"`
}

// produce runs producers goroutines; each owns its keys (so that per key, id
// order is commit order) and commits perProducer transactions, each writing an
// orders row and its event through one long-lived context-bound publisher.
// Every fifth transaction rolls back. It returns the committed events and the
// UUIDs of the rolled-back ones.
func (f *fixture) produce(t *testing.T, topic string, producers, keysPerProducer, perProducer int) (committed []event, rolledBack map[string]bool) {
	t.Helper()
	pub, err := txoutbox.NewPublisher(f.store, txoutbox.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	rolledBack = map[string]bool{}
	var wg sync.WaitGroup
	errs := make(chan error, producers)
	for p := range producers {
		wg.Go(func() {
			seq := map[string]int{}
			for i := range perProducer {
				key := fmt.Sprintf("p%d-k%d", p, i%keysPerProducer)
				ev := event{UUID: watermill.NewUUID(), Key: key, Seq: seq[key]}
				rollback := i%5 == 4
				if err := f.writeOne(topic, pub, ev, p, rollback); err != nil {
					errs <- err
					return
				}
				mu.Lock()
				if rollback {
					rolledBack[ev.UUID] = true
				} else {
					seq[key]++
					committed = append(committed, ev)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	return committed, rolledBack
}

func (f *fixture) writeOne(topic string, pub *txoutbox.Publisher, ev event, producer int, rollback bool) error {
	ctx := context.Background()
	tx, err := f.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "INSERT INTO "+f.schema+".orders (key, seq) VALUES ($1, $2)", ev.Key, ev.Seq); err != nil {
		return err
	}
	body, _ := json.Marshal(payload{Key: ev.Key, Seq: ev.Seq})
	msg := message.NewMessage(ev.UUID, body)
	msg.Metadata.Set(txoutbox.MetadataKey, ev.Key)
	msg.Metadata.Set("producer", strconv.Itoa(producer))
	msg.SetContext(txoutbox.ContextWithTx(ctx, tx))
	if err := pub.Publish(topic, msg); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	if rollback {
		return tx.Rollback(ctx)
	}
	return tx.Commit(ctx)
}

// runForwarders starts n forwarders on store relaying to target; they stop
// (and Run's return is awaited) when the test ends.
func runForwarders(t *testing.T, store *postgres.Storage, target message.Publisher, n int, cfg txoutbox.ForwarderConfig) []*txoutbox.Forwarder {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var fwds []*txoutbox.Forwarder
	for i := range n {
		c := cfg
		c.WorkerID = fmt.Sprintf("%s-fwd-%d", t.Name(), i)
		fwd, err := txoutbox.NewForwarder(store, target, c, watermill.NopLogger{})
		if err != nil {
			cancel()
			t.Fatal(err)
		}
		fwds = append(fwds, fwd)
		wg.Go(func() {
			if err := fwd.Run(ctx); err != nil {
				t.Errorf("forwarder %d: %v", i, err)
			}
		})
	}
	t.Cleanup(func() { cancel(); wg.Wait() })
	return fwds
}

// received is one message as a consumer read it from the broker.
type received struct {
	UUID      string
	Key       string // the ordering key as the broker carried it
	Partition int32  // Kafka only
	Metadata  map[string]string
	Payload   []byte
}

// checkDelivery asserts: every committed event arrived, no rolled-back one
// did, per key the first deliveries come in commit (= id) order, and the UUID,
// payload and metadata survived the trip. Duplicates (at-least-once) are
// allowed and logged.
func checkDelivery(t *testing.T, committed []event, rolledBack map[string]bool, got []received) {
	t.Helper()
	want := make(map[string]event, len(committed))
	for _, e := range committed {
		want[e.UUID] = e
	}
	seen := map[string]bool{}
	next := map[string]int{} // key -> next expected seq
	lastID := map[string]int64{}
	dups := 0
	for _, r := range got {
		if rolledBack[r.UUID] {
			t.Errorf("rolled-back event %s was delivered", r.UUID)
			continue
		}
		e, ok := want[r.UUID]
		if !ok {
			t.Errorf("unknown message %s delivered (UUID not preserved?)", r.UUID)
			continue
		}
		if seen[r.UUID] {
			dups++
			continue
		}
		seen[r.UUID] = true
		if r.Key != e.Key {
			t.Errorf("message %s: broker key %q, want %q", r.UUID, r.Key, e.Key)
		}
		if md := r.Metadata[txoutbox.MetadataKey]; md != e.Key {
			t.Errorf("message %s: metadata %s = %q, want %q", r.UUID, txoutbox.MetadataKey, md, e.Key)
		}
		if r.Metadata["producer"] == "" || r.Metadata[txoutbox.MetadataAttempt] == "" || r.Metadata[txoutbox.MetadataCreatedAt] == "" {
			t.Errorf("message %s: metadata lost: %v", r.UUID, r.Metadata)
		}
		var p payload
		if err := json.Unmarshal(r.Payload, &p); err != nil || p.Key != e.Key || p.Seq != e.Seq {
			t.Errorf("message %s: payload %q, want key %s seq %d", r.UUID, r.Payload, e.Key, e.Seq)
		}
		if e.Seq != next[e.Key] {
			t.Errorf("key %s: got seq %d, want %d (out of order)", e.Key, e.Seq, next[e.Key])
		}
		next[e.Key] = e.Seq + 1
		id, err := strconv.ParseInt(r.Metadata[txoutbox.MetadataOutboxID], 10, 64)
		if err != nil {
			t.Errorf("message %s: bad %s: %v", r.UUID, txoutbox.MetadataOutboxID, err)
		} else if id <= lastID[e.Key] {
			t.Errorf("key %s: outbox id %d after %d (not id order)", e.Key, id, lastID[e.Key])
		}
		lastID[e.Key] = id
	}
	if len(seen) != len(want) {
		t.Errorf("%d of %d committed events delivered", len(seen), len(want))
	}
	if dups > 0 {
		t.Logf("%d duplicate deliveries (at-least-once)", dups)
	}
}

// collect reads from msgs until every UUID in want was seen, or the deadline.
// It acks each message.
func collect(t *testing.T, msgs <-chan *message.Message, want int, timeout time.Duration, conv func(*message.Message) received) []received {
	t.Helper()
	deadline := time.After(timeout)
	var got []received
	seen := map[string]bool{}
	for len(seen) < want {
		select {
		case m, ok := <-msgs:
			if !ok {
				t.Fatalf("subscription closed after %d of %d messages", len(seen), want)
			}
			r := conv(m)
			m.Ack()
			got = append(got, r)
			seen[r.UUID] = true
		case <-deadline:
			t.Errorf("timed out: %d of %d distinct messages received", len(seen), want)
			return got
		}
	}
	return got
}

// waitFor polls cond every 20ms until it holds or timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// uniqueName returns prefix plus a short random suffix, safe as a topic,
// queue and JetStream stream name.
func uniqueName(prefix string) string {
	return prefix + "_" + strings.ToLower(watermill.NewShortUUID())
}
