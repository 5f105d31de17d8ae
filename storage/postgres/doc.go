// Package postgres is the PostgreSQL storage of txoutbox, on pgx/v5.
//
// Records live in one table of your database until they are delivered, their
// live leases in a narrow second one, the workers claiming from it in a tiny
// third one, and the delivered records in a narrow fourth one (see
// [Storage.SchemaSQL] for the full DDL, [Storage.Migrate] for the versioned
// migrations that make it). Producers insert into it inside
// their own transaction with [Storage.Insert] (pgx.Tx or *sql.Tx on the pgx
// stdlib driver); forwarders claim leased batches from it with one statement
// per claim.
//
// # Schema
//
// A row is pending until it is delivered or dead. A claim leases its rows by
// inserting one small row each into the lease table ([Storage.LeaseTable]:
// id, key, leased_by, leased_until, attempts); the outbox row itself is not
// written. Each write-back deletes the worker's lease in the same statement,
// fenced on the lease's owner: a nack, a release or a dead-letter updates the
// outbox row; an ack deletes it and appends one narrow row to the delivered
// table ([Storage.DeliveredTable]: id, uuid, topic, key, created_at,
// delivered_at, attempts, last_error; not the payload nor the metadata),
// where delivered records stay until [Storage.Purge] removes them. The outbox
// table holds only pending and dead rows, and every hot query reads partial
// indexes of pending rows: a claim costs the same whether a thousand records
// were delivered or a hundred million.
//
// # Strict ordering
//
// On by default: a row is held back while an earlier pending row with the same
// key is leased or not yet due. Claims on one table take a transaction-scoped
// advisory lock, keyed on the table's identity (its oid, so that "outbox" and
// "public.outbox" take the same lock), sent in the same round trip as the
// claim, so each claim sees
// the leases committed by the one before it; they need no row locks. That
// serialises claims per table; set [Config.DisableStrictOrdering] when order
// per key does not matter. Claims then run side by side and lock their rows
// (FOR UPDATE SKIP LOCKED, so claimers skip each other's rows).
//
// A row held back by a record that waits is set aside, so that claims do not
// walk it: a failed record due later waits in the retry index (its hold
// column is 'retry'; a claim sets it back once it is due), and the rows of
// its key behind it are parked (hold 'behind'): by the nack, by a release,
// or by the claim that meets them. The delivery of the record they wait for
// (an ack; a dead-letter, unless [Config.HoldOnDeadLetter]; a re-drive or
// skip by an operator) sets the next one free, and a claim that takes it
// takes the rows parked right behind it along, still parked (the first 16
// keys among the first 64 rows of its walk, an even share of the batch each;
// the walk then reads only what they leave of the batch): after an outage a
// key costs a write per claim, not one per row, and a claim walks 64 heads,
// not a batch of heads it has no room for.
//
// Rows behind a record in flight (a hot key whose backlog waits behind the
// batch being published) are parked too, by a claim, once claims have been
// seen to walk far past them: when a claim's walk spanned more than 10,000
// ids, the next claim reads the first 2,000 rows it passes behind records
// in flight, and parks the backlog of each key with at least 100 of them
// (a drain over many keys passes a few rows of each key in flight; walking
// those again costs less than parking them). It locks the leases of those
// keys' records first, and an ack locks its leases in a statement of its
// own before the one that reads what to set free, so that the ack of the
// last record in flight always sees the rows parked behind it. A claim then
// reads the rows it hands out, the rows in flight and the rows right behind
// those, never the rows held back behind a waiting record or, once parked,
// behind a hot key's records in flight: with a 200-thousand-row backlog
// held back either way a claim of 100 costs what it costs with none
// (TestClaimCostWithHeldRows). Parking costs a write per row, once: with
// one hot key, the first claims after a relay starts on a backlog of 200
// thousand rows take about 3 s between them.
//
// The check whether an earlier row of a candidate's key is in flight reads
// the lease table once per claim (it holds only the rows in flight) into a
// map from key to the lowest leased id; whether one is held back is one probe
// of the held index per candidate.
//
// During a rolling upgrade from schema version 3, processes of the earlier
// version ignore the hold column. Order per key holds: a record they fail for
// later is given its hold by the next claim of this version (their nack
// takes the same lock), and their claims still see every waiting record.
// Their acks set no parked row free; a sweep does, once a minute. Their
// claims walk without the index they were written for (step 4 replaces it),
// so finish the upgrade soon.
//
// # Key slots
//
// Forwarders that hold the same keys get in each other's way: with strict
// ordering a claim walks past every pending row of a key another worker
// holds. So every row carries a slot (a hash of its key, or of its id when
// keyless, in a generated column), and the workers claiming from one table
// share the 256 slots: the workers that claimed in the last ten seconds, or
// within their lease when that is longer, and up to five seconds more (the
// worker table, [Storage.WorkerTable]), are sorted by worker id and each owns
// one contiguous range. A claim walks its own slots
// (checked in the pending index, so other slots cost nothing); when they do
// not fill the batch it also looks at the head of the others'. One forwarder
// owns every slot and claims as if slots did not exist; four forwarders over
// 1000 keys each hold about 250 keys and scale with them. A forwarder that
// stops calls [Storage.Leave] so the others take its range at once (one
// that dies keeps it for up to 15 seconds, or its lease and 5 seconds). A
// claim writes its worker row only when the membership left no longer lies
// between its lease (ten seconds at least) and five seconds beyond, not every
// time: a claim that finds nothing usually writes nothing, and commits
// without waiting for a WAL flush. Which slots a worker walks never decides
// what may be claimed: a key lives in one slot, and the check above is the
// same for all of them.
//
// # Writes per message
//
// A message costs an insert, a claim (a small lease row) and an ack (the
// lease and the outbox row deleted, a narrow delivered row appended). Marking
// the outbox row delivered instead would write a new version of the whole row
// and two index entries: never a HOT update, since status is in the partial
// indexes' predicates. On a 2-core machine with fsync on, this package's
// BenchmarkClaimAck claims 1000 rows in about 5 ms and acks them in about 6
// ms (strict ordering; 9.5 ms with the update). [Config.DeleteOnAck] skips
// the delivered row, about 3.5 ms for 1000 rows, at the price of keeping no
// delivered records for [Storage.Stats] and [Storage.Purge].
//
// # Wake-ups
//
// With [Config.NotifyChannel] set, the schema adds a statement-level trigger
// that notifies the channel after each insert, and [Storage.Listen] turns the
// notifications into forwarder wake-ups, reconnecting by itself.
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
//	if err := store.Migrate(ctx); err != nil { // or export store.Migrations() to your tool
//		return err
//	}
//	// In a producer's transaction:
//	err = store.Insert(ctx, tx, []storage.Record{{UUID: id, Topic: "orders", Key: orderID, Payload: body}})
//	// Next to the forwarder:
//	go store.Listen(ctx, forwarder.Wake)
package postgres
