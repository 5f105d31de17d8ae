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

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/mysql"
)

// TestIntegrationMySQL is TestIntegrationPostgres on MySQL (MariaDB in CI):
// four producers commit business rows and their events together (a fifth of
// the transactions roll back), four forwarders relay from one table at once
// while a flaky target fails now and then, and the target must have seen
// every committed event, no rolled-back one, and each key's events first
// delivered in id order. There is no NOTIFY on MySQL: forwarders poll, and
// producers wake them after each commit, as a process that does both would.
func TestIntegrationMySQL(t *testing.T) {
	dsn := testMySQLDSN(t)
	if dsn == "" {
		t.Skip("needs MySQL")
	}
	t.Parallel()
	ctx := context.Background()
	outbox := newMySQLStorage(t, dsn, mysql.Config{})
	db := lookup(t, outbox).db
	business := outbox.Table()[:len(outbox.Table())-1] + "_orders`"
	// One business row per key, locked (UPDATE) by each transaction before
	// it writes its events, so the events of one key commit in id order.
	if _, err := db.ExecContext(ctx, "CREATE TABLE "+business+" (k VARCHAR(64) PRIMARY KEY, version INT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + business) })
	const (
		producers   = 4
		txPerProd   = 60
		keys        = 25
		forwarders  = 4
		msgsPerTxMx = 4
	)
	for k := range keys {
		if _, err := db.ExecContext(ctx, "INSERT INTO "+business+" VALUES (?, 0)", fmt.Sprintf("order-%d", k)); err != nil {
			t.Fatal(err)
		}
	}

	target := newRecorder()
	var fails sync.Map // uuid -> failed once already
	target.setFail(func(d delivery) error {
		if rand.IntN(10) == 0 {
			if _, loaded := fails.LoadOrStore(d.UUID, true); !loaded {
				return fmt.Errorf("injected broker failure")
			}
		}
		return nil
	})

	var stops []func()
	var fwds []*txoutbox.Forwarder
	for i := range forwarders {
		f := newForwarder(t, outbox, target, txoutbox.ForwarderConfig{
			WorkerID:  fmt.Sprintf("fwd-%d", i),
			BatchSize: 50,
			Lease:     10 * time.Second,
			PollMin:   5 * time.Millisecond,
			PollMax:   100 * time.Millisecond,
			Backoff:   txoutbox.Backoff{Base: 5 * time.Millisecond, Max: 20 * time.Millisecond},
		})
		fwds = append(fwds, f)
		stops = append(stops, runForwarder(t, f))
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
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					t.Error(err)
					return
				}
				if _, err := tx.ExecContext(ctx, "UPDATE "+business+" SET version = version + 1 WHERE k = ?", key); err != nil {
					t.Error(err)
					return
				}
				var msgs []*message.Message
				for j := range n {
					msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"producer":%d,"tx":%d,"n":%d}`, p, i, j)))
					msg.Metadata.Set(txoutbox.MetadataKey, key)
					msg.SetContext(txoutbox.ContextWithTx(ctx, tx))
					msgs = append(msgs, msg)
				}
				if err := publisher.Publish("orders", msgs...); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				if rollback {
					if err := tx.Rollback(); err != nil {
						t.Error(err)
					}
					for _, m := range msgs {
						rolledBack[m.UUID] = true
					}
				} else {
					if err := tx.Commit(); err != nil {
						t.Error(err)
					}
					for _, m := range msgs {
						committed[m.UUID] = key
					}
				}
				mu.Unlock()
				if !rollback {
					fwds[rng.IntN(len(fwds))].Wake() // no NOTIFY on MySQL
				}
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
	checkOrder(t, got)
	t.Logf("committed %d events, rolled back %d, delivered %d (%d duplicates) with %d forwarders",
		len(committed), len(rolledBack), len(got), duplicates, forwarders)
	if duplicates != 0 {
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

// TestPublisherMySQL checks the transactional publisher on MySQL: a
// rollback writes nothing, many messages go in one Publish, bad input is
// refused with nothing written.
func TestPublisherMySQL(t *testing.T) {
	dsn := testMySQLDSN(t)
	if dsn == "" {
		t.Skip("needs MySQL")
	}
	t.Parallel()
	ctx := context.Background()
	outbox := newMySQLStorage(t, dsn, mysql.Config{})
	db := lookup(t, outbox).db
	count := func() int {
		var n int
		if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+outbox.Table()).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	pub, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{MaxPayloadBytes: 1024})
	if err != nil {
		t.Fatal(err)
	}
	newMsg := func(payload string) *message.Message { return message.NewMessage(watermill.NewUUID(), []byte(payload)) }

	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Bind(tx).Publish("t", newMsg("a"), newMsg("b")); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if count() != 0 {
		t.Fatal("rolled-back messages were written")
	}
	tx, _ = db.BeginTx(ctx, nil)
	var msgs []*message.Message
	for i := range 500 {
		msgs = append(msgs, newMsg(fmt.Sprint(i)))
	}
	if err := pub.Bind(tx).Publish("t", msgs...); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if count() != 500 {
		t.Fatalf("%d rows after committing 500 messages", count())
	}

	tx, _ = db.BeginTx(ctx, nil)
	defer tx.Rollback()
	bound := pub.Bind(tx)
	for name, publish := range map[string]func() error{
		"empty topic":      func() error { return bound.Publish("", newMsg("x")) },
		"payload too big":  func() error { return bound.Publish("t", newMsg("ok"), newMsg(string(make([]byte, 2000)))) },
		"no tx in context": func() error { return pub.Publish("t", newMsg("x")) },
	} {
		if err := publish(); err == nil {
			t.Errorf("%s: Publish succeeded, want an error", name)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if count() != 500 {
		t.Fatalf("%d rows after refused publishes, want 500", count())
	}
}
