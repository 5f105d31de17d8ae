package storage

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Storage is the contract the forwarder relies on. See the package documentation
// for the rules every implementation must follow, and storagetest for the suite
// that checks them.
type Storage interface {
	// Claim leases up to params.BatchSize due, unleased, pending records to
	// params.WorkerID until now+params.Lease, increments their attempts, and
	// returns them in id order. It returns an empty slice, not an error, when
	// nothing is claimable.
	Claim(ctx context.Context, params ClaimParams) ([]Record, error)

	// Ack marks the records delivered. A record is only touched while
	// params.WorkerID holds the lease its ClaimRef names (see [ClaimRef]);
	// the others are ignored.
	Ack(ctx context.Context, params AckParams) error

	// Nack records params.Error on the record, ends its lease and makes it due
	// again at params.RetryAt. Ignored unless params.WorkerID holds the lease
	// params.Record names.
	Nack(ctx context.Context, params NackParams) error

	// Release ends the lease of records that were claimed but never tried: their
	// attempts go back down by one, no error is recorded, and they are due again at
	// params.RetryAt. Records whose lease params.WorkerID does not hold, as
	// their ClaimRef names it, are ignored.
	Release(ctx context.Context, params ReleaseParams) error

	// DeadLetter parks the record for good with params.Error: it is never
	// claimed again unless re-driven. Ignored unless params.WorkerID holds the
	// lease params.Record names.
	DeadLetter(ctx context.Context, params DeadLetterParams) error

	// Extend pushes the lease of records still leased to params.WorkerID, by
	// the claim their ClaimRef names, out to now+params.Lease, so that a
	// forwarder keeps the records of a key group it is still working
	// through. It returns the ids it extended, in any order. A record leased
	// by another worker or by another claim, or whose lease has already run
	// out, is not extended (fencing): a forwarder that finds an id missing
	// has lost that record and must not publish it.
	Extend(ctx context.Context, params ExtendParams) ([]int64, error)
}

// Record is one row of the outbox table.
type Record struct {
	// ID is the insertion order: records are claimed in ascending ID order.
	ID int64
	// UUID is the Watermill message UUID, stable across retries: the consumer's
	// deduplication key.
	UUID string
	// Topic is the topic the message is re-published to.
	Topic string
	// Key is the ordering key; empty means the record is independent.
	Key string
	// Payload is the message payload, stored as bytes.
	Payload []byte
	// Metadata is the message metadata as the producer set it.
	Metadata map[string]string
	// Attempts counts claims, including the one that returned this record.
	// As a claim returned it, it is also that claim's token: write-backs
	// name the record by [Record.Ref], its ID and Attempts.
	Attempts int
	// CreatedAt is when the record was inserted.
	CreatedAt time.Time
	// DueAt is the earliest time the record may be claimed (delayed
	// delivery), on the application's clock; zero, or a time already past,
	// means at once. Inserter.Insert reads it; a claim leaves it zero. With
	// strict ordering a record that is not due yet holds back the later
	// records of its key, like one waiting for a retry.
	DueAt time.Time
	// DecodeError is set by an adapter when the stored row could not be decoded
	// (for example metadata corrupted by hand). The forwarder dead-letters such a
	// record with this reason instead of publishing it, so it never stalls its key.
	DecodeError error
}

// ClaimParams are the parameters of [Storage.Claim].
type ClaimParams struct {
	// BatchSize is the maximum number of records to claim; always > 0.
	BatchSize int
	// Lease is how long the claimed records stay leased; always > 0.
	Lease time.Duration
	// WorkerID identifies the claimer; write-backs are fenced on it and on
	// the attempts the claim returns (see [ClaimRef]).
	WorkerID string
}

// ClaimRef names one record as one claim handed it out: the record's id and
// the attempt number that claim returned ([Record.Attempts]). Every
// write-back names its records this way, and a storage applies it only
// while the lease of that claim is the record's lease: held by the calling
// worker with these attempts (see the package documentation, "Fencing"). A
// write-back from an older claim of the same worker, whose lease ran out and
// which the worker claimed again since, then touches nothing.
type ClaimRef struct {
	// ID is the record's id.
	ID int64
	// Attempt is Record.Attempts as the claim returned it; no claim
	// returns 0.
	Attempt int
}

// Ref returns the ClaimRef of a record a claim returned: its ID and
// Attempts.
func (r *Record) Ref() ClaimRef { return ClaimRef{ID: r.ID, Attempt: r.Attempts} }

// Refs returns the ClaimRef of each record, in the same order.
func Refs(records []Record) []ClaimRef {
	refs := make([]ClaimRef, len(records))
	for i := range records {
		refs[i] = records[i].Ref()
	}
	return refs
}

// AckParams are the parameters of [Storage.Ack].
type AckParams struct {
	// Records are the records to ack, as their claim returned them.
	Records []ClaimRef
	// WorkerID is the worker that claimed them.
	WorkerID string
}

// NackParams are the parameters of [Storage.Nack].
type NackParams struct {
	// Record is the record whose publish failed, as its claim returned it.
	Record ClaimRef
	// WorkerID is the worker that claimed it.
	WorkerID string
	// Error is the reason the publish failed, kept as the record's last error.
	Error string
	// RetryAt is when the record becomes due again (application clock).
	RetryAt time.Time
}

// ReleaseParams are the parameters of [Storage.Release].
type ReleaseParams struct {
	// Records are the records to give back untried, as their claim
	// returned them.
	Records []ClaimRef
	// WorkerID is the worker that claimed them.
	WorkerID string
	// RetryAt is when the records become due again (application clock).
	RetryAt time.Time
}

// DeadLetterParams are the parameters of [Storage.DeadLetter].
type DeadLetterParams struct {
	// Record is the record to park, as its claim returned it.
	Record ClaimRef
	// WorkerID is the worker that claimed it.
	WorkerID string
	// Error is the reason the record was parked.
	Error string
}

// ExtendParams are the parameters of [Storage.Extend].
type ExtendParams struct {
	// Records are the records whose lease to extend, as their claim
	// returned them.
	Records []ClaimRef
	// WorkerID is the worker that claimed them.
	WorkerID string
	// Lease is the new lease, counted from now; always > 0.
	Lease time.Duration
}

// Status is the state of a record in the table.
type Status string

// The states a record goes through: pending until delivered or dead; a dead
// record is re-driven (pending again) or skipped by an operator.
const (
	StatusPending   Status = "pending"
	StatusDelivered Status = "delivered"
	StatusDead      Status = "dead"
	// StatusSkipped is a dead record an operator gave up on ([Operator.Skip]):
	// it is never delivered and no longer holds back its key.
	StatusSkipped Status = "skipped"
)

// Stats is a snapshot of the outbox table, for dashboards and alerts.
type Stats struct {
	// Pending counts records not yet delivered nor dead, leased ones included.
	Pending int64
	// Leased counts pending records whose lease has not expired.
	Leased int64
	// Delivered counts delivered records not yet purged.
	Delivered int64
	// OldestDeliveredAge is how long ago the oldest delivered record not
	// yet purged was delivered, 0 when none: with retention running it
	// stays near the retention window.
	OldestDeliveredAge time.Duration
	// Dead counts dead-lettered records.
	Dead int64
	// OldestPendingAge is the age of the oldest pending record, 0 when none.
	OldestPendingAge time.Duration
	// Skipped counts dead records an operator gave up on ([Operator.Skip]);
	// 0 from storages without Skip.
	Skipped int64
	// HeldKeys counts the keys held back right now (see [Operator.HeldKeys]);
	// 0 from storages that do not report it.
	HeldKeys int64
	// Forwarders counts the distinct workers holding a live lease: the
	// forwarders seen working right now. 0 from storages that do not report it.
	Forwarders int64
	// Fenced counts pending records held back because a transaction older
	// than theirs is still running (the PostgreSQL storage's CommitFence):
	// when it stays above 0, a long transaction is holding delivery back.
	// 0 from storages without such a fence.
	Fenced int64
}

// StatsReader is implemented by storages that can report [Stats]; the metrics
// middleware uses it.
type StatsReader interface {
	Stats(ctx context.Context) (Stats, error)
}

// Inserter is implemented by SQL storages: it writes records through the
// caller's own transaction, which is what makes the outbox transactional. tx is
// the adapter's transaction type (pgx.Tx or *sql.Tx for Postgres, *sql.Tx for
// SQLite); any other type is an error wrapping [ErrUnsupportedTx]. Only UUID,
// Topic, Key, Payload, Metadata and DueAt of each record are used. All
// records are written in one round trip when the adapter can.
type Inserter interface {
	Insert(ctx context.Context, tx any, records []Record) error
}

// Errors callers branch on.
var (
	// ErrUnsupportedTx is returned by Inserter.Insert for a transaction type the
	// adapter cannot write through.
	ErrUnsupportedTx = errors.New("unsupported transaction type")
	// ErrInvalidIdentifier is returned by adapter constructors for a table,
	// schema or channel name that is not a plain SQL identifier.
	ErrInvalidIdentifier = errors.New("invalid SQL identifier")
	// ErrInvalidRecord is returned by Insert for a record that cannot be stored
	// (empty topic, invalid metadata, ...); nothing is written.
	ErrInvalidRecord = errors.New("invalid outbox record")
	// ErrInvalidRedrive is returned by Maintainer.Redrive for RedriveParams
	// that do not select exactly one way.
	ErrInvalidRedrive = errors.New("invalid redrive parameters")
	// ErrNotOutboxTable is returned by a SQL storage's Migrate when a table
	// of the name it would create exists without the columns of an outbox
	// table (another application's table); nothing is created or recorded.
	ErrNotOutboxTable = errors.New("not an outbox table")
)

// RedriveParams select dead-lettered records to put back to pending with
// attempts reset. Exactly one of IDs, Key, Topic or All must be set.
//
// Re-driven records keep their ids, so they are claimed again in id order per
// key, before any later record of their key. Re-driving is idempotent: only
// records that are dead when it runs change, so running it twice changes
// nothing the second time.
type RedriveParams struct {
	// IDs re-drives these dead-lettered records; other ids are ignored.
	IDs []int64
	// Key re-drives every dead-lettered record of this ordering key.
	Key string
	// Topic re-drives every dead-lettered record of this topic.
	Topic string
	// All re-drives every dead-lettered record.
	All bool
}

// Validate reports an error wrapping ErrInvalidRedrive unless exactly one of
// IDs, Key, Topic or All is set.
func (p RedriveParams) Validate() error {
	n := 0
	for _, set := range []bool{len(p.IDs) > 0, p.Key != "", p.Topic != "", p.All} {
		if set {
			n++
		}
	}
	if n != 1 {
		return fmt.Errorf("%w: set exactly one of RedriveParams.IDs, Key, Topic or All", ErrInvalidRedrive)
	}
	return nil
}

// Membership is implemented by storages that keep track of the workers
// claiming from them (the PostgreSQL storage shares its key slots among
// them). The forwarder's Run calls Join before its first claim, so that
// forwarders starting together share the keys from their first claims on,
// and Leave when it returns, so that the others take over its share at once
// instead of after a timeout; RunOnce, whose claim joins, calls Leave when it
// is done. Neither may touch records or leases; a claim joins too.
type Membership interface {
	Join(ctx context.Context, workerID string) error
	Leave(ctx context.Context, workerID string) error
}

// DrainClaimer is implemented by storages whose claims can tell that they
// left nothing claimable behind (the PostgreSQL storage). A forwarder whose
// claim drained the storage has caught up with its stream, and paces its
// next claim (see ForwarderConfig.PollMin) rather than claiming back to back
// a few records at a time; a storage without it is claimed back to back
// while claims find records.
type DrainClaimer interface {
	// ClaimDrained is Claim, and also reports whether the claim left no
	// claimable record out: every record that was due, unleased and not held
	// back when it ran was handed out. drained is never true when one was
	// left out (a full batch, say); it may be false when none was.
	ClaimDrained(ctx context.Context, params ClaimParams) (records []Record, drained bool, err error)
}

// Maintainer is implemented by SQL storages: housekeeping for operators.
type Maintainer interface {
	// Purge deletes delivered records older than olderThan, in bounded batches so
	// it never holds a long lock, and returns how many it deleted.
	Purge(ctx context.Context, olderThan time.Duration) (int64, error)
	// Redrive puts dead-lettered records back to pending with attempts reset
	// and no error, due at once, and returns how many it changed. Records keep
	// their ids; records that are not dead are left alone (idempotent). A
	// storage that cannot select by Key or All returns an error wrapping
	// ErrInvalidRedrive for them rather than re-driving nothing.
	Redrive(ctx context.Context, params RedriveParams) (int64, error)
}

// Pruner is implemented by storages whose forwarders keep delivered records
// within a retention window themselves (ForwarderConfig.Retention in the
// txoutbox package). One call deletes one bounded batch; the forwarder
// calls it again while batches come back full.
type Pruner interface {
	// Prune deletes at most params.Limit records delivered more than
	// params.OlderThan ago, the oldest first, and returns how many it
	// deleted. Only one caller prunes at a time, across processes: with an
	// advisory lock, a call that finds another pruning returns 0 at once
	// rather than wait; with the database's write lock (SQLite), calls take
	// turns. It never touches pending, dead or skipped records.
	Prune(ctx context.Context, params PruneParams) (int64, error)
}

// PruneParams are the parameters of [Pruner.Prune].
type PruneParams struct {
	// OlderThan is the retention window: records delivered longer ago are
	// deleted; >= 0.
	OlderThan time.Duration
	// Limit is the most records one call deletes; > 0.
	Limit int
}

// Validate reports an error unless OlderThan >= 0 and Limit > 0.
func (p PruneParams) Validate() error {
	if p.OlderThan < 0 || p.Limit <= 0 {
		return fmt.Errorf("prune outbox records: OlderThan must be >= 0 and Limit > 0, got %s and %d", p.OlderThan, p.Limit)
	}
	return nil
}
