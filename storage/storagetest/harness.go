package storagetest

import (
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// Harness tells the suite how to make and fill the storage under test.
type Harness struct {
	// New returns a fresh, empty storage for one test. It is called once per
	// test case, possibly from parallel tests. Use t.Cleanup to tear it down.
	New func(t *testing.T) storage.Storage

	// Insert commits records (only UUID, Topic, Key, Payload, Metadata and
	// DueAt are set) in the given order and returns their ids. A record's
	// DueAt is its earliest claim time (see [storage.Record.DueAt]); the
	// DelayedDelivery cases run only when DelayedDelivery is set.
	Insert func(t *testing.T, s storage.Storage, records ...storage.Record) []int64

	// DelayedDelivery says Insert honours Record.DueAt: the delayed delivery
	// cases run only when it is true.
	DelayedDelivery bool

	// Inspect, if set, returns the stored state of one record; the cases that
	// check recorded errors and parked records need it and are skipped without.
	Inspect func(t *testing.T, s storage.Storage, id int64) State

	// StrictOrdering says the storage promises strict ordering; the ordering
	// cases run only when it is true.
	StrictOrdering bool

	// NewHoldOnDeadLetter, if set, returns a fresh, empty storage that holds
	// a key on dead-letter: a dead record holds back the later records of its
	// key until it is re-driven or skipped, and a record that failed before
	// is claimed without the later records of its key. The HoldOnDeadLetter
	// cases run on it, and are skipped without it. Needs StrictOrdering.
	NewHoldOnDeadLetter func(t *testing.T) storage.Storage

	// Operator, if set, returns the [storage.Operator] of a storage made by
	// New or NewHoldOnDeadLetter. Defaults to a type assertion; the Operator
	// cases are skipped when it returns nil or the assertion fails.
	Operator func(t *testing.T, s storage.Storage) storage.Operator

	// Parallel runs the cases with t.Parallel.
	Parallel bool

	// ShortLease is the lease, and the retry delay, of the cases that wait for
	// a lease to expire or a retry to fall due. Defaults to
	// [ShortLeaseDefault]; raise it for a storage whose clock is coarse or
	// whose round trips are slow.
	ShortLease time.Duration
}

// State is what Inspect reports about one record.
type State struct {
	Status    storage.Status
	Attempts  int
	LastError string
	// LeasedBy is the worker holding the lease, empty when none.
	LeasedBy string
	// LeasedUntil is the lease expiry, zero when not leased.
	LeasedUntil time.Time
	// DueAt is when the record is due, zero when due immediately.
	DueAt time.Time
}
