// Package mysql is the MySQL and MariaDB storage of txoutbox, on database/sql
// with github.com/go-sql-driver/mysql. It needs MySQL 8.0 or later, or
// MariaDB 10.6 or later (FOR UPDATE SKIP LOCKED); it is tested on MariaDB
// 10.11.
//
// # Usage
//
//	db, err := sql.Open("mysql", "app:secret@tcp(db:3306)/app")
//	if err != nil {
//		return err
//	}
//	outbox, err := mysql.New(db, mysql.Config{Table: "outbox"})
//	if err != nil {
//		return err
//	}
//	if err := outbox.Migrate(ctx); err != nil { // or give outbox.Migrations() to your migration tool
//		return err
//	}
//
//	// Producers: the event is written through the business transaction (a *sql.Tx).
//	publisher, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
//	// ... tx, _ := db.BeginTx(ctx, nil); msg.SetContext(txoutbox.ContextWithTx(ctx, tx));
//	// publisher.Publish("orders.created", msg); tx.Commit(); forwarder.Wake()
//
//	// The relay: any Watermill publisher is the target.
//	forwarder, err := txoutbox.NewForwarder(outbox, target, txoutbox.ForwarderConfig{}, logger)
//	err = forwarder.Run(ctx)
//
// examples/mysql in the repository is this, as a program with its test.
// MySQL has no LISTEN/NOTIFY: a forwarder polls, backing off while the table
// is empty (ForwarderConfig.PollMin, PollMax); a process that also produces
// can call the forwarder's Wake after a commit.
//
// # Who calls what
//
// [Storage] has many methods because three parties use it. An application
// calls only the first group.
//
//   - Your application: [New], [Storage.Migrate] (or [Storage.CreateSchema];
//     [Storage.SchemaSQL] and [Storage.Migrations] for your own migration
//     tool), and [Storage.Insert], which the txoutbox.Publisher calls for
//     you; on the consumer's side, [Storage.Inbox] for the inbox package.
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
//     [Storage.KeyTable], [Storage.MigrationTable], [Storage.StrictOrdering],
//     [Storage.HoldOnDeadLetter].
//
// # Table
//
// One InnoDB table holds every record; a lease is two columns of the row,
// and an ack marks the row delivered in place ([Config.DeleteOnAck] deletes
// it) until [Storage.Purge] removes it. Times are DATETIME(6) in UTC, so
// neither the session time zone nor the DSN's parseTime and loc matter. Keys
// compare by code point (utf8mb4_bin), but ignoring trailing spaces, so
// Insert refuses a key that ends in a space; uuid, topic and key hold at most
// 255 characters, and Insert refuses longer ones. Every statement is sent as
// text with its values written in as hexadecimal or decimal literals, which
// no byte sequence can escape from, except payloads of 64 KiB or more, bound
// as parameters; Insert keeps its statements within the server's
// max_allowed_packet and refuses a record that cannot fit alone. Text is
// read back as binary strings, so the DSN's charset does not matter.
//
// # Commit order
//
// Records of one key are delivered in the order their producers committed:
// with strict ordering, Insert locks each key of its records in
// [Storage.KeyTable] in the producer's transaction, so a second producer of
// a key waits until the first commits (producers of other keys do not
// wait). [Config.DisableKeyLocks] turns it off; see docs/design.md for what
// it costs.
//
// # MySQL 8
//
// The tests run on MariaDB 10.11. Where MySQL 8 differs in what the code
// depends on (SKIP LOCKED after FOR UPDATE only, utf8mb4_bin being PAD
// SPACE on both, GET_LOCK names of at most 64 characters, JSON read back
// through its utf8mb4 text, CHECK constraints enforced from 8.0.16, LIMIT in
// scalar subqueries), the code was checked against the MySQL 8.0 reference
// manual; docs/design.md lists each point.
//
// # Ordering
//
// Strict per-key ordering is on by default: a record is not claimed while an
// earlier pending record of its key is leased or waiting for its retry. It
// needs no table lock: rows behind such a record are parked and left out of
// the claim's index walk until it is delivered or dead-lettered.
// [Config.DisableStrictOrdering] turns it off. Changing it, or
// [Config.HoldOnDeadLetter], on a live table strands nothing: a storage's
// first claim, and one claim every [SweepInterval], set free the parked rows
// nothing else would.
//
// How claims, parking, locks and write-backs work, and what they cost, is
// described in docs/design.md in the repository
// (https://github.com/txoutbox/txoutbox/blob/main/docs/design.md).
package mysql
