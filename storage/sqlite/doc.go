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
//	if err != nil { ... }
//	outbox, err := sqlite.New(db, sqlite.Config{})
//	if err != nil { ... }
//	if err := outbox.Migrate(ctx); err != nil { ... } // versioned; safe to run concurrently
//
//	tx, err := db.BeginTx(ctx, nil) // BEGIN IMMEDIATE: takes the write lock
//	// ... business writes through tx ...
//	err = outbox.Insert(ctx, tx, []storage.Record{{
//		UUID: watermill.NewUUID(), Topic: "orders", Key: orderID, Payload: body,
//	}})
//	err = tx.Commit() // the record exists if and only if the business rows do
//
// Forwarders claim, publish and acknowledge the records through the
// [storage.Storage] methods; any number of them may share the file, as
// goroutines on one *sql.DB or as separate processes. [Storage.Migrations]
// gives the schema steps to your own migration tool instead.
//
// # Guarantees
//
//   - A claim never hands a leased record to another worker: it is one
//     write transaction, and SQLite has one writer at a time. Write-backs
//     (Ack, Nack, Release, DeadLetter, Extend) are fenced on the worker
//     that holds the lease.
//   - Strict ordering (on by default): a record is not claimed while an
//     earlier pending record of its key is leased, waits for its retry or
//     is set aside, nor while an earlier dead record holds the key
//     ([Config.HoldOnDeadLetter]).
//   - Records held back cost the claims of other keys nothing: a claim
//     reads the records it hands out and the ones in flight, never those
//     queued behind a key, however many there are (a key whose head waits
//     for an hour-long retry with 200,000 records behind it, or 20,000 such
//     keys, or a hung publish holding a key's backlog in flight).
//   - Ids are commit order: writers are serialised, so a record's id is
//     taken and committed before the next writer begins. created_at never
//     decreases in id order (Insert takes the later of the clock and the
//     newest record's), so [Config.VisibilityDelay] never shows a record
//     while an earlier one is hidden, even when the clock steps back.
//   - A claim that finds nothing takes no write lock: it looks first with a
//     read, which in WAL mode waits for no writer.
//
// # Design
//
// A pending record's hold column says why it is set aside: 'retry' while
// it waits for its own due time, 'behind' while an earlier record of its
// key is pending (or dead and holding the key); claims walk only the
// records without a hold, in id order, through the (hold, id) index. Insert
// puts a keyed record behind an earlier pending record of its key; a
// nacked or released record not yet due goes to 'retry'. When a key's first
// pending record stops being pending (delivered, dead, skipped, deleted by
// hand), a trigger sets the next one free, so no step ever walks a key's
// backlog. A claim puts the records whose retry is due back first (a batch
// at a time, found by due time), walks, and then takes the records queued
// right behind the keys it took while they are claimable, the room left in
// the batch shared evenly among those keys: a hot key moves a batch per
// claim without anyone setting its records free one by one. A dead record
// dead-lettered with HoldOnDeadLetter keeps its key held (its hold is
// 'key') whatever storage claims next, until it is re-driven or skipped.
//
// The cost: a record that waited behind another of its key and was not
// taken along is written once more, when it is set free.
//
// Timestamps are INTEGER Unix nanoseconds from the application clock
// (time.Now): SQLite runs inside the application, so there is no separate
// database clock to drift from; processes sharing a file share the host
// clock. The schema is a list of numbered steps embedded in the package
// with a version table, <table>_migrations; [Storage.Migrate] applies the
// missing ones under BEGIN IMMEDIATE. The storage implements
// [storage.Operator] (held keys, dead letters, re-drive, skip; skipped
// records move to <table>_skipped with their reason) and
// [storage.Diagnoser], which the txoutbox command uses.
package sqlite
