// Package inbox processes each Watermill message once per consumer: the
// consumer side of the transactional outbox. With it, "consume a message,
// change the database, emit events" has each message's effects exactly
// once, although the broker delivers at least once.
//
//	db, _ := sqlite.Open("app.db")                    // or a pgx pool, MySQL, ...
//	store, _ := sqlite.New(db, sqlite.Config{})
//	_ = store.Migrate(ctx)                            // creates the inbox table too
//	in, _ := inbox.New(inbox.Config{Consumer: "billing", Store: store.Inbox()})
//	go in.Run(ctx)                                    // retention
//
//	events, _ := txoutbox.NewPublisher(store, txoutbox.PublisherConfig{})
//	h := router.AddConsumerHandler("billing", "orders.created", sub, func(msg *message.Message) error {
//		tx, _ := txoutbox.TxFromContext(msg.Context()) // *sql.Tx here, pgx.Tx on a pgx pool
//		if _, err := tx.(*sql.Tx).ExecContext(msg.Context(), `INSERT INTO invoices ...`); err != nil {
//			return err
//		}
//		ev := message.NewMessage(watermill.NewUUID(), payload)
//		ev.SetContext(msg.Context())               // the same transaction
//		return events.Publish("invoices.requested", ev)
//	})
//	h.AddMiddleware(in.Middleware)                    // innermost: after Retry, PoisonQueue, Recoverer
//
// # How it works
//
// For each message, [Inbox.Middleware] begins a transaction on the
// consumer's database and inserts (consumer, message UUID) into the inbox
// table, whose primary key is that pair. It runs the handler with the
// transaction in the message's context (txoutbox.ContextWithTx), commits,
// and only then lets the router ack. The handler's writes, the events it
// publishes through the outbox, and the inbox entry commit together or not
// at all:
//
//   - a crash before the commit leaves nothing: the redelivery is processed;
//   - a crash after the commit, before the ack: the redelivery finds the
//     entry and is acked without calling the handler;
//   - a handler error or panic rolls everything back and nacks, so
//     Watermill's Retry, PoisonQueue and Recoverer work as usual;
//   - two instances that get the same message at once: the second one's
//     insert waits for the first's transaction, then acks the message if it
//     committed, or processes it if it rolled back. It never commits twice.
//
// # What identifies a message
//
// The message UUID, per consumer name. txoutbox's forwarder publishes the
// UUID the producer gave the message, the same on every retry. Watermill's
// marshalers for AMQP (RabbitMQ), Kafka, NATS (JetStream and core), SQL and
// Redis Streams carry it in a header (_watermill_message_uuid) or a column
// and hand it back on every delivery, redeliveries included. A subscriber
// whose marshaler drops that header, or makes up a UUID per delivery,
// defeats the inbox: every delivery looks new. watermill-amqp gives a
// message published without the header (by a producer outside Watermill)
// an empty UUID: the middleware refuses it with [ErrNoUUID] before calling
// the handler, and a PoisonQueue middleware parks it.
//
// # Retention
//
// Entries are kept for [Config.Retention] (7 days by default); [Inbox.Run]
// deletes older ones every minute, [Config.PruneBatch] rows per statement.
// A message redelivered after its entry was deleted is processed again, so
// keep the window well above the longest time a message can come back.
//
// # Databases
//
// The inbox table lives beside the outbox table and is created by the same
// versioned migrations (Migrate, `txoutbox migrate up`, `txoutbox migrate
// sql`): postgres.Storage.Inbox (pgx pool, handlers get a pgx.Tx) and
// postgres.Storage.InboxDB (database/sql on the pgx stdlib driver, a
// *sql.Tx), mysql.Storage.Inbox and sqlite.Storage.Inbox (a *sql.Tx).
// storage.InboxStore is the contract for keeping it elsewhere.
package inbox
