package mysql_test

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"os"
	"time"

	_ "github.com/go-sql-driver/mysql"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/mysql"
)

// Example writes two records in a business transaction, then claims and acks
// them the way the forwarder does. It needs the database of the tests.
func Example() {
	ctx := context.Background()
	db, err := sql.Open("mysql", cmp.Or(os.Getenv("TEST_MYSQL_DSN"), "root@tcp(127.0.0.1:3306)/test"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer db.Close()
	// A table of its own, so the example leaves nothing behind.
	table := fmt.Sprintf("txoutbox_example_%d", time.Now().UnixNano())
	defer db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_skipped, " + table + "_migrations, " + table + "_inbox") //nolint:errcheck // example clean-up

	store, err := mysql.New(db, mysql.Config{Table: table})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := store.CreateSchema(ctx); err != nil {
		fmt.Println(err)
		return
	}

	// The producer: business rows and outbox records commit together.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	err = store.Insert(ctx, tx, []storage.Record{
		{UUID: "3f1c0e1a-0001", Topic: "orders.placed", Key: "order-1", Payload: []byte(`{"id":1}`)},
		{UUID: "3f1c0e1a-0002", Topic: "orders.paid", Key: "order-1", Payload: []byte(`{"id":1}`)},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := tx.Commit(); err != nil {
		fmt.Println(err)
		return
	}

	// The relay: claim a leased batch, publish it, ack it.
	records, err := store.Claim(ctx, storage.ClaimParams{BatchSize: 10, Lease: 30 * time.Second, WorkerID: "worker-1"})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, r := range records {
		fmt.Println(r.Topic, r.Key, string(r.Payload), "attempt", r.Attempts)
	}
	if err := store.Ack(ctx, storage.AckParams{Records: storage.Refs(records), WorkerID: "worker-1"}); err != nil {
		fmt.Println(err)
		return
	}
	stats, err := store.Stats(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("pending", stats.Pending, "delivered", stats.Delivered)
	// Output:
	// orders.placed order-1 {"id":1} attempt 1
	// orders.paid order-1 {"id":1} attempt 1
	// pending 0 delivered 2
}

// ExampleNew shows the configuration of a storage; New does not touch the
// database.
func ExampleNew() {
	db, err := sql.Open("mysql", "app@tcp(127.0.0.1:3306)/app")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer db.Close()
	store, err := mysql.New(db, mysql.Config{Table: "app.outbox", VisibilityDelay: 2 * time.Second})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(store.Table(), store.StrictOrdering())
	_, err = mysql.New(db, mysql.Config{Table: "outbox; DROP TABLE users"})
	fmt.Println(err)
	// Output:
	// `app`.`outbox` true
	// mysql: invalid config: Config.Table: invalid SQL identifier: "outbox; DROP TABLE users": use ASCII letters, digits and underscores, not starting with a digit
}
