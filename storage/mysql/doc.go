// Package mysql is the MySQL and MariaDB storage of txoutbox, on database/sql
// with github.com/go-sql-driver/mysql.
//
// It needs MySQL 8.0 or later, or MariaDB 10.6 or later: both have
// FOR UPDATE SKIP LOCKED. Tested on MariaDB 10.11 only; the SQL keeps to what
// both accept (no shared locks: MariaDB spells them LOCK IN SHARE MODE, MySQL
// takes SKIP LOCKED only after FOR SHARE, and MariaDB 10.11's
// LOCK IN SHARE MODE SKIP LOCKED was seen waiting). Records live in one InnoDB table of your database
// ([Storage.SchemaSQL]); producers insert into it inside their own
// transaction with [Storage.Insert] (a *sql.Tx, one multi-row INSERT per
// call); forwarders claim leased batches from it.
//
// # Schema
//
// The outbox table, as step 1 of [Storage.Migrations] creates it for the
// default table:
//
//	CREATE TABLE IF NOT EXISTS `outbox` (
//	    id           BIGINT       NOT NULL AUTO_INCREMENT,
//	    uuid         VARCHAR(255) NOT NULL,
//	    topic        VARCHAR(255) NOT NULL,
//	    `key`        VARCHAR(255) NOT NULL DEFAULT '',
//	    payload      LONGBLOB,
//	    metadata     JSON,
//	    created_at   DATETIME(6)  NOT NULL,
//	    -- When the row may next be claimed: its creation (plus the visibility
//	    -- delay), its retry time after a nack or release, and the end of its
//	    -- lease while leased, so that leased rows leave the claim's walk.
//	    due_at       DATETIME(6)  NOT NULL,
//	    attempts     INT          NOT NULL DEFAULT 0,
//	    status       VARCHAR(9)   NOT NULL DEFAULT 'pending',
//	    -- 1: known to be behind an earlier pending row of its key (strict
//	    -- ordering); the claim's walk skips it until that row leaves.
//	    parked       TINYINT      NOT NULL DEFAULT 0,
//	    leased_by    VARCHAR(255),
//	    leased_until DATETIME(6),
//	    last_error   TEXT,
//	    delivered_at DATETIME(6),
//	    PRIMARY KEY (id),
//	    -- Claim: due, not parked, pending rows by due time.
//	    KEY claim_idx (status, parked, due_at, id),
//	    -- Strict ordering: the pending rows of one key in id order.
//	    KEY key_idx (`key`, status, id),
//	    -- Purge (delivered by age) and redrive (dead rows).
//	    KEY done_idx (status, delivered_at),
//	    CONSTRAINT status_check CHECK (status IN ('pending', 'delivered', 'dead'))
//	) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
//
// Times are DATETIME(6) in UTC, written and compared with UTC_TIMESTAMP(6)
// and read back as microseconds, so neither the session time zone nor the
// DSN's parseTime and loc matter. Keys compare byte for byte (utf8mb4_bin):
// "Order-1" and "order-1" are two keys. uuid, topic and key hold at most 255
// characters; Insert refuses longer ones.
//
// The schema is versioned: numbered steps embedded in the package
// ([Storage.Migrations]: 1 the outbox table, 2 the skipped table
// `<table>_skipped`), each one idempotent statement (CREATE TABLE IF NOT
// EXISTS, indexes inside it), and a version table `<table>_migrations`.
// [Storage.Migrate] (also called [Storage.CreateSchema]) applies the
// missing steps under a named lock (GET_LOCK, taken and released on one
// connection), so processes starting together do not race;
// [Storage.SchemaSQL] is every step, for a migration tool.
//
// # Operator API
//
// The storage implements [storage.Operator] (held keys, dead letters, one
// record, re-drive, skip), [storage.Migrator] and [storage.Diagnoser], so
// the txoutbox command and the console work on it. A skipped dead row moves
// to the skipped table with the reason and the time, in one transaction
// that also unparks the next row of its key. HeldKeys looks only at the
// rows that can be a key's head (pending rows not due, and with
// HoldOnDeadLetter dead rows); ListDead pages dead rows in id order from
// done_idx. docs/operations.md has the details.
//
// With [Config.HoldOnDeadLetter] a dead row holds its key: a dead-letter
// does not unpark the next row, a claim parks rows behind a dead row of
// their key (holding a lock on the dead row, as for a pending one), and a
// head that failed before is claimed without followers, nor is any row
// after a failed follower.
//
// A lease is two columns of the row (leased_by, leased_until): InnoDB
// updates rows in place, so a narrow lease table would only add a write.
// An ack marks the row delivered in place (status, delivered_at); delivered
// and dead rows never enter a claim's index range, whose prefix is
// status = 'pending'. [Storage.Purge] deletes delivered rows by age, in
// batches. [Config.DeleteOnAck] deletes acked rows instead.
//
// # Claims
//
// A claim is one READ COMMITTED transaction (no gap locks on its range
// scans) whose locking reads skip locked rows (see Locks and deadlocks for
// where MariaDB was seen waiting anyway). It takes one clock reading and
//
//   - walks at most [Config.WalkFactor] times the batch of not-parked,
//     pending, due rows in (due_at, id) order on claim_idx with a plain
//     read, then locks them by primary key FOR UPDATE SKIP LOCKED,
//     checking again that they are pending, not parked and due. Rows under
//     a live lease (their due_at is the lease's end), rows waiting for a
//     retry and parked rows are outside the range: a claim's cost depends
//     on the batch, not on how much is held back. A claim takes no lock on
//     a claim_idx entry (see Locks and deadlocks). A walk whose rows were all
//     parked (the steps below) is followed by another, up to 16 batches in
//     all, so that a claim does not come back empty while claimable rows wait
//     behind a backlog it is parking;
//   - finds the lowest pending row of each walked key (a correlated
//     ORDER BY id LIMIT 1 on key_idx per key, all in one statement). A walked row that
//     is its key's lowest, and every keyless row, is claimable. A walked row
//     behind an earlier pending row of its key is parked, but only while the
//     claim holds a lock on that earlier row (FOR UPDATE SKIP LOCKED), so it
//     cannot be acked or dead-lettered before the parking commits; if it is
//     locked, the row is left alone this time. The lock is exclusive, not
//     shared: with MariaDB's LOCK IN SHARE MODE SKIP LOCKED two claims were
//     seen waiting for each other;
//   - takes each claimable head's next pending rows of its key (parked or
//     not) as followers, stopping at the first under a live lease, not due,
//     or that it cannot lock (FOR UPDATE SKIP LOCKED): a key's followers are
//     a prefix of its pending rows. Up to 32 heads, each head's rows are read
//     with a LIMIT of their own; past that (keys spread out), one range read
//     per key over the ids the walk covered, in one statement;
//   - fills the batch in id order, leases the rows in one UPDATE (attempts
//   - 1, leased_by, leased_until, due_at, parked = 0), reads them back and
//     commits.
//
// Invariant: the lowest pending row of a key is never parked. Ack and
// dead-letter keep it: in the same transaction as their fenced write-back
// they find the new lowest pending row of each key they touched (a plain
// read), lock it (FOR UPDATE, in id order) and unpark it; a row that another
// ack moved out of pending meanwhile (two holders of one key's rows acking at
// once, after a lease ran out) is looked for again once that ack committed.
// When no row of the table is parked (one claim_idx entry read after the
// write-back's rows are locked: a claim parks only behind a row it holds
// locked), there is nothing to unpark and none of this is done: in a drain of
// keys spread out with nothing held back, most acks (an ack of 1000 rows:
// 30 ms to 20 ms). One parked row anywhere in the table (a key behind a
// retry, a dead record with HoldOnDeadLetter) turns this off for every
// write-back until it is set free. Nack and
// release do not change parking. [Storage.Redrive] un-parks the rows it
// re-drives.
//
// With [Config.DisableStrictOrdering] the claim is the walk alone: no
// probes, no parking, no followers.
//
// # Locks and deadlocks
//
// A claim's locking reads skip locked rows (SKIP LOCKED). Write-backs lock the
// rows they change in id order (SELECT ... ORDER BY id FOR UPDATE) and are
// fenced on leased_by, so write-backs of different workers do not deadlock
// each other, with one corner: after a lease ran out, two workers can hold
// rows of the same keys and ack at once, and their promotions can wait for
// each other. InnoDB then rolls one back (error 1213) and the storage runs
// that transaction again after a short random pause (up to five attempts in
// all). The package's concurrency test, eight workers with 30 ms leases
// expiring all the time, sees a few such retries per run and no failure.
//
// Two claims can also deadlock, in spite of SKIP LOCKED. Claims used to walk
// claim_idx with a locking read: a walk that skipped a row another claim held
// as a follower kept its lock on the row's claim_idx entry, and that claim's
// lease UPDATE, which moves the entry, waited for it; two claims doing this
// to each other deadlocked (SHOW ENGINE INNODB STATUS, MariaDB 10.11,
// 2026-12-04). Claims now lock by primary key only. MariaDB 10.11 still
// reported deadlocks between claims where both were in FOR UPDATE SKIP
// LOCKED reads by primary key, each waiting for a record lock the other held
// (SKIP LOCKED did skip such rows when tried by hand, two sessions; the
// condition under load is not known). So [Storage.Claim] runs a claim InnoDB
// rolled back as a deadlock victim again at once, up to five attempts in
// all; nothing was locked or leased by the rolled-back attempt.
// TestClaimDeadlocks (rounds of 32 claims at once, 8 hot keys) counts them:
// 0 to 9 per run, median 1, in 20 runs (2026-12-04; with the locking walk
// on claim_idx, 2 to 14, median 6, in 10 runs); no claim failed.
//
// # Cost
//
// BenchmarkClaimAck (one worker, 1000 keys, MariaDB 10.11 with its default
// durability on a 2-core machine shared with other work, load average
// about 16; 2026-12-04): batch 100, strict: claim 18.6 ms, ack 12.5 ms;
// not strict: 17.0 ms and 12.6 ms. Batch 1000, strict: 178 ms and 149 ms;
// not strict: 119 ms and 88 ms. Most of it is the commit's log flush and
// the machine's load; measure on yours with
//
//	go test -run XXX -bench ClaimAck ./storage/mysql
//
// TestHeldBackRowsNotWalked checks that rows held back behind a key's head
// cost nothing once parked: with 5000 rows of one key behind a head waiting
// for its retry, a claim of 100 other keys' records took 35 ms.
//
// # Wake-ups
//
// MySQL has no LISTEN/NOTIFY: a forwarder on this storage polls, backing
// off while the table is empty (ForwarderConfig.PollMin, PollMax). A
// process that both produces and forwards can call the forwarder's Wake
// after committing a transaction that wrote records, and the forwarder
// claims at once.
//
// # Statements
//
// Every statement is sent as text with its values written in as literals:
// integers in decimal, strings and bytes as hexadecimal literals, which no
// byte sequence can escape from. go-sql-driver/mysql sends a statement
// without parameters in one round trip; with parameters it prepares,
// executes and closes it (unless the DSN sets interpolateParams), and a
// claim runs several statements.
//
// # Usage
//
//	db, err := sql.Open("mysql", "app:secret@tcp(db:3306)/app")
//	if err != nil {
//		return err
//	}
//	store, err := mysql.New(db, mysql.Config{Table: "outbox"})
//	if err != nil {
//		return err
//	}
//	if err := store.Migrate(ctx); err != nil { // or export store.Migrations() to your migration tool
//		return err
//	}
//	// In a producer's transaction:
//	err = store.Insert(ctx, tx, []storage.Record{{UUID: id, Topic: "orders", Key: orderID, Payload: body}})
package mysql
