package txoutbox_test

import (
	"context"
	"errors"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/memory"
	"github.com/txoutbox/txoutbox/storage/mysql"
	"github.com/txoutbox/txoutbox/storage/postgres"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// TestForwarderHoldOnDeadLetter runs the real Forwarder over storages that
// hold a key on dead-letter: a poison record, dead-lettered after its
// attempts, holds back the later records of its key (even those that could
// have shared its last batch) while other keys flow; once the operator
// re-drives or skips it, the rest of the key is delivered, in order.
func TestForwarderHoldOnDeadLetter(t *testing.T) {
	stores := []struct {
		name string
		new  func(t *testing.T) (storage.Storage, func(...storage.Record) []int64)
	}{
		{"memory", func(t *testing.T) (storage.Storage, func(...storage.Record) []int64) {
			s := memory.New(memory.Config{HoldOnDeadLetter: true})
			return s, s.Add
		}},
		{"sqlite", func(t *testing.T) (storage.Storage, func(...storage.Record) []int64) {
			db, err := sqlite.Open(filepath.Join(t.TempDir(), "outbox.db"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			s, err := sqlite.New(db, sqlite.Config{HoldOnDeadLetter: true})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			sqlStores.Store(storage.Storage(s), &sqlStore{db: db, table: `"` + s.Table() + `"`})
			return s, func(recs ...storage.Record) []int64 {
				tx, err := db.Begin()
				if err != nil {
					t.Fatal(err)
				}
				publishAll(t, s, tx, recs)
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
				return idsOf(t, s, len(recs))
			}
		}},
		{"postgres", func(t *testing.T) (storage.Storage, func(...storage.Record) []int64) {
			pool := testPool(t)
			s := newPostgresStorage(t, pool, postgres.Config{HoldOnDeadLetter: true})
			return s, func(recs ...storage.Record) []int64 {
				return postgresBackend(pool).insert(t, s, recs...)
			}
		}},
	}
	if dsn := testMySQLDSN(t); dsn != "" {
		stores = append(stores, struct {
			name string
			new  func(t *testing.T) (storage.Storage, func(...storage.Record) []int64)
		}{"mysql", func(t *testing.T) (storage.Storage, func(...storage.Record) []int64) {
			s := newMySQLStorage(t, dsn, mysql.Config{HoldOnDeadLetter: true})
			return s, func(recs ...storage.Record) []int64 { return mysqlBackend(dsn).insert(t, s, recs...) }
		}})
	}
	for _, st := range stores {
		for _, resolve := range []string{"redrive", "skip", "skip-max-attempts-1"} {
			t.Run(st.name+"/"+resolve, func(t *testing.T) {
				t.Parallel()
				s, insert := st.new(t)
				op := s.(storage.Operator)
				ids := insert(record("t", "a", "poison"), record("t", "a", "a2"), record("t", "a", "a3"),
					record("t", "b", "b1"), record("t", "", "free"))
				poison := ids[0]

				var poisoned atomic.Bool
				poisoned.Store(true)
				target := newRecorder()
				target.setFail(func(d delivery) error {
					if d.ID == poison && poisoned.Load() {
						return errors.New("poison message")
					}
					return nil
				})
				cfg := fastConfig()
				cfg.MaxAttempts = 3
				if resolve == "skip-max-attempts-1" {
					// The head's first attempt is its last: the storage
					// hands out the rest of the key with it, and only the
					// forwarder can keep them back.
					cfg.MaxAttempts = 1
				}
				f := newForwarder(t, s, target, cfg)
				stop := runForwarder(t, f)

				ctx := context.Background()
				waitFor(t, 20*time.Second, "the poison record dead-lettered and the other keys delivered", func() bool {
					stats, err := op.Stats(ctx)
					return err == nil && stats.Dead == 1 && len(target.deliveries()) >= 2
				})
				// Give the forwarder rounds to (wrongly) deliver the held records.
				time.Sleep(200 * time.Millisecond)
				for _, d := range target.deliveries() {
					if d.Key == "a" {
						t.Fatalf("record %d (%s) of key a delivered while its head %d was dead: with HoldOnDeadLetter a dead record holds back its key", d.ID, d.Payload, poison)
					}
				}
				held, err := op.HeldKeys(ctx, storage.HeldKeysParams{})
				if err != nil || len(held) != 1 || held[0].Key != "a" || held[0].Reason != storage.HoldDead || held[0].HeadID != poison || held[0].Behind != 2 {
					t.Fatalf("HeldKeys = %+v, %v; want key a held by dead record %d with 2 behind", held, err, poison)
				}
				if stats, err := op.Stats(ctx); err != nil || stats.HeldKeys != 1 {
					t.Fatalf("Stats = %+v, %v; want HeldKeys 1", stats, err)
				}

				want := []string{"a2", "a3"}
				switch resolve {
				case "redrive":
					poisoned.Store(false) // the consumer was fixed
					if n, err := op.Redrive(ctx, storage.RedriveParams{Key: "a"}); err != nil || n != 1 {
						t.Fatalf("Redrive(key a) = %d, %v; want 1", n, err)
					}
					want = []string{"poison", "a2", "a3"}
				case "skip", "skip-max-attempts-1":
					if err := op.Skip(ctx, storage.SkipParams{ID: poison, Reason: "test"}); err != nil {
						t.Fatal(err)
					}
				}
				var gotA []string
				waitFor(t, 20*time.Second, "key a delivered after "+resolve, func() bool {
					gotA = gotA[:0]
					for _, d := range target.deliveries() {
						if d.Key == "a" {
							gotA = append(gotA, d.Payload)
						}
					}
					return len(gotA) >= len(want)
				})
				stop()
				if !slices.Equal(gotA, want) {
					t.Fatalf("key a delivered %v after %s, want %v in id order", gotA, resolve, want)
				}
				checkOrder(t, target.deliveries())
			})
		}
	}
}
