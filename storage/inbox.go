package storage

import (
	"context"
	"time"
)

// InboxStore is the inbox table of one database, for the inbox package: it
// records which messages each consumer has processed, inside the
// transaction that processed them. The SQL storages provide one (their
// Inbox method); implement it to keep the inbox elsewhere. Like [Storage],
// it is meant to be implemented by users and kept stable.
type InboxStore interface {
	// BeginInbox begins a transaction and records (consumer, uuid) in it.
	// When consumer already committed uuid it returns seen true and no
	// transaction (whatever it began is rolled back). While another
	// transaction holds an uncommitted entry for the same (consumer, uuid),
	// it waits for that transaction: seen true when it commits, the entry
	// recorded when it rolls back. It never records one pair twice.
	BeginInbox(ctx context.Context, p InboxParams) (tx InboxTx, seen bool, err error)
	// PruneInbox deletes up to p.Limit entries of p.Consumer received before
	// p.Before and returns how many it deleted.
	PruneInbox(ctx context.Context, p InboxPruneParams) (int64, error)
	// InboxStats reports the entries of the inbox table, all consumers.
	InboxStats(ctx context.Context) (InboxStats, error)
}

// InboxParams are the arguments of [InboxStore.BeginInbox].
type InboxParams struct {
	// Consumer names the consumer; entries are per consumer.
	Consumer string
	// UUID is the message's UUID.
	UUID string
	// ReceivedAt is stored with the entry; retention compares it.
	ReceivedAt time.Time
}

// InboxPruneParams are the arguments of [InboxStore.PruneInbox].
type InboxPruneParams struct {
	Consumer string
	Before   time.Time
	Limit    int
}

// InboxTx is a transaction begun by [InboxStore.BeginInbox].
type InboxTx interface {
	// Tx is the database transaction the handler writes through, what
	// txoutbox.ContextWithTx gets: a pgx.Tx or a *sql.Tx for the built-in
	// storages.
	Tx() any
	// Commit commits the entry with the handler's writes.
	Commit(ctx context.Context) error
	// Rollback undoes both; after Commit it does nothing.
	Rollback(ctx context.Context) error
}

// InboxStats describes the inbox table.
type InboxStats struct {
	// Entries counts the entries of every consumer.
	Entries int64
	// Oldest is when the oldest entry was received; zero when there is none.
	Oldest time.Time
}
