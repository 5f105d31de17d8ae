package postgres_test

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// Example writes two records in a business transaction, then claims and acks
// them the way the forwarder does. It needs the database of the tests.
func Example() {
	ctx := context.Background()
	url := cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	// A schema of its own, so the example leaves nothing behind.
	schema := fmt.Sprintf("txoutbox_example_%d", time.Now().UnixNano())
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE") //nolint:errcheck // example clean-up

	store, err := postgres.New(pool, postgres.Config{Table: schema + ".outbox"})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := store.CreateSchema(ctx); err != nil {
		fmt.Println(err)
		return
	}

	// The producer: business rows and outbox records commit together.
	tx, err := pool.Begin(ctx)
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
	if err := tx.Commit(ctx); err != nil {
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
