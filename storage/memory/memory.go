package memory

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// Config configures a [Storage]. The zero value is ready to use.
type Config struct {
	// DisableStrictOrdering turns strict ordering off: a record is then
	// claimable even while an earlier record with the same key is leased or
	// waiting for its retry. Defaults to false (strict ordering on).
	DisableStrictOrdering bool

	// HoldOnDeadLetter makes a dead-lettered record hold back the later
	// records of its key until it is re-driven or skipped, so that a poison
	// message never breaks the order of its key. A record that failed before
	// is then claimed without the later records of its key, so that a
	// forwarder cannot publish them in the same batch after dead-lettering
	// it. Needs strict ordering; ignored without it. Defaults to false: a
	// dead record lets its key move on.
	HoldOnDeadLetter bool

	// Now is the clock used for leases, due times and ages. Defaults to
	// time.Now; tests can pass a fake clock.
	Now func() time.Time
}

func (c *Config) setDefaults() {
	if c.Now == nil {
		c.Now = time.Now
	}
}

// Storage is an in-memory outbox table. It is safe for concurrent use; the
// zero value is not usable, call [New].
type Storage struct {
	config Config

	mu      sync.Mutex
	lastID  int64
	records []*entry // ascending id order; Purge removes from it
	byID    map[int64]*entry
}

// entry is one record and its bookkeeping, the columns a SQL table would have.
type entry struct {
	record      storage.Record // Attempts is kept up to date here
	status      storage.Status
	lastError   string
	leasedBy    string    // empty when not leased
	leasedUntil time.Time // zero when not leased
	dueAt       time.Time // zero when due at once
	deliveredAt time.Time // set by Ack, for Purge
	deadAt      time.Time // set by DeadLetter
	skippedAt   time.Time // set by Skip
	skipReason  string
}

// RecordState is a snapshot of one stored record, returned by [Storage.Get].
type RecordState struct {
	// Record is a copy of the record, with its current attempts.
	Record storage.Record
	// Status is pending, delivered or dead.
	Status storage.Status
	// LastError is the error of the last Nack or DeadLetter, empty when none.
	LastError string
	// LeasedBy is the worker holding the lease, empty when none.
	LeasedBy string
	// LeasedUntil is the end of the lease, zero when not leased.
	LeasedUntil time.Time
	// DueAt is when the record is due, zero when due at once.
	DueAt time.Time
}

// Compile-time checks of what the reference storage promises.
var (
	_ storage.Storage          = (*Storage)(nil)
	_ storage.StatsReader      = (*Storage)(nil)
	_ storage.Maintainer       = (*Storage)(nil)
	_ storage.Operator         = (*Storage)(nil)
	_ storage.DeadLetterHolder = (*Storage)(nil)
	_ storage.Pruner           = (*Storage)(nil)
)

// New returns an empty storage.
func New(config Config) *Storage {
	config.setDefaults()
	return &Storage{config: config, byID: make(map[int64]*entry)}
}

// HoldOnDeadLetter reports whether a dead record holds back its key
// (Config.HoldOnDeadLetter with strict ordering).
func (s *Storage) HoldOnDeadLetter() bool {
	return s.config.HoldOnDeadLetter && !s.config.DisableStrictOrdering
}

// Add inserts records, committed at once, and returns their ids in the same
// order. Only UUID, Topic, Key, Payload, Metadata and DueAt are used; the
// payload and metadata are copied. Add does not validate the records.
func (s *Storage) Add(records ...storage.Record) []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()

	now := s.config.Now()
	ids := make([]int64, 0, len(records))
	for _, r := range records {
		s.lastID++
		e := &entry{
			record: storage.Record{
				ID:        s.lastID,
				UUID:      r.UUID,
				Topic:     r.Topic,
				Key:       r.Key,
				Payload:   slices.Clone(r.Payload),
				Metadata:  maps.Clone(r.Metadata),
				CreatedAt: now,
			},
			status: storage.StatusPending,
		}
		if r.DueAt.After(now) {
			e.dueAt = r.DueAt
		}
		s.records = append(s.records, e)
		s.byID[e.record.ID] = e
		ids = append(ids, e.record.ID)
	}
	return ids
}

// Get returns the stored state of the record with this id, and false when
// there is none (never inserted, or purged).
func (s *Storage) Get(id int64) (RecordState, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()

	e, ok := s.byID[id]
	if !ok {
		return RecordState{}, false
	}
	return RecordState{
		Record:      cloneRecord(e.record),
		Status:      e.status,
		LastError:   e.lastError,
		LeasedBy:    e.leasedBy,
		LeasedUntil: e.leasedUntil,
		DueAt:       e.dueAt,
	}, true
}

// Claim leases up to params.BatchSize due, unleased, pending records to
// params.WorkerID, in id order, and increments their attempts.
func (s *Storage) Claim(ctx context.Context, params storage.ClaimParams) ([]storage.Record, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("claim outbox records: %w", err)
	}
	if params.BatchSize <= 0 || params.Lease <= 0 || params.WorkerID == "" {
		return nil, fmt.Errorf("claim outbox records: batch size %d and lease %v must be > 0 and the worker id set",
			params.BatchSize, params.Lease)
	}

	s.mu.Lock()
	defer s.mu.Unlock()

	now := s.config.Now()
	strict := !s.config.DisableStrictOrdering
	hold := strict && s.config.HoldOnDeadLetter
	// heldBack holds the keys whose first pending record is not claimable now:
	// every later record of such a key waits (strict ordering).
	heldBack := make(map[string]bool)
	claimed := make([]*entry, 0, params.BatchSize)

	for _, e := range s.records {
		if len(claimed) == params.BatchSize {
			break
		}
		key := e.record.Key
		if hold && key != "" && e.status == storage.StatusDead {
			heldBack[key] = true // until re-driven or skipped
			continue
		}
		if e.status != storage.StatusPending {
			continue
		}
		if strict && key != "" && heldBack[key] {
			continue
		}
		// Judged on the state before this claim, so a key's claimable records
		// can share one batch: the forwarder publishes them in order.
		if !e.claimableAt(now) {
			if strict && key != "" {
				heldBack[key] = true
			}
			continue
		}
		claimed = append(claimed, e)
		if hold && key != "" && e.lastError != "" {
			// It failed before and may be dead-lettered this time: the rest
			// of its key must not be in the forwarder's hands by then.
			heldBack[key] = true
		}
	}

	out := make([]storage.Record, 0, len(claimed))
	for _, e := range claimed {
		e.leasedBy = params.WorkerID
		e.leasedUntil = now.Add(params.Lease)
		e.record.Attempts++
		out = append(out, cloneRecord(e.record))
	}
	return out, nil
}

// Ack marks delivered the records whose lease params.WorkerID holds by the
// claim their ClaimRef names.
func (s *Storage) Ack(ctx context.Context, params storage.AckParams) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("ack outbox records: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	now := s.config.Now()
	for _, ref := range params.Records {
		if e := s.leased(ref, params.WorkerID); e != nil {
			e.status = storage.StatusDelivered
			e.deliveredAt = now
			e.endLease()
		}
	}
	return nil
}

// Nack records the error and schedules the retry of a record whose lease
// params.WorkerID holds by the claim params.Record names.
func (s *Storage) Nack(ctx context.Context, params storage.NackParams) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("nack outbox record %d: %w", params.Record.ID, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	if e := s.leased(params.Record, params.WorkerID); e != nil {
		e.lastError = params.Error
		e.dueAt = params.RetryAt
		e.endLease()
	}
	return nil
}

// Release gives back records that were never tried, whose lease
// params.WorkerID holds by the claim their ClaimRef names: attempts-1, no
// error recorded, due again at params.RetryAt.
func (s *Storage) Release(ctx context.Context, params storage.ReleaseParams) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("release outbox records: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	for _, ref := range params.Records {
		if e := s.leased(ref, params.WorkerID); e != nil {
			e.record.Attempts = max(e.record.Attempts-1, 0)
			e.dueAt = params.RetryAt
			e.endLease()
		}
	}
	return nil
}

// DeadLetter parks for good a record whose lease params.WorkerID holds by
// the claim params.Record names.
func (s *Storage) DeadLetter(ctx context.Context, params storage.DeadLetterParams) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("dead-letter outbox record %d: %w", params.Record.ID, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	if e := s.leased(params.Record, params.WorkerID); e != nil {
		e.status = storage.StatusDead
		e.lastError = params.Error
		e.deadAt = s.config.Now()
		e.endLease()
	}
	return nil
}

// Extend pushes the lease of the records params.WorkerID still holds by the
// claim their ClaimRef names, and whose lease has not run out, to
// now+params.Lease.
func (s *Storage) Extend(ctx context.Context, params storage.ExtendParams) ([]int64, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("extend outbox leases: %w", err)
	}
	if params.Lease <= 0 {
		return nil, fmt.Errorf("extend outbox leases: lease %v must be > 0", params.Lease)
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	now := s.config.Now()
	var extended []int64
	for _, ref := range params.Records {
		if e := s.leased(ref, params.WorkerID); e != nil && now.Before(e.leasedUntil) {
			e.leasedUntil = now.Add(params.Lease)
			extended = append(extended, ref.ID)
		}
	}
	return extended, nil
}

// Stats counts the records by state.
func (s *Storage) Stats(ctx context.Context) (storage.Stats, error) {
	if err := ctx.Err(); err != nil {
		return storage.Stats{}, fmt.Errorf("read outbox stats: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	now := s.config.Now()
	var stats storage.Stats
	for _, e := range s.records {
		switch e.status {
		case storage.StatusPending:
			stats.Pending++
			if now.Before(e.leasedUntil) {
				stats.Leased++
			}
			if stats.Pending == 1 {
				// Ids grow with insertion, so the first pending record is the oldest.
				stats.OldestPendingAge = max(now.Sub(e.record.CreatedAt), 0)
			}
		case storage.StatusDelivered:
			stats.Delivered++
			stats.OldestDeliveredAge = max(stats.OldestDeliveredAge, now.Sub(e.deliveredAt))
		case storage.StatusDead:
			stats.Dead++
		case storage.StatusSkipped:
			stats.Skipped++
		}
	}
	stats.HeldKeys = int64(len(s.heldKeys(now)))
	workers := make(map[string]bool)
	for _, e := range s.records {
		if e.status == storage.StatusPending && e.leasedBy != "" && now.Before(e.leasedUntil) {
			workers[e.leasedBy] = true
		}
	}
	stats.Forwarders = int64(len(workers))
	return stats, nil
}

// Purge deletes records delivered more than olderThan ago and returns how
// many it deleted.
func (s *Storage) Purge(ctx context.Context, olderThan time.Duration) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("purge outbox records: %w", err)
	}
	if olderThan < 0 {
		return 0, fmt.Errorf("purge outbox records: olderThan is %v, must be >= 0", olderThan)
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	cutoff := s.config.Now().Add(-olderThan)
	var deleted int64
	s.records = slices.DeleteFunc(s.records, func(e *entry) bool {
		if e.status != storage.StatusDelivered || !e.deliveredAt.Before(cutoff) {
			return false
		}
		delete(s.byID, e.record.ID)
		deleted++
		return true
	})
	return deleted, nil
}

// Prune implements [storage.Pruner]: it deletes up to params.Limit records
// delivered more than params.OlderThan ago, under the storage's lock.
func (s *Storage) Prune(ctx context.Context, params storage.PruneParams) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("prune outbox records: %w", err)
	}
	if err := params.Validate(); err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	cutoff := s.config.Now().Add(-params.OlderThan)
	var deleted int64
	s.records = slices.DeleteFunc(s.records, func(e *entry) bool {
		if deleted == int64(params.Limit) || e.status != storage.StatusDelivered || !e.deliveredAt.Before(cutoff) {
			return false
		}
		delete(s.byID, e.record.ID)
		deleted++
		return true
	})
	return deleted, nil
}

// ErrInvalidRedrive is storage.ErrInvalidRedrive, kept under this name too.
var ErrInvalidRedrive = storage.ErrInvalidRedrive

// Redrive puts dead-lettered records back to pending with attempts reset and
// no error, and returns how many it changed.
func (s *Storage) Redrive(ctx context.Context, params storage.RedriveParams) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("redrive outbox records: %w", err)
	}
	if err := params.Validate(); err != nil {
		return 0, fmt.Errorf("redrive outbox records: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	redrive := func(e *entry) int64 {
		if e == nil || e.status != storage.StatusDead {
			return 0
		}
		e.status = storage.StatusPending
		e.record.Attempts = 0
		e.lastError = ""
		e.dueAt = time.Time{}
		e.deadAt = time.Time{}
		e.endLease()
		return 1
	}
	var changed int64
	if len(params.IDs) > 0 {
		for _, id := range params.IDs {
			changed += redrive(s.byID[id])
		}
		return changed, nil
	}
	for _, e := range s.records {
		if params.All || (params.Topic != "" && e.record.Topic == params.Topic) ||
			(params.Key != "" && e.record.Key == params.Key) {
			changed += redrive(e)
		}
	}
	return changed, nil
}

// leased returns the pending record ref names if workerID holds its lease
// by the claim ref names (its attempts are ref.Attempt), nil otherwise: this
// is the fencing every write-back goes through. A lease that expired but was
// not claimed again still counts; once the record is claimed again, by
// another worker or by this one, leasedBy or the attempts differ and the old
// claim is shut out.
func (s *Storage) leased(ref storage.ClaimRef, workerID string) *entry {
	e := s.byID[ref.ID]
	if e == nil || e.status != storage.StatusPending || e.leasedBy == "" || e.leasedBy != workerID ||
		e.record.Attempts != ref.Attempt {
		return nil
	}
	return e
}

// claimableAt reports whether a pending record is due and unleased at now.
func (e *entry) claimableAt(now time.Time) bool {
	return !now.Before(e.dueAt) && !now.Before(e.leasedUntil)
}

func (e *entry) endLease() {
	e.leasedBy = ""
	e.leasedUntil = time.Time{}
}

func cloneRecord(r storage.Record) storage.Record {
	r.Payload = slices.Clone(r.Payload)
	r.Metadata = maps.Clone(r.Metadata)
	return r
}
