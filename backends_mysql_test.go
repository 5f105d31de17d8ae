package txoutbox_test

import (
	"cmp"
	"context"
	"database/sql"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	_ "github.com/go-sql-driver/mysql"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/mysql"
)

var (
	mysqlOnce sync.Once
	mysqlErr  error
)

// testMySQLDSN returns TEST_MYSQL_DSN (default: the local MariaDB), or ""
// when no server answers outside CI (the MySQL cases are then left out).
// With CI=true it fails instead.
func testMySQLDSN(t *testing.T) string {
	t.Helper()
	dsn := cmp.Or(os.Getenv("TEST_MYSQL_DSN"), "root@tcp(127.0.0.1:3306)/test")
	mysqlOnce.Do(func() {
		db, err := sql.Open("mysql", dsn)
		if err != nil {
			mysqlErr = err
			return
		}
		defer db.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		mysqlErr = db.PingContext(ctx)
	})
	if mysqlErr != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("MySQL unreachable at TEST_MYSQL_DSN: %v", mysqlErr)
		}
		t.Logf("MySQL unreachable (%v): skipping its cases; start it with `start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd`", mysqlErr)
		return ""
	}
	return dsn
}

func mysqlBackend(dsn string) backend {
	return backend{
		name: "mysql",
		new: func(t *testing.T) storage.Storage {
			return newMySQLStorage(t, dsn, mysql.Config{})
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
		// inspectSQL's database/sql query reads the same columns on MySQL.
		inspect: inspectSQL,
	}
}

// newMySQLStorage makes a storage over a fresh table, on a pool of its own
// (closed with the test, so no pool goroutine outlives the run), and drops
// the table when the test ends.
func newMySQLStorage(t *testing.T, dsn string, cfg mysql.Config) *mysql.Storage {
	t.Helper()
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(16)
	table := "txo_" + strings.ToLower(watermill.NewShortUUID())
	t.Cleanup(func() {
		db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_skipped, " + table + "_migrations, " + table + "_keys, " + table + "_inbox")
		db.Close()
	})
	cfg.Table = table
	s, err := mysql.New(db, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CreateSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	sqlStores.Store(storage.Storage(s), &sqlStore{db: db, table: s.Table()})
	return s
}
