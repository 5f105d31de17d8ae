package txoutbox_test

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

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/memory"
	"github.com/txoutbox/txoutbox/storage/postgres"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// state is what a test reads back about one record.
type state struct {
	Status    storage.Status
	Attempts  int
	LastError string
	LeasedBy  string
}

// backend is a storage the forwarder tests run on: the real databases, and the
// in-memory reference.
type backend struct {
	name    string
	new     func(t *testing.T) storage.Storage
	insert  func(t *testing.T, s storage.Storage, recs ...storage.Record) []int64
	inspect func(t *testing.T, s storage.Storage, id int64) state
}

func backends(t *testing.T) []backend {
	bs := []backend{memoryBackend(), sqliteBackend()}
	if pool := testPool(t); pool != nil {
		bs = append(bs, postgresBackend(pool))
	}
	if dsn := testMySQLDSN(t); dsn != "" {
		bs = append(bs, mysqlBackend(dsn))
	}
	return bs
}

func memoryBackend() backend {
	return backend{
		name: "memory",
		new:  func(t *testing.T) storage.Storage { return memory.New(memory.Config{}) },
		insert: func(t *testing.T, s storage.Storage, recs ...storage.Record) []int64 {
			return s.(*memory.Storage).Add(recs...)
		},
		inspect: func(t *testing.T, s storage.Storage, id int64) state {
			st, ok := s.(*memory.Storage).Get(id)
			if !ok {
				t.Fatalf("record %d not found", id)
			}
			return state{Status: st.Status, Attempts: st.Record.Attempts, LastError: st.LastError, LeasedBy: st.LeasedBy}
		},
	}
}

// sqlStores remembers the database behind each SQL storage for inspection.
var sqlStores sync.Map // storage.Storage -> *sqlStore

type sqlStore struct {
	db    *sql.DB       // sqlite
	pool  *pgxpool.Pool // postgres
	table string
	lease string // postgres: the lease table
	done  string // postgres: the delivered table
}

func sqliteBackend() backend {
	return backend{
		name: "sqlite",
		new: func(t *testing.T) storage.Storage {
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
			sqlStores.Store(storage.Storage(s), &sqlStore{db: db, table: `"` + s.Table() + `"`})
			return s
		},
		insert: func(t *testing.T, s storage.Storage, recs ...storage.Record) []int64 {
			db := lookup(t, s).db
			tx, err := db.Begin()
			if err != nil {
				t.Fatal(err)
			}
			publishAll(t, s.(storage.Inserter), tx, recs)
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			return idsOf(t, s, len(recs))
		},
		inspect: inspectSQL,
	}
}

func postgresBackend(pool *pgxpool.Pool) backend {
	return backend{
		name: "postgres",
		new: func(t *testing.T) storage.Storage {
			return newPostgresStorage(t, pool, postgres.Config{})
		},
		insert: func(t *testing.T, s storage.Storage, recs ...storage.Record) []int64 {
			ctx := context.Background()
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			publishAll(t, s.(storage.Inserter), tx, recs)
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			return idsOf(t, s, len(recs))
		},
		inspect: inspectSQL,
	}
}

// newPostgresStorage makes a storage over a table in a fresh schema that is
// dropped when the test ends.
func newPostgresStorage(t *testing.T, pool *pgxpool.Pool, cfg postgres.Config) *postgres.Storage {
	t.Helper()
	ctx := context.Background()
	schema := "txo_" + strings.ToLower(watermill.NewShortUUID())
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	cfg.Table = schema + ".outbox"
	s, err := postgres.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CreateSchema(ctx); err != nil {
		t.Fatal(err)
	}
	sqlStores.Store(storage.Storage(s), &sqlStore{pool: pool, table: schema + ".outbox", lease: s.LeaseTable(), done: s.DeliveredTable()})
	return s
}

// publishAll writes recs through the transactional publisher bound to tx.
func publishAll(t *testing.T, ins storage.Inserter, tx any, recs []storage.Record) {
	t.Helper()
	pub, err := txoutbox.NewTxPublisher(ins, tx, txoutbox.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		msg := message.NewMessage(r.UUID, r.Payload)
		for k, v := range r.Metadata {
			msg.Metadata.Set(k, v)
		}
		if r.Key != "" {
			msg.Metadata.Set(txoutbox.MetadataKey, r.Key)
		}
		if !r.DueAt.IsZero() {
			txoutbox.DeliverAt(msg, r.DueAt)
		}
		if err := pub.Publish(r.Topic, msg); err != nil {
			t.Fatalf("Publish: %v", err)
		}
	}
}

func lookup(t *testing.T, s storage.Storage) *sqlStore {
	v, ok := sqlStores.Load(s)
	if !ok {
		t.Fatalf("storage %T not registered", s)
	}
	return v.(*sqlStore)
}

// idsOf returns the ids of the last n records inserted.
func idsOf(t *testing.T, s storage.Storage, n int) []int64 {
	t.Helper()
	st := lookup(t, s)
	q := fmt.Sprintf("SELECT id FROM %s ORDER BY id DESC LIMIT %d", st.table, n)
	var ids []int64
	if st.db != nil {
		rows, err := st.db.Query(q)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
	} else {
		rows, err := st.pool.Query(context.Background(), q)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
	}
	for i, j := 0, len(ids)-1; i < j; i, j = i+1, j-1 {
		ids[i], ids[j] = ids[j], ids[i]
	}
	return ids
}

func inspectSQL(t *testing.T, s storage.Storage, id int64) state {
	t.Helper()
	st := lookup(t, s)
	var out state
	var status string
	var err error
	if st.db != nil {
		q := "SELECT status, attempts, coalesce(last_error, ''), coalesce(leased_by, '') FROM " + st.table + " WHERE id = ?"
		err = st.db.QueryRow(q, id).Scan(&status, &out.Attempts, &out.LastError, &out.LeasedBy)
	} else {
		q := "SELECT o.status, coalesce(l.attempts, o.attempts), coalesce(o.last_error, ''), coalesce(l.leased_by, '') FROM " +
			st.table + " o LEFT JOIN " + st.lease + " l ON l.id = o.id WHERE o.id = $1" +
			" UNION ALL SELECT 'delivered', d.attempts, coalesce(d.last_error, ''), '' FROM " + st.done + " d WHERE d.id = $1"
		err = st.pool.QueryRow(context.Background(), q, id).Scan(&status, &out.Attempts, &out.LastError, &out.LeasedBy)
	}
	if err != nil {
		t.Fatalf("inspect record %d: %v", id, err)
	}
	out.Status = storage.Status(status)
	return out
}

var (
	poolOnce sync.Once
	pool     *pgxpool.Pool
	poolErr  error
)

// testPool returns a pool on TEST_DATABASE_URL, or nil (test skipped parts)
// when Postgres is not reachable outside CI. With CI=true it fails instead.
func testPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	poolOnce.Do(func() {
		url := cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			poolErr = err
			return
		}
		// A forwarder holds up to three connections at once (claim, ack,
		// lease extension), and parallel cases run four forwarders each: a
		// starved ack lands after its lease and the record is published twice.
		cfg.MaxConns = 40
		pool, poolErr = pgxpool.NewWithConfig(context.Background(), cfg)
		if poolErr == nil {
			poolErr = pool.Ping(context.Background())
		}
	})
	if poolErr != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("Postgres unreachable at TEST_DATABASE_URL: %v", poolErr)
		}
		t.Logf("Postgres unreachable (%v): skipping its cases; start it with `pg_ctlcluster --skip-systemctl-redirect 15 main start`", poolErr)
		return nil
	}
	return pool
}
