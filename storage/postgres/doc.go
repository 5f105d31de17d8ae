// Package postgres is the PostgreSQL storage of txoutbox, on pgx/v5.
//
// Records live in one table of your database until they are delivered, their
// live leases in a narrow second one, and the delivered records in a narrow
// third one (see [Storage.SchemaSQL] for the full DDL). Producers insert into
// it inside their own transaction with [Storage.Insert] (pgx.Tx or *sql.Tx on
// the pgx stdlib driver); forwarders claim leased batches from it with one
// statement per claim.
//
// # Schema
//
// A row is pending until it is delivered or dead. A claim leases its rows by
// inserting one small row each into the lease table ([Storage.LeaseTable]:
// id, key, leased_by, leased_until, attempts). Each write-back deletes the
// worker's lease in the same statement, fenced on the lease's owner: a nack,
// a release or a dead-letter updates the outbox row; an ack deletes it and
// appends one narrow row to the delivered table ([Storage.DeliveredTable]:
// id, uuid, topic, key, created_at, delivered_at, attempts, last_error; not
// the payload nor the metadata), where delivered records stay until
// [Storage.Purge] removes them. The outbox table holds only pending and dead
// rows, and every hot query reads partial indexes of pending rows.
//
// # Strict ordering: parked rows
//
// On by default: a row is held back while an earlier pending row with the
// same key is leased or not yet due. There is no table lock and no key
// sharing among forwarders; claimers of different keys never wait for one
// another, and a claim's cost depends on its batch, not on how many rows are
// held back. The outbox row has a parked flag, with one invariant: the
// lowest pending row of every key is never parked, and a parked row is one
// known to be behind an earlier pending row of its key. Claims walk an index
// of the pending rows that are not parked, by due time (walk_idx): rows
// waiting for a retry are not due yet and parked rows are not in it, so a
// claim walks only due heads, the rows in flight (skipped after one lease
// probe each), keyless rows and fresh rows not looked at yet.
//
// For each candidate (at most twice the batch) a claim asks the key index
// (key_idx) for the nearest earlier pending row of its key. A candidate with
// none is a head: the claim locks it FOR UPDATE SKIP LOCKED, and that row
// lock is what gives one claimer a key at a time. For each head it takes the
// next pending rows of its key, parked or not, up to the first one in flight
// or not due (the followers, locked the same way), fills the batch in id
// order, and leases what it locked, taking over leases that ran out (ON
// CONFLICT, judged on the latest committed lease). A row is handed out only
// if every earlier row of its key in the batch got its lease too. A
// candidate behind an earlier pending row E is parked, but only while the
// claim holds E FOR SHARE SKIP LOCKED.
//
// An ack or a dead-letter locks its rows, and the current head of each key
// they touch, FOR UPDATE in id order; then, in a second statement of the same
// transaction (so with a snapshot taken once those locks are held) it deletes
// or updates them and unparks the new lowest pending row of each key. Why
// that is enough: a claim parks a row only while it holds the row in front
// of it FOR SHARE, so the ack of that row waits for the claim and then sees
// the parked row; two write-backs of one key both lock its head, so the
// second sees what the first did. Nack and release leave the head the head
// and change nothing about parking; [Storage.Redrive] unparks what it
// re-drives.
//
// No deadlock: claims never wait for a row lock (SKIP LOCKED everywhere,
// leases inserted in id order); write-backs lock outbox rows in id order
// before their lease rows, in id order too, through ARRAY(... ORDER BY id FOR
// UPDATE) sub-selects that PostgreSQL evaluates whole before the statement
// that uses them. A forwarder that dies holds back only its own keys, until
// its leases run out.
//
// Without strict ordering ([Config.DisableStrictOrdering]) a claim walks the
// same index, locks FOR UPDATE SKIP LOCKED and parks nothing.
//
// The only planner setting left is jit = off, for the claim's transaction
// and the strict write-backs', sent in the same round trip: their estimated
// cost (range probes of the key index, whose row counts the planner cannot
// know) passes jit_above_cost, and compiling a 3 ms claim took 180 ms.
//
// # Commit order
//
// Ids are taken at insert, not at commit: a long producer transaction can
// commit a record after a later one was delivered. [Config.VisibilityDelay]
// claims only records older than a fixed delay; [Config.CommitOrderFence]
// claims only records whose inserting transaction (the txid column) is older
// than every transaction still running in the database, at the cost that any
// long transaction anywhere in the database holds delivery back
// ([Storage.FenceStats] shows how many records wait and how old the oldest
// open transaction is). The fence compares transaction ids, which are taken
// at a transaction's first write: a producer transaction that writes other
// tables before its outbox insert, while another one that started writing
// later inserts its record first, can still be overtaken. Set
// VisibilityDelay as well where that matters.
//
// # Schema changes
//
// [Storage.CreateSchema] is safe to run from every process at start-up: it
// takes an advisory lock of its own (keyed on the table's resolved name),
// reads the catalog and runs only what is missing, so an up-to-date schema
// costs no lock on the outbox table, and it gives up after
// [SchemaLockTimeout]. It upgrades a table of the previous version in place
// (adds parked and txid, the walk and key indexes; drops the slot column, the
// old indexes and the workers table) without touching pending rows.
//
// # Writes per message
//
// A message costs an insert, a claim (a small lease row) and an ack (the
// lease and the outbox row deleted, a narrow delivered row appended). Marking
// the outbox row delivered instead would write a new version of the whole row
// and two index entries: never a HOT update, since status is in the partial
// indexes' predicates. On a 2-core machine with fsync on, this package's
// BenchmarkClaimAck gives the current figures (docs/benchmarks.md).
// [Config.DeleteOnAck] skips the delivered row, at the price of keeping no
// delivered records for [Storage.Stats] and [Storage.Purge].
//
// # Wake-ups
//
// With [Config.NotifyChannel] set, the schema adds a statement-level trigger
// that notifies the channel after each insert, and [Storage.Listen] turns the
// notifications into forwarder wake-ups, reconnecting by itself. Its
// connection comes from the pool (BeforeConnect and AfterConnect apply).
//
// # Usage
//
//	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
//	if err != nil {
//		return err
//	}
//	store, err := postgres.New(pool, postgres.Config{Table: "app.outbox", NotifyChannel: "outbox"})
//	if err != nil {
//		return err
//	}
//	if err := store.CreateSchema(ctx); err != nil { // or put store.SchemaSQL() in a migration
//		return err
//	}
//	// In a producer's transaction:
//	err = store.Insert(ctx, tx, []storage.Record{{UUID: id, Topic: "orders", Key: orderID, Payload: body}})
//	// Next to the forwarder:
//	go store.Listen(ctx, forwarder.Wake)
package postgres
