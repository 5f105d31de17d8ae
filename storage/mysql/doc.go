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
//     [Storage.MigrationTable], [Storage.StrictOrdering],
//     [Storage.HoldOnDeadLetter].
//
// # Table
//
// One InnoDB table holds every record; a lease is two columns of the row,
// and an ack marks the row delivered in place ([Config.DeleteOnAck] deletes
// it) until [Storage.Purge] removes it. Times are DATETIME(6) in UTC, so
// neither the session time zone nor the DSN's parseTime and loc matter. Keys
// compare byte for byte (utf8mb4_bin); uuid, topic and key hold at most 255
// characters, and Insert refuses longer ones. Every statement is sent as text
// with its values written in as hexadecimal or decimal literals, which no
// byte sequence can escape from.
//
// # Ordering
//
// Strict per-key ordering is on by default: a record is not claimed while an
// earlier pending record of its key is leased or waiting for its retry. It
// needs no table lock: rows behind such a record are parked and left out of
// the claim's index walk until it is delivered or dead-lettered.
// [Config.DisableStrictOrdering] turns it off.
//
// How claims, parking, locks and write-backs work, and what they cost, is
// described in docs/design.md in the repository
// (https://github.com/txoutbox/txoutbox/blob/main/docs/design.md).
package mysql
