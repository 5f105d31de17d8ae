package sqlite_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// The producer writes an outbox record in its own transaction; a forwarder
// claims it, publishes it and acks it.
func Example() {
	dir, err := os.MkdirTemp("", "outbox-example")
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = os.RemoveAll(dir) }()

	db, err := sqlite.Open(filepath.Join(dir, "app.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = db.Close() }()
	outbox, err := sqlite.New(db, sqlite.Config{})
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	if err := outbox.CreateSchema(ctx); err != nil {
		log.Fatal(err)
	}

	// Producer: business rows and the outbox record commit together.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := tx.ExecContext(ctx, `CREATE TABLE orders (id TEXT PRIMARY KEY)`); err != nil {
		log.Fatal(err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO orders (id) VALUES ('o-1')`); err != nil {
		log.Fatal(err)
	}
	err = outbox.Insert(ctx, tx, []storage.Record{{
		UUID: "3b4c0d5e", Topic: "orders.created", Key: "o-1", Payload: []byte(`{"id":"o-1"}`),
	}})
	if err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}

	// Forwarder: claim, publish (here: print), ack.
	records, err := outbox.Claim(ctx, storage.ClaimParams{BatchSize: 10, Lease: 30 * time.Second, WorkerID: "worker-1"})
	if err != nil {
		log.Fatal(err)
	}
	for _, r := range records {
		fmt.Printf("%s key=%s attempt=%d %s\n", r.Topic, r.Key, r.Attempts, r.Payload)
	}
	if err := outbox.Ack(ctx, storage.AckParams{IDs: []int64{records[0].ID}, WorkerID: "worker-1"}); err != nil {
		log.Fatal(err)
	}
	stats, err := outbox.Stats(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("pending=%d delivered=%d\n", stats.Pending, stats.Delivered)
	// Output:
	// orders.created key=o-1 attempt=1 {"id":"o-1"}
	// pending=0 delivered=1
}
