// Package sqlite is the embedded outbox storage: the outbox table lives in the
// application's own SQLite database file, so a single binary gets a
// transactional outbox without a database server. It uses the pure-Go driver
// modernc.org/sqlite (driver name "sqlite"), so no cgo is needed.
//
// Producers write outbox records with [Storage.Insert] in the same *sql.Tx as
// their business rows; forwarders claim, publish and acknowledge them through
// the [storage.Storage] methods. Any number of forwarders may share the file,
// as goroutines on one *sql.DB or as separate processes.
//
// # Usage
//
//	db, err := sqlite.Open("app.db") // WAL, busy timeout, BEGIN IMMEDIATE
//	if err != nil { ... }
//	outbox, err := sqlite.New(db, sqlite.Config{})
//	if err != nil { ... }
//	if err := outbox.Migrate(ctx); err != nil { ... } // versioned; safe to run concurrently
//
//	tx, err := db.BeginTx(ctx, nil)
//	// ... business writes through tx ...
//	err = outbox.Insert(ctx, tx, []storage.Record{{
//		UUID: watermill.NewUUID(), Topic: "orders", Key: orderID, Payload: body,
//	}})
//	err = tx.Commit() // the record exists if and only if the business rows do
//
// # How claims stay safe
//
// SQLite allows one writer per database file at a time. A claim is a single
// UPDATE ... RETURNING statement: SQLite takes the write lock before it reads
// anything, so two claimers, in one process or in several, never see the same
// claimable record. Waiting for the lock is bounded by the busy timeout that
// [Open] sets. Before it, a claim looks for a claimable record with a plain
// read, which in WAL mode waits for no writer: a poll that finds nothing
// never takes the write lock, so an idle relay does not hold up the
// application's writes (SQLite's lock is not fair, and writers taking it in
// turn can starve one waiting in the busy handler). Write-backs (Ack, Nack, Release, DeadLetter) are single
// statements fenced on leased_by: a worker whose lease was taken over changes
// nothing.
//
// Because writers are serialised, a record's id order is also its commit
// order, and Config.VisibilityDelay is rarely needed.
//
// # Migrations and operations
//
// The schema is a list of numbered steps embedded in the package
// ([Storage.Migrations]) with a version table, <table>_migrations.
// [Storage.Migrate] applies the missing ones under BEGIN IMMEDIATE, so
// concurrent callers are safe; [Storage.SchemaSQL] is every step in order.
// The storage implements [storage.Operator] (held keys, dead letters, one
// record, re-drive, skip; skipped records move to <table>_skipped with their
// reason) and [storage.Diagnoser], which the txoutbox command uses.
//
// # Time
//
// Timestamps are stored as INTEGER Unix nanoseconds from the application
// clock (time.Now), and every comparison (due, lease expiry, purge cutoff) is
// an exact integer comparison against the same clock. SQLite runs inside the
// application, so there is no separate database clock to drift from; processes
// sharing a file share the host clock.
//
// # Strict ordering
//
// On by default: a record is held back while an earlier pending record with
// the same non-empty key is leased or waiting for a retry. The check is one
// NOT EXISTS over a partial index of pending keyed records on (key, the later
// of due_at and leased_until), so it visits only the few records of the key
// that block right now, however many are queued behind them: a hot key does
// not make claims slower. With Config.HoldOnDeadLetter a dead record of the
// key blocks too, and a record that failed before is claimed without the rest
// of its key; both checks read small partial indexes of their own. A claim still steps over the held-back records
// ahead of the claimable ones, so a deep backlog behind keys that another
// worker holds costs the next claim a scan of that backlog.
package sqlite
