// Package sqlite is the embedded outbox storage: the outbox table lives in
// the application's own SQLite database file, so a single binary gets a
// transactional outbox without a database server. It uses the pure-Go
// driver modernc.org/sqlite (driver name "sqlite"), so no cgo is needed.
//
// # Usage
//
// Open the database with [Open], which sets WAL, a busy timeout and BEGIN
// IMMEDIATE (or add [DSNParams] to your own data source name: [New] refuses
// a database without them), build the storage, bring the schema up to date,
// and write outbox records in the same transaction as the business rows:
//
//	db, err := sqlite.Open("app.db")
//	if err != nil {
//		return err
//	}
//	outbox, err := sqlite.New(db, sqlite.Config{})
//	if err != nil {
//		return err
//	}
//	if err := outbox.Migrate(ctx); err != nil { // versioned; safe to run concurrently
//		return err
//	}
//
//	// Producers: the event is written through the business transaction.
//	publisher, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
//	// ... tx, _ := db.BeginTx(ctx, nil) (BEGIN IMMEDIATE: takes the write lock);
//	// msg.SetContext(txoutbox.ContextWithTx(ctx, tx)); publisher.Publish("orders.created", msg);
//	// tx.Commit(): the record exists if and only if the business rows do
//
//	// The relay: any Watermill publisher is the target.
//	forwarder, err := txoutbox.NewForwarder(outbox, target, txoutbox.ForwarderConfig{}, logger)
//	err = forwarder.Run(ctx)
//
// examples/quickstart in the repository is this, as a program with its
// test. Any number of forwarders may share the file, as goroutines on one
// *sql.DB or as separate processes.
//
// # Who calls what
//
// [Storage] has many methods because three parties use it. An application
// calls only the first group.
//
//   - Your application: [Open], [New], [Storage.Migrate] (or
//     [Storage.CreateSchema]; [Storage.SchemaSQL], [Storage.Migrations] and
//     [Migrations] for your own migration tool), and [Storage.Insert], which
//     the txoutbox.Publisher calls for you; on the consumer's side,
//     [Storage.Inbox] for the inbox package.
//   - The forwarder, through the relay protocol ([storage.Storage]):
//     [Storage.Claim], [Storage.Ack], [Storage.Nack], [Storage.Release],
//     [Storage.DeadLetter], [Storage.Extend]. Do not call them yourself.
//   - Operators, through the txoutbox command, the web console or your own
//     admin endpoint ([storage.Operator], [storage.Migrator],
//     [storage.Diagnoser]): [Storage.Stats], [Storage.HeldKeys],
//     [Storage.ListDead], [Storage.Record], [Storage.Redrive],
//     [Storage.Skip], [Storage.Purge], [Storage.MigrationStatus],
//     [Storage.MigrateReport], [Storage.Diagnose].
//   - Introspection, for tools: [Storage.Table], [Storage.SkippedTable],
//     [Storage.MigrationTable], [Storage.StrictOrdering],
//     [Storage.HoldOnDeadLetter].
//
// # Guarantees
//
//   - A claim never hands a leased record to another worker: it is one
//     write transaction, and SQLite has one writer at a time. Write-backs
//     are fenced on the claim that returned the record.
//   - Strict ordering (on by default): a record is not claimed while an
//     earlier pending record of its key is leased, waits for its retry or
//     is set aside, nor while an earlier dead record holds the key
//     ([Config.HoldOnDeadLetter]).
//   - Records held back cost the claims of other keys nothing: a claim
//     reads the records it hands out and the ones in flight, never those
//     queued behind a key.
//   - Ids are commit order: writers are serialised, so a record's id is
//     taken and committed before the next writer begins.
//   - A claim that finds nothing takes no write lock.
//
// Timestamps are Unix nanoseconds from the application clock: SQLite runs
// inside the application, so there is no separate database clock to drift
// from. How claims set records aside and free them is described in
// docs/design.md in the repository
// (https://github.com/txoutbox/txoutbox/blob/main/docs/design.md).
package sqlite
