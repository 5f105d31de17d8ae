package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// TestNewRefusesDatabaseOpenedPlainly: New refuses a database opened with a
// plain sql.Open (rollback journal, no busy timeout, deferred BEGIN), and
// one with WAL and a busy timeout whose transactions begin DEFERRED, with an
// error that says what is missing and how to open it.
func TestNewRefusesDatabaseOpenedPlainly(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, c := range []struct {
		name, dsn string
		missing   []string
	}{
		{"plain", filepath.Join(dir, "plain.db"), []string{"journal_mode", "busy_timeout"}},
		{"deferred", "file:" + filepath.Join(dir, "deferred.db") + "?_pragma=busy_timeout(5000)&_pragma=journal_mode(WAL)", []string{"DEFERRED"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			db, err := sql.Open(sqlite.DriverName, c.dsn)
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			_, err = sqlite.New(db, sqlite.Config{})
			if !errors.Is(err, sqlite.ErrDatabaseSettings) {
				t.Fatalf("New over a database opened with %q = %v, want an error wrapping ErrDatabaseSettings", c.dsn, err)
			}
			for _, want := range append(c.missing, "sqlite.Open", "sqlite.DSNParams") {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("New's error %q does not mention %q", err, want)
				}
			}
		})
	}
	db, err := sqlite.Open(filepath.Join(dir, "open.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := sqlite.New(db, sqlite.Config{}); err != nil {
		t.Fatalf("New over sqlite.Open's database: %v", err)
	}
	own, err := sql.Open(sqlite.DriverName, "file:"+filepath.Join(dir, "own.db")+"?"+sqlite.DSNParams)
	if err != nil {
		t.Fatal(err)
	}
	defer own.Close()
	if _, err := sqlite.New(own, sqlite.Config{}); err != nil {
		t.Fatalf("New over a database opened with DSNParams: %v", err)
	}
}

// countingTarget is a broker that takes every message at once.
type countingTarget struct{ n atomic.Int64 }

func (c *countingTarget) Publish(_ string, msgs ...*message.Message) error {
	c.n.Add(int64(len(msgs)))
	return nil
}

func (c *countingTarget) Close() error { return nil }

// TestProducersBesideAForwarder: with the database opened the documented
// way (sqlite.Open: its 5 s busy timeout, not the tests' longer one), 300
// producer transactions from four goroutines, each reading then writing a
// business row and publishing through the outbox, all commit while a
// forwarder relays them, and the forwarder delivers every message. With a
// plain sql.Open, 65 and 210 of 300 such transactions failed with
// SQLITE_BUSY in two runs (New now refuses that database).
func TestProducersBesideAForwarder(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "app.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	outbox, err := sqlite.New(db, sqlite.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := outbox.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	publisher, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	target := &countingTarget{}
	fwd, err := txoutbox.NewForwarder(outbox, target, txoutbox.ForwarderConfig{PollMin: time.Millisecond, PollMax: 10 * time.Millisecond},
		watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- fwd.Run(runCtx) }()

	const producers, perProducer = 4, 75
	var published atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, producers*perProducer)
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perProducer {
				n := 1 + (p+i)%5
				err := func() error {
					tx, err := db.BeginTx(ctx, nil)
					if err != nil {
						return err
					}
					defer func() { _ = tx.Rollback() }()
					var count int
					if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&count); err != nil {
						return err
					}
					if _, err := tx.ExecContext(ctx, `INSERT INTO orders (n) VALUES (?)`, count); err != nil {
						return err
					}
					msgs := make([]*message.Message, n)
					for j := range msgs {
						msgs[j] = message.NewMessage(watermill.NewUUID(), []byte("{}"))
						msgs[j].Metadata.Set(txoutbox.MetadataKey, fmt.Sprintf("order-%d", (p*perProducer+i)%20))
						msgs[j].SetContext(txoutbox.ContextWithTx(ctx, tx))
					}
					if err := publisher.Publish("orders", msgs...); err != nil {
						return err
					}
					return tx.Commit()
				}()
				if err != nil {
					errs <- fmt.Errorf("producer %d transaction %d: %w", p, i, err)
					continue
				}
				published.Add(int64(n))
			}
		}()
	}
	wg.Wait()
	close(errs)
	failed := 0
	for err := range errs {
		failed++
		t.Error(err)
	}
	if failed > 0 {
		t.Fatalf("%d of %d producer transactions failed", failed, producers*perProducer)
	}
	for target.n.Load() < published.Load() {
		select {
		case <-ctx.Done():
			t.Fatalf("the forwarder delivered %d of %d messages", target.n.Load(), published.Load())
		case <-time.After(5 * time.Millisecond):
		}
	}
	stop()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
	if got := target.n.Load(); got != published.Load() {
		t.Fatalf("delivered %d messages, published %d", got, published.Load())
	}
}
