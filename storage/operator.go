package storage

import (
	"context"
	"errors"
	"time"
)

// Operator is implemented by storages that support the operator's work: what
// is held back and why, the dead letters, one record in full, re-drive and
// skip. The txoutbox command is built on it, and a service can expose the
// same operations itself. Like [Storage], it is meant to be implemented by
// users; every method takes a context and one parameter struct (Record takes
// the id alone), so it can grow without breaking implementations.
type Operator interface {
	StatsReader
	Maintainer

	// HeldKeys lists the keys held back right now, in key order: keys whose
	// first record (the head) is not claimable and has records waiting behind
	// it, and, with hold-on-dead-letter, keys whose head is dead. Without
	// strict ordering no key is held back and the list is empty.
	HeldKeys(ctx context.Context, params HeldKeysParams) ([]HeldKey, error)

	// ListDead lists dead-lettered records in id order, without their
	// payload (see Record), filtered and paged by params.
	ListDead(ctx context.Context, params ListDeadParams) ([]RecordInfo, error)

	// Record returns one record in full, whatever its status, including a
	// skipped one. An unknown id (never inserted, or purged) is an error
	// wrapping [ErrRecordNotFound].
	Record(ctx context.Context, id int64) (RecordInfo, error)

	// Skip gives up on a dead record: it becomes skipped, is never delivered,
	// and no longer holds back its key. params.Reason is kept with it as the
	// audit record. Skipping a skipped record changes nothing and succeeds;
	// any other record that is not dead is an error wrapping [ErrNotDead]
	// (an unknown one wraps [ErrRecordNotFound]) and nothing changes.
	Skip(ctx context.Context, params SkipParams) error
}

// DeadLetterHolder is implemented by storages that can hold a key on
// dead-letter. HoldOnDeadLetter reports whether this one does: a dead record
// then holds back the later records of its key until it is re-driven or
// skipped, and a relay that dead-letters a record must release, not publish,
// the later records of its key it already holds.
type DeadLetterHolder interface {
	HoldOnDeadLetter() bool
}

// Errors of [Operator] callers branch on.
var (
	// ErrRecordNotFound is returned for an id that is not in the table.
	ErrRecordNotFound = errors.New("outbox record not found")
	// ErrNotDead is returned by Skip for a record that is not dead-lettered.
	ErrNotDead = errors.New("outbox record is not dead-lettered")
)

// HoldReason says why a key is held back: what its head record is doing.
type HoldReason string

// The reasons a key is held back.
const (
	// HoldLeased: the head is leased to a worker (being published).
	HoldLeased HoldReason = "leased"
	// HoldRetry: the head failed and waits for its retry time.
	HoldRetry HoldReason = "retry"
	// HoldDead: the head is dead-lettered and the storage holds keys on
	// dead-letter, until it is re-driven or skipped.
	HoldDead HoldReason = "dead"
)

// HeldKeysParams are the parameters of [Operator.HeldKeys].
type HeldKeysParams struct {
	// AfterKey pages: only keys sorting after it are listed.
	AfterKey string
	// Limit is the most keys returned; 0 means [ListLimitDefault].
	Limit int
}

// HeldKey is one key held back, as reported by [Operator.HeldKeys].
type HeldKey struct {
	// Key is the ordering key.
	Key string
	// HeadID is the id of the key's first record, the one holding the rest.
	HeadID int64
	// Reason says what the head is doing.
	Reason HoldReason
	// LeasedBy is the worker holding the head's lease (Reason leased).
	LeasedBy string
	// Until is when the hold ends by itself: the end of the lease (leased)
	// or the retry time (retry). Zero for dead: only an operator ends it.
	Until time.Time
	// LastError is the head's last error, empty when none.
	LastError string
	// Since is when the head record was created: records behind it have
	// waited at most this long.
	Since time.Time
	// Behind counts the pending records of the key waiting behind the head.
	Behind int64
}

// ListLimitDefault is the page size of HeldKeys and ListDead when the
// params' Limit is 0.
const ListLimitDefault = 100

// ListDeadParams are the parameters of [Operator.ListDead]. Filters combine
// with AND; zero values do not filter.
type ListDeadParams struct {
	// Topic lists only records of this topic.
	Topic string
	// Key lists only records of this ordering key.
	Key string
	// ErrorContains lists only records whose last error contains this text
	// (case-sensitive).
	ErrorContains string
	// OlderThan lists only records created more than this long ago.
	OlderThan time.Duration
	// AfterID pages: only records with a larger id are listed.
	AfterID int64
	// Limit is the most records returned; 0 means [ListLimitDefault].
	Limit int
}

// RecordInfo is a record with its bookkeeping, as an operator sees it.
type RecordInfo struct {
	// Record is the record; Attempts counts its claims so far. ListDead
	// leaves Payload empty.
	Record Record
	// Status is pending, delivered, dead or skipped.
	Status Status
	// LastError is the error of the last nack or dead-letter, empty when none.
	LastError string
	// LeasedBy and LeasedUntil describe a live or expired lease; empty and
	// zero when the record is not leased.
	LeasedBy    string
	LeasedUntil time.Time
	// DueAt is when a pending record is due; zero when due at once.
	DueAt time.Time
	// DeadAt is when the record was dead-lettered, zero when unknown or not
	// dead.
	DeadAt time.Time
	// DeliveredAt is when the record was delivered, zero when it was not.
	DeliveredAt time.Time
	// SkippedAt and SkipReason are the audit record of a skip.
	SkippedAt  time.Time
	SkipReason string
}

// SkipParams are the parameters of [Operator.Skip].
type SkipParams struct {
	// ID is the dead record to give up on.
	ID int64
	// Reason is why, kept as the audit record; required.
	Reason string
}

// PageLimit returns the page size: limit, or ListLimitDefault when it is <= 0.
func PageLimit(limit int) int {
	if limit <= 0 {
		return ListLimitDefault
	}
	return limit
}

// Migrator is implemented by SQL storages with versioned migrations: the
// schema is a list of numbered steps, and a version table in the database
// records which ones ran.
type Migrator interface {
	// Migrate applies the steps the database lacks, in order, each recorded
	// in the version table, under a lock that makes concurrent callers safe:
	// one applies them, the others find them applied. It never loses or
	// re-orders a record.
	Migrate(ctx context.Context) error

	// MigrationStatus reports the database's version against the latest one
	// this code knows, and the steps applied.
	MigrationStatus(ctx context.Context) (MigrationStatus, error)

	// Migrations lists the embedded steps in version order, with their SQL
	// as run against this storage's table, for export to a migration tool.
	Migrations() []Migration
}

// MigrateReporter is implemented by Migrators that can say what one
// Migrate call did. Of several processes migrating one database at once,
// only the one that applied a step reports it; the txoutbox command says
// so.
type MigrateReporter interface {
	// MigrateReport is Migrate, returning the versions of the steps this
	// call applied, in order: none when the database was at the latest
	// version already, or when another caller applied the steps first.
	MigrateReport(ctx context.Context) (applied []int, err error)
}

// Migration is one numbered schema step.
type Migration struct {
	// Version numbers the step, from 1, without gaps.
	Version int
	// Name describes the step in a few words, like a file name.
	Name string
	// Up is the SQL that applies the step.
	Up string
	// Down is the SQL that reverts it, empty when reverting is not safe
	// (it would lose records).
	Down string
}

// MigrationStatus is what [Migrator.MigrationStatus] reports.
type MigrationStatus struct {
	// Current is the highest version applied; 0 for a database without the
	// version table (never migrated, or made by hand from SchemaSQL).
	Current int
	// Latest is the highest version this code knows.
	Latest int
	// Applied lists the applied steps in version order.
	Applied []AppliedMigration
}

// AppliedMigration is one row of the version table.
type AppliedMigration struct {
	Version   int
	Name      string
	AppliedAt time.Time
}

// Diagnoser is implemented by storages that can check their own database
// for the txoutbox doctor command.
type Diagnoser interface {
	// Diagnose runs the storage's checks (schema version and drift, indexes,
	// settings, privileges, ...) and returns one Finding per check. An error
	// means the checks could not run, not that one failed.
	Diagnose(ctx context.Context) ([]Finding, error)
}

// Severity grades a [Finding].
type Severity string

// The severities of a finding.
const (
	SeverityOK      Severity = "ok"
	SeverityWarning Severity = "warning"
	SeverityProblem Severity = "problem"
)

// Finding is the outcome of one check of [Diagnoser.Diagnose].
type Finding struct {
	// Check names the check, for example "schema version".
	Check string
	// Severity is ok, warning or problem.
	Severity Severity
	// Message says what was found and, for a problem, what to do.
	Message string
}
