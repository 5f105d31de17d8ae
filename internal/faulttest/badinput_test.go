package faulttest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/postgres"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// hostileNames are table and channel names that must never reach SQL.
var hostileNames = []string{
	"outbox; DROP TABLE victim",
	`x"; DROP TABLE victim; --`,
	`"quoted"`,
	"a.b.c",
	"таблица",
	"outbox\n",
	"outbox'",
	"out box",
	"1outbox",
	strings.Repeat("a", 65),
}

// TestHostileIdentifiersRejected gives postgres.New and sqlite.New hostile
// table and channel names: each must be refused with an error wrapping
// storage.ErrInvalidIdentifier, and the database must be untouched (the
// victim table and its row are still there, no other table appeared).
func TestHostileIdentifiersRejected(t *testing.T) {
	t.Run("postgres", func(t *testing.T) {
		pool := openPool(t, ApplicationNamePrefix+"-identifiers", 2)
		ctx := context.Background()
		schema := "txo_ident_" + strings.ToLower(watermill.NewShortUUID())[:10]
		if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema+"; CREATE TABLE "+schema+".victim (v int); INSERT INTO "+schema+".victim VALUES (1)"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
		names := append(slices.Clone(hostileNames), strings.Repeat("b", 64), schema+".victim; DROP TABLE "+schema+".victim")
		for _, name := range names {
			for _, cfg := range []postgres.Config{{Table: name}, {Table: schema + "." + name}, {Table: schema + ".outbox", NotifyChannel: name}} {
				// New never touches the server; nothing is created with a
				// name it accepted by mistake either.
				if _, err := postgres.New(pool, cfg); !errors.Is(err, storage.ErrInvalidIdentifier) {
					t.Errorf("postgres.New(table %+q, channel %+q) = %v, want an error wrapping ErrInvalidIdentifier", cfg.Table, cfg.NotifyChannel, err)
				}
			}
		}
		var tables, rows int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_tables WHERE schemaname = $1", schema).Scan(&tables); err != nil {
			t.Fatal(err)
		}
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+schema+".victim").Scan(&rows); err != nil {
			t.Fatalf("victim table gone: %v", err)
		}
		if tables != 1 || rows != 1 {
			t.Fatalf("schema holds %d tables and the victim %d rows, want 1 and 1", tables, rows)
		}
	})
	t.Run("sqlite", func(t *testing.T) {
		db, err := sqlite.Open(filepath.Join(t.TempDir(), "outbox.db"))
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		if _, err := db.Exec("CREATE TABLE victim (v int); INSERT INTO victim VALUES (1)"); err != nil {
			t.Fatal(err)
		}
		for _, name := range append(hostileNames, "sqlite_master", "main.victim") {
			if _, err := sqlite.New(db, sqlite.Config{Table: name}); !errors.Is(err, storage.ErrInvalidIdentifier) {
				t.Errorf("sqlite.New(%+q) = %v, want an error wrapping ErrInvalidIdentifier", name, err)
			}
		}
		var tables, rows int
		if err := db.QueryRow("SELECT count(*) FROM sqlite_master WHERE type = 'table'").Scan(&tables); err != nil {
			t.Fatal(err)
		}
		if err := db.QueryRow("SELECT count(*) FROM victim").Scan(&rows); err != nil {
			t.Fatalf("victim table gone: %v", err)
		}
		if tables != 1 || rows != 1 {
			t.Fatalf("database holds %d tables and the victim %d rows, want 1 and 1", tables, rows)
		}
	})
}

// TestCorruptMetadataIsDeadLettered corrupts the metadata of a record by hand
// (a JSON string instead of an object in PostgreSQL's JSONB, text that is not
// JSON in SQLite) and runs a forwarder: the record must be dead-lettered with
// a reason, the forwarder must keep running, and the later records of the
// same key must be delivered, in order.
func TestCorruptMetadataIsDeadLettered(t *testing.T) {
	type backend struct {
		store   storage.Storage
		ins     storage.Inserter
		begin   func() (tx any, commit func() error)
		exec    func(q string, args ...any) error
		inspect func(uuid string) (status, lastError string)
		table   string
		corrupt string
		ph      func(n int) string
	}
	backends := map[string]func(t *testing.T) backend{
		"postgres": func(t *testing.T) backend {
			pool := openPool(t, ApplicationNamePrefix+"-corrupt", 4)
			ctx := context.Background()
			schema := "txo_corrupt_" + strings.ToLower(watermill.NewShortUUID())[:10]
			if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
			s, err := postgres.New(pool, postgres.Config{Table: schema + ".outbox"})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.CreateSchema(ctx); err != nil {
				t.Fatal(err)
			}
			return backend{
				store: s, ins: s, table: s.Table(), corrupt: `'"not an object"'`,
				ph: func(n int) string { return fmt.Sprintf("$%d", n) },
				begin: func() (any, func() error) {
					tx, err := pool.Begin(ctx)
					if err != nil {
						t.Fatal(err)
					}
					return tx, func() error { return tx.Commit(ctx) }
				},
				exec: func(q string, args ...any) error { _, err := pool.Exec(ctx, q, args...); return err },
				inspect: func(uuid string) (string, string) {
					var st, le string
					if err := pool.QueryRow(ctx, "SELECT status, coalesce(last_error, '') FROM "+s.Table()+" WHERE uuid = $1", uuid).Scan(&st, &le); err != nil {
						t.Fatal(err)
					}
					return st, le
				},
			}
		},
		"sqlite": func(t *testing.T) backend {
			db, err := sqlite.Open(filepath.Join(t.TempDir(), "outbox.db"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			s, err := sqlite.New(db, sqlite.Config{})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.CreateSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			return backend{
				store: s, ins: s, table: `"` + s.Table() + `"`, corrupt: `'{"trace": not json'`,
				ph: func(int) string { return "?" },
				begin: func() (any, func() error) {
					tx, err := db.Begin()
					if err != nil {
						t.Fatal(err)
					}
					return tx, tx.Commit
				},
				exec: func(q string, args ...any) error { _, err := db.Exec(q, args...); return err },
				inspect: func(uuid string) (string, string) {
					var st string
					var le sql.NullString
					if err := db.QueryRow("SELECT status, last_error FROM "+`"`+s.Table()+`"`+" WHERE uuid = ?", uuid).Scan(&st, &le); err != nil {
						t.Fatal(err)
					}
					return st, le.String
				},
			}
		},
	}
	for name, mk := range backends {
		t.Run(name, func(t *testing.T) {
			b := mk(t)
			tx, commit := b.begin()
			pub, err := txoutbox.NewTxPublisher(b.ins, tx, txoutbox.PublisherConfig{})
			if err != nil {
				t.Fatal(err)
			}
			var uuids []string
			for i := range 3 {
				msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "event %d", i))
				msg.Metadata.Set(txoutbox.MetadataKey, "order-1")
				msg.Metadata.Set("trace", "t")
				if err := pub.Publish("orders", msg); err != nil {
					t.Fatal(err)
				}
				uuids = append(uuids, msg.UUID)
			}
			if err := commit(); err != nil {
				t.Fatal(err)
			}
			// Corrupt the first record of the key by hand.
			if err := b.exec("UPDATE "+b.table+" SET metadata = "+b.corrupt+" WHERE uuid = "+b.ph(1), uuids[0]); err != nil {
				t.Fatal(err)
			}

			target := &collector{}
			fwd, err := txoutbox.NewForwarder(b.store, target, txoutbox.ForwarderConfig{
				PollMin: 5 * time.Millisecond, PollMax: 20 * time.Millisecond, StorageErrorDelay: 10 * time.Millisecond,
			}, nil)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- fwd.Run(ctx) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("Run: %v", err)
				}
			}()
			deadline := time.Now().Add(10 * time.Second)
			for len(target.uuids()) < 2 {
				select {
				case err := <-done:
					t.Fatalf("forwarder stopped: %v", err)
				default:
				}
				if time.Now().After(deadline) {
					t.Fatalf("the key stalled: delivered %v of %v", target.uuids(), uuids[1:])
				}
				time.Sleep(5 * time.Millisecond)
			}
			if got := target.uuids(); len(got) != 2 || got[0] != uuids[1] || got[1] != uuids[2] {
				t.Fatalf("delivered %v, want the two healthy records %v in order", got, uuids[1:])
			}
			status, reason := b.inspect(uuids[0])
			if status != string(storage.StatusDead) || !strings.Contains(reason, "undecodable") {
				t.Fatalf("corrupt record is %s with reason %q, want dead with an undecodable-record reason", status, reason)
			}
			t.Logf("corrupt record dead-lettered: %s", reason)
		})
	}
}

// collector is a Watermill publisher that keeps the UUIDs it receives.
type collector struct {
	mu  sync.Mutex
	got []string
}

func (c *collector) Publish(_ string, msgs ...*message.Message) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, m := range msgs {
		c.got = append(c.got, m.UUID)
	}
	return nil
}

func (c *collector) Close() error { return nil }

func (c *collector) uuids() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.got...)
}
