// Package postgres is the PostgreSQL storage of txoutbox, on pgx/v5.
//
// # Usage
//
// Make the storage on your pool, bring its tables up to date, hand it to the
// transactional publisher (producers) and to a forwarder (the relay), and let
// LISTEN/NOTIFY wake the forwarder on commit:
//
//	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
//	if err != nil {
//		return err
//	}
//	outbox, err := postgres.New(pool, postgres.Config{Table: "outbox", NotifyChannel: "outbox"})
//	if err != nil {
//		return err
//	}
//	if err := outbox.Migrate(ctx); err != nil { // or give outbox.Migrations() to your migration tool
//		return err
//	}
//
//	// Producers: the event is written through the business transaction.
//	publisher, err := txoutbox.NewPublisher(outbox, txoutbox.PublisherConfig{})
//	// ... tx, _ := pool.Begin(ctx); msg.SetContext(txoutbox.ContextWithTx(ctx, tx));
//	// publisher.Publish("orders.created", msg); tx.Commit(ctx)
//
//	// The relay: any Watermill publisher is the target.
//	forwarder, err := txoutbox.NewForwarder(outbox, target, txoutbox.ForwarderConfig{}, logger)
//	go outbox.Listen(ctx, forwarder.Wake)
//	err = forwarder.Run(ctx)
//
// examples/postgres in the repository is this, as a program with its test.
// The publisher takes a pgx.Tx, or a *sql.Tx on pgx's stdlib driver.
//
// # Who calls what
//
// [Storage] has many methods because three parties use it. An application
// calls only the first group.
//
//   - Your application: [New], [Storage.Migrate] (or [Storage.CreateSchema];
//     [Storage.SchemaSQL], [Storage.Migrations] and [Storage.TriggerSQL] for
//     your own migration tool), [Storage.Listen] beside a forwarder, and
//     [Storage.Insert], which the txoutbox.Publisher calls for you; on the
//     consumer's side, [Storage.Inbox] or [Storage.InboxDB] for the inbox
//     package.
//   - The forwarder, through the relay protocol ([storage.Storage],
//     [storage.DrainClaimer], [storage.Membership]): [Storage.Claim],
//     [Storage.ClaimDrained], [Storage.Ack], [Storage.Nack],
//     [Storage.Release], [Storage.DeadLetter], [Storage.Extend],
//     [Storage.Join], [Storage.Leave]. Do not call them yourself.
//   - Operators, through the txoutbox command, the web console or your own
//     admin endpoint ([storage.Operator], [storage.Migrator],
//     [storage.Diagnoser]): [Storage.Stats], [Storage.HeldKeys],
//     [Storage.ListDead], [Storage.Record], [Storage.Redrive],
//     [Storage.Skip], [Storage.Purge], [Storage.MigrationStatus],
//     [Storage.MigrateReport], [Storage.Diagnose].
//   - Introspection, for tools: [Storage.Table], [Storage.LeaseTable],
//     [Storage.DeliveredTable], [Storage.WorkerTable],
//     [Storage.SkippedTable], [Storage.MigrationTable],
//     [Storage.StrictOrdering], [Storage.HoldOnDeadLetter].
//
// # Tables
//
// The outbox table holds pending and dead records; live leases sit in a
// narrow <table>_leases, the forwarders claiming in a tiny <table>_workers,
// and delivered records (without payload) in <table>_delivered until
// [Storage.Purge] removes them ([Config.DeleteOnAck] keeps none). A claim
// costs the same whether a thousand records were delivered or a hundred
// million.
//
// # Ordering and wake-ups
//
// Strict per-key ordering is on by default: a record is not claimed while an
// earlier pending record of its key is leased or waiting for its retry.
// Claims on one table are serialised (an advisory lock), which bounds the
// claim rate per table; [Config.DisableStrictOrdering] lifts it when order
// per key does not matter. Records held back behind a waiting record are set
// aside, so that they cost a claim nothing, and forwarders share the keys out
// (key slots) so that none walks another's rows.
//
// With [Config.NotifyChannel] set, the schema adds a trigger that notifies
// the channel after each insert, and [Storage.Listen] turns the
// notifications into forwarder wake-ups. NOTIFY serialises the producers'
// commits: above a few hundred commits a second, leave it unset and let the
// forwarders poll.
//
// How claims, leases, fencing, parking and key slots work, and what they
// cost, is described in docs/design.md in the repository
// (https://github.com/txoutbox/txoutbox/blob/main/docs/design.md).
package postgres
