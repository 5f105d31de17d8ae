package txoutbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// TestIntegrationPostgres is the end-to-end proof on a real Postgres: producers
// commit business rows and their events together (some roll back, some through
// database/sql), four forwarders relay from one table at once while a flaky
// target fails now and then, and what the target saw is checked: every committed
// event, no rolled-back one, per-key order of first deliveries, duplicates
// counted.
func TestIntegrationPostgres(t *testing.T) {
	pool := testPool(t)
	if pool == nil {
		t.Skip("needs Postgres")
	}
	t.Parallel()
	ctx := context.Background()
	outbox := newPostgresStorage(t, pool, postgres.Config{NotifyChannel: "txo_" + watermill.NewShortUUID()[:8]})
	table := lookup(t, outbox).table
	business := table + "_orders"
	// One business row per key: like a real order, each transaction locks it
	// (UPDATE) before writing its events, so the events of one key commit in
	// the order their ids were taken.
	if _, err := pool.Exec(ctx, "CREATE TABLE "+business+" (key TEXT PRIMARY KEY, version INT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "INSERT INTO "+business+" SELECT 'order-' || g, 0 FROM generate_series(0, 24) g"); err != nil {
		t.Fatal(err)
	}
	sqlDB := stdlib.OpenDBFromPool(pool)
	defer sqlDB.Close()

	const (
		producers   = 4
		txPerProd   = 60
		keys        = 25
		forwarders  = 4
		msgsPerTxMx = 4
	)
	target := newRecorder()
	var fails sync.Map // uuid -> failed once already
	target.setFail(func(d delivery) error {
		// Each message's first attempt fails with probability 1/10.
		if rand.IntN(10) == 0 {
			if _, loaded := fails.LoadOrStore(d.UUID, true); !loaded {
				return fmt.Errorf("injected broker failure")
			}
		}
		return nil
	})

	// Forwarders run while producers write.
	var stops []func()
	for i := range forwarders {
		f := newForwarder(t, outbox, target, txoutbox.ForwarderConfig{
			WorkerID:  fmt.Sprintf("fwd-%d", i),
			BatchSize: 50,
			Lease:     10 * time.Second,
			PollMin:   5 * time.Millisecond,
			PollMax:   100 * time.Millisecond,
			Backoff:   txoutbox.Backoff{Base: 5 * time.Millisecond, Max: 20 * time.Millisecond},
		})
		lctx, cancel := context.WithCancel(ctx)
		listenDone := make(chan struct{})
		go func() { defer close(listenDone); _ = outbox.Listen(lctx, f.Wake) }()
		stop := runForwarder(t, f)
		stops = append(stops, func() { stop(); cancel(); <-listenDone })
	}

	publisher, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	committed := map[string]string{} // uuid -> key
	rolledBack := map[string]bool{}
	var wg sync.WaitGroup
	for p := range producers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(p), 42))
			for i := range txPerProd {
				key := fmt.Sprintf("order-%d", rng.IntN(keys))
				n := 1 + rng.IntN(msgsPerTxMx)
				rollback := rng.IntN(5) == 0
				var msgs []*message.Message
				var txv any
				var commit, abort func() error
				useSQL := p%2 == 1
				if useSQL {
					tx, err := sqlDB.BeginTx(ctx, nil)
					if err != nil {
						t.Error(err)
						return
					}
					if _, err := tx.ExecContext(ctx, "UPDATE "+business+" SET version = version + 1 WHERE key = $1", key); err != nil {
						t.Error(err)
						return
					}
					txv, commit, abort = tx, tx.Commit, tx.Rollback
				} else {
					tx, err := pool.Begin(ctx)
					if err != nil {
						t.Error(err)
						return
					}
					if _, err := tx.Exec(ctx, "UPDATE "+business+" SET version = version + 1 WHERE key = $1", key); err != nil {
						t.Error(err)
						return
					}
					txv, commit, abort = tx, func() error { return tx.Commit(ctx) }, func() error { return tx.Rollback(ctx) }
				}
				for j := range n {
					msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"producer":%d,"tx":%d,"n":%d}`, p, i, j)))
					msg.Metadata.Set(txoutbox.MetadataKey, key)
					msg.SetContext(txoutbox.ContextWithTx(ctx, txv))
					msgs = append(msgs, msg)
				}
				if err := publisher.Publish("orders", msgs...); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				if rollback {
					if err := abort(); err != nil {
						t.Error(err)
					}
					for _, m := range msgs {
						rolledBack[m.UUID] = true
					}
				} else {
					if err := commit(); err != nil {
						t.Error(err)
					}
					for _, m := range msgs {
						committed[m.UUID] = key
					}
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()

	distinct := func() int {
		seen := map[string]bool{}
		for _, d := range target.deliveries() {
			seen[d.UUID] = true
		}
		return len(seen)
	}
	waitFor(t, 60*time.Second, fmt.Sprintf("%d committed events delivered", len(committed)), func() bool { return distinct() >= len(committed) })
	for _, stop := range stops {
		stop()
	}

	got := target.deliveries()
	counts := map[string]int{}
	for _, d := range got {
		counts[d.UUID]++
		if rolledBack[d.UUID] {
			t.Errorf("rolled-back event %s was delivered", d.UUID)
		}
		if _, ok := committed[d.UUID]; !ok && !rolledBack[d.UUID] {
			t.Errorf("unknown event %s delivered", d.UUID)
		}
	}
	for uuid := range committed {
		if counts[uuid] == 0 {
			t.Errorf("committed event %s lost", uuid)
		}
	}
	duplicates := 0
	for _, n := range counts {
		duplicates += n - 1
	}
	// Per key, ids follow commit order here (the business row lock), so first
	// deliveries must come in id order.
	checkOrder(t, got)
	t.Logf("committed %d events, rolled back %d, delivered %d (%d duplicates) with %d forwarders",
		len(committed), len(rolledBack), len(got), duplicates, forwarders)
	if duplicates != 0 {
		// No crash and no lease expiry happened, so no duplicate is allowed.
		t.Errorf("%d duplicates without any crash or lease expiry", duplicates)
	}

	stats, err := outbox.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if stats.Pending != 0 || stats.Leased != 0 || stats.Delivered != int64(len(committed)) {
		t.Errorf("stats after the run %+v: want 0 pending, 0 leased, %d delivered", stats, len(committed))
	}
}

// TestPublisherPostgres checks the transactional publisher on a real Postgres:
// both transaction types, rollback, one round trip for many messages, and bad
// input refused with nothing written.
func TestPublisherPostgres(t *testing.T) {
	pool := testPool(t)
	if pool == nil {
		t.Skip("needs Postgres")
	}
	t.Parallel()
	ctx := context.Background()
	outbox := newPostgresStorage(t, pool, postgres.Config{})
	table := lookup(t, outbox).table
	count := func() int {
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	pub, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{MaxPayloadBytes: 1024})
	if err != nil {
		t.Fatal(err)
	}
	newMsg := func(payload string) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte(payload))
		m.Metadata.Set("trace", "abc")
		return m
	}

	t.Run("pgx tx commit and rollback", func(t *testing.T) {
		before := count()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := pub.Bind(tx).Publish("t", newMsg("a"), newMsg("b"), newMsg("c")); err != nil {
			t.Fatal(err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if count() != before {
			t.Fatal("rolled-back messages were written")
		}
		tx, _ = pool.Begin(ctx)
		m := newMsg("d")
		m.Metadata.Set(txoutbox.MetadataKey, "k-1")
		m.SetContext(txoutbox.ContextWithTx(ctx, tx))
		if err := pub.Publish("t", m); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		var key, uuid, meta string
		if err := pool.QueryRow(ctx, "SELECT key, uuid, metadata->>'trace' FROM "+table+" ORDER BY id DESC LIMIT 1").Scan(&key, &uuid, &meta); err != nil {
			t.Fatal(err)
		}
		if key != "k-1" || uuid != m.UUID || meta != "abc" {
			t.Fatalf("stored key %q uuid %q trace %q, want k-1 %s abc", key, uuid, meta, m.UUID)
		}
	})

	t.Run("database/sql tx", func(t *testing.T) {
		db := stdlib.OpenDBFromPool(pool)
		defer db.Close()
		before := count()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := pub.Bind(tx).Publish("t", newMsg("x"), newMsg("y")); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if count() != before+2 {
			t.Fatalf("rows %d, want %d", count(), before+2)
		}
	})

	t.Run("bad input writes nothing", func(t *testing.T) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		bound := pub.Bind(tx)
		big := newMsg(string(make([]byte, 2048)))
		badMeta := newMsg("m")
		badMeta.Metadata.Set("bad", "\xff\xfe")
		noUUID := message.NewMessage("", []byte("x"))
		closed := pub.Bind(tx)
		closed.Close()
		for _, tc := range []struct {
			name string
			err  error
			call func() error
		}{
			{"empty topic", txoutbox.ErrEmptyTopic, func() error { return bound.Publish("", newMsg("a")) }},
			{"payload too large", txoutbox.ErrPayloadTooLarge, func() error { return bound.Publish("t", newMsg("ok"), big) }},
			{"invalid metadata", txoutbox.ErrInvalidMessage, func() error { return bound.Publish("t", badMeta) }},
			{"empty uuid", txoutbox.ErrInvalidMessage, func() error { return bound.Publish("t", noUUID) }},
			{"invalid topic", txoutbox.ErrInvalidMessage, func() error { return bound.Publish("t\x00", newMsg("a")) }},
			{"no transaction", txoutbox.ErrNoTransaction, func() error { return pub.Publish("t", newMsg("a")) }},
			{"closed", txoutbox.ErrPublisherClosed, func() error { return closed.Publish("t", newMsg("a")) }},
		} {
			if err := tc.call(); !errorsIs(err, tc.err) {
				t.Errorf("%s: got %v, want %v", tc.name, err, tc.err)
			}
		}
		var n int
		if err := tx.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE topic IN ('', 't') AND payload IN ('ok', 'm')").Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Fatalf("%d rows written by refused publishes", n)
		}
	})

	t.Run("unsupported tx type", func(t *testing.T) {
		err := pub.Bind("not a tx").Publish("t", newMsg("a"))
		if !errorsIs(err, storage.ErrUnsupportedTx) {
			t.Fatalf("got %v, want ErrUnsupportedTx", err)
		}
	})
}
