package memory

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// HeldKeys implements [storage.Operator].
func (s *Storage) HeldKeys(ctx context.Context, params storage.HeldKeysParams) ([]storage.HeldKey, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("list held keys: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	held := s.heldKeys(s.config.Now())
	held = slices.DeleteFunc(held, func(h storage.HeldKey) bool { return h.Key <= params.AfterKey })
	return held[:min(len(held), storage.PageLimit(params.Limit))], nil
}

// heldKeys returns every key held back at now, in key order. s.mu is held.
func (s *Storage) heldKeys(now time.Time) []storage.HeldKey {
	if s.config.DisableStrictOrdering {
		return nil
	}
	hold := s.config.HoldOnDeadLetter
	heads := make(map[string]*storage.HeldKey)
	var out []*storage.HeldKey
	for _, e := range s.records {
		key := e.record.Key
		if key == "" || !(e.status == storage.StatusPending || hold && e.status == storage.StatusDead) {
			continue
		}
		if h, ok := heads[key]; ok {
			if h != nil && e.status == storage.StatusPending {
				h.Behind++
			}
			continue
		}
		var h *storage.HeldKey
		switch {
		case e.status == storage.StatusDead:
			h = &storage.HeldKey{Reason: storage.HoldDead}
		case now.Before(e.leasedUntil):
			h = &storage.HeldKey{Reason: storage.HoldLeased, LeasedBy: e.leasedBy, Until: e.leasedUntil}
		case now.Before(e.dueAt):
			h = &storage.HeldKey{Reason: storage.HoldRetry, Until: e.dueAt}
		}
		heads[key] = h // nil: the head is claimable, the key is not held
		if h != nil {
			h.Key, h.HeadID, h.LastError, h.Since = key, e.record.ID, e.lastError, e.record.CreatedAt
			out = append(out, h)
		}
	}
	held := make([]storage.HeldKey, 0, len(out))
	for _, h := range out {
		if h.Reason == storage.HoldDead || h.Behind > 0 {
			held = append(held, *h)
		}
	}
	slices.SortFunc(held, func(a, b storage.HeldKey) int { return strings.Compare(a.Key, b.Key) })
	return held
}

// ListDead implements [storage.Operator].
func (s *Storage) ListDead(ctx context.Context, params storage.ListDeadParams) ([]storage.RecordInfo, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("list dead outbox records: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	limit := storage.PageLimit(params.Limit)
	cutoff := s.config.Now().Add(-params.OlderThan)
	var out []storage.RecordInfo
	for _, e := range s.records {
		if len(out) == limit {
			break
		}
		r := e.record
		if e.status != storage.StatusDead || r.ID <= params.AfterID ||
			params.Topic != "" && r.Topic != params.Topic ||
			params.Key != "" && r.Key != params.Key ||
			params.ErrorContains != "" && !strings.Contains(e.lastError, params.ErrorContains) ||
			params.OlderThan > 0 && !r.CreatedAt.Before(cutoff) {
			continue
		}
		info := e.info()
		info.Record.Payload = nil
		out = append(out, info)
	}
	return out, nil
}

// Record implements [storage.Operator].
func (s *Storage) Record(ctx context.Context, id int64) (storage.RecordInfo, error) {
	if err := ctx.Err(); err != nil {
		return storage.RecordInfo{}, fmt.Errorf("read outbox record %d: %w", id, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	e, ok := s.byID[id]
	if !ok {
		return storage.RecordInfo{}, fmt.Errorf("read outbox record %d: %w", id, storage.ErrRecordNotFound)
	}
	return e.info(), nil
}

// Skip implements [storage.Operator].
func (s *Storage) Skip(ctx context.Context, params storage.SkipParams) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("skip outbox record %d: %w", params.ID, err)
	}
	if params.Reason == "" {
		return fmt.Errorf("skip outbox record %d: SkipParams.Reason is required (it is the audit record)", params.ID)
	}
	s.mu.Lock()
	defer s.mu.Unlock()

	e, ok := s.byID[params.ID]
	switch {
	case !ok:
		return fmt.Errorf("skip outbox record %d: %w", params.ID, storage.ErrRecordNotFound)
	case e.status == storage.StatusSkipped:
		return nil
	case e.status != storage.StatusDead:
		return fmt.Errorf("skip outbox record %d (%s): %w", params.ID, e.status, storage.ErrNotDead)
	}
	e.status = storage.StatusSkipped
	e.skippedAt = s.config.Now()
	e.skipReason = params.Reason
	return nil
}

func (e *entry) info() storage.RecordInfo {
	return storage.RecordInfo{
		Record:      cloneRecord(e.record),
		Status:      e.status,
		LastError:   e.lastError,
		LeasedBy:    e.leasedBy,
		LeasedUntil: e.leasedUntil,
		DueAt:       e.dueAt,
		DeadAt:      e.deadAt,
		DeliveredAt: e.deliveredAt,
		SkippedAt:   e.skippedAt,
		SkipReason:  e.skipReason,
	}
}
