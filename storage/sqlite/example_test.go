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
	if err := outbox.Migrate(ctx); err != nil {
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
	if err := outbox.Ack(ctx, storage.AckParams{Records: []storage.ClaimRef{records[0].Ref()}, WorkerID: "worker-1"}); err != nil {
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

// An operator's day: migrate, find the dead letter, read it, re-drive its
// key. The txoutbox command does the same through storage.Operator.
func ExampleStorage_Migrate() {
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
	outbox, err := sqlite.New(db, sqlite.Config{HoldOnDeadLetter: true})
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	if err := outbox.Migrate(ctx); err != nil { // safe to run from every instance at start
		log.Fatal(err)
	}
	ms, err := outbox.MigrationStatus(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("schema version %d of %d\n", ms.Current, ms.Latest)

	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	err = outbox.Insert(ctx, tx, []storage.Record{
		{UUID: "u-1", Topic: "orders", Key: "o-1", Payload: []byte(`{"v":1}`)},
		{UUID: "u-2", Topic: "orders", Key: "o-1", Payload: []byte(`{"v":2}`)},
	})
	if err == nil {
		err = tx.Commit()
	}
	if err != nil {
		log.Fatal(err)
	}
	// A forwarder gives up on the first record: with HoldOnDeadLetter it
	// holds back the second.
	recs, err := outbox.Claim(ctx, storage.ClaimParams{BatchSize: 1, Lease: time.Minute, WorkerID: "fwd-1"})
	if err != nil {
		log.Fatal(err)
	}
	if err := outbox.DeadLetter(ctx, storage.DeadLetterParams{Record: recs[0].Ref(), WorkerID: "fwd-1", Error: "schema rejected"}); err != nil {
		log.Fatal(err)
	}

	var op storage.Operator = outbox
	held, err := op.HeldKeys(ctx, storage.HeldKeysParams{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("key %s held by record %d (%s), %d behind\n", held[0].Key, held[0].HeadID, held[0].Reason, held[0].Behind)
	dead, err := op.ListDead(ctx, storage.ListDeadParams{Topic: "orders"})
	if err != nil {
		log.Fatal(err)
	}
	full, err := op.Record(ctx, dead[0].Record.ID)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("dead: %d %s %q\n", full.Record.ID, full.Record.Payload, full.LastError)
	n, err := op.Redrive(ctx, storage.RedriveParams{Key: "o-1"})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("re-driven:", n)
	// Output:
	// schema version 5 of 5
	// key o-1 held by record 1 (dead), 1 behind
	// dead: 1 {"v":1} "schema rejected"
	// re-driven: 1
}
