package console

import (
	"cmp"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"os"
	"testing"
	"time"

	_ "github.com/go-sql-driver/mysql"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/mysql"
)

// newMySQL returns a migrated MySQL storage holding keys on dead-letter, on
// a fresh table of TEST_MYSQL_DSN (default: the local MariaDB) and a pool
// of its own, both gone when the test ends. Without a server it skips the
// test (fails with CI=true).
func newMySQL(t *testing.T) (*mysql.Storage, *sql.DB) {
	t.Helper()
	dsn := cmp.Or(os.Getenv("TEST_MYSQL_DSN"), "root@tcp(127.0.0.1:3306)/test")
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		if os.Getenv("CI") == "true" {
			t.Fatalf("MySQL unreachable at TEST_MYSQL_DSN: %v", err)
		}
		t.Skipf("MySQL unreachable at TEST_MYSQL_DSN (%v): start it with `start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd`", err)
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	table := "txo_console_" + hex.EncodeToString(b[:])
	t.Cleanup(func() {
		_, _ = db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_skipped, " + table + "_migrations, " + table + "_inbox")
		_ = db.Close()
	})
	s, err := mysql.New(db, mysql.Config{Table: table, HoldOnDeadLetter: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s, db
}

// insertMySQL commits records in one transaction and returns their ids
// (one multi-row INSERT numbers them consecutively from LAST_INSERT_ID()).
func insertMySQL(t *testing.T, s *mysql.Storage, db *sql.DB, recs []storage.Record) ([]int64, error) {
	ctx := context.Background()
	tx, err := db.Begin()
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback() }()
	if err := s.Insert(ctx, tx, recs); err != nil {
		return nil, err
	}
	var first int64
	if err := tx.QueryRowContext(ctx, "SELECT LAST_INSERT_ID()").Scan(&first); err != nil {
		return nil, err
	}
	if err := tx.Commit(); err != nil {
		return nil, err
	}
	ids := make([]int64, len(recs))
	for i := range ids {
		ids[i] = first + int64(i)
	}
	return ids, nil
}

// seedMySQL does what seed does on a fresh MySQL table.
func seedMySQL(t *testing.T, recs ...deadRec) (testStore, []int64) {
	t.Helper()
	s, db := newMySQL(t)
	var ids []int64
	if len(recs) > 0 {
		var err error
		if ids, err = insertMySQL(t, s, db, records(recs)); err != nil {
			t.Fatal(err)
		}
		deadLetter(t, s, ids, recs)
	}
	return s, ids
}
