package postgres

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// holdOf reads a row's hold column ("" for NULL).
func holdOf(t *testing.T, s *Storage, id int64) string {
	t.Helper()
	var h *string
	must(t, s.pool.QueryRow(t.Context(), fmt.Sprintf(`SELECT hold FROM %s WHERE id = $1`, s.table), id).Scan(&h))
	if h == nil {
		return ""
	}
	return *h
}

// TestNoParkingBehindAFailedRecordInFlight: with HoldOnDeadLetter a failed
// record holds its key's later records, but while it is in flight nothing
// is parked behind it: its owner's ack takes no lock and could miss a row
// parked meanwhile, which would then wait for the sweep.
func TestNoParkingBehindAFailedRecordInFlight(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{HoldOnDeadLetter: true})
	e := insert(t, s, rec("k"))[0]
	claim(t, s, "w", 10, time.Minute)
	must(t, s.Nack(ctx, storage.NackParams{ID: e, WorkerID: "w", Error: "boom", RetryAt: time.Now().Add(-time.Second)}))
	if got := idsOf(claim(t, s, "w", 10, time.Minute)); len(got) != 1 || got[0] != e {
		t.Fatalf("claimed %v, want the failed record %d again", got, e)
	}
	q := insert(t, s, rec("k"))[0]
	if got := claim(t, s, "w", 10, time.Minute); len(got) != 0 {
		t.Fatalf("claimed %v while the failed record %d is in flight", idsOf(got), e)
	}
	if h := holdOf(t, s, q); h != "" {
		t.Fatalf("record %d has hold %q behind a failed record in flight, want none", q, h)
	}
	must(t, s.Ack(ctx, storage.AckParams{IDs: []int64{e}, WorkerID: "w"}))
	if got := idsOf(claim(t, s, "w", 10, time.Minute)); len(got) != 1 || got[0] != q {
		t.Fatalf("claimed %v after the ack, want %d", got, q)
	}
}

// TestNackOfVersion3KeepsOrder: during a rolling upgrade a process of schema
// version 3 nacks a record for later without a hold; the next record of its
// key still waits for it.
func TestNackOfVersion3KeepsOrder(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	head := insert(t, s, rec("k"))[0]
	claim(t, s, "old", 1, time.Minute)
	next := insert(t, s, rec("k"))[0]
	// Version 3's nack, under the claim lock as it took it.
	tx, err := s.pool.Begin(ctx)
	must(t, err)
	_, err = tx.Exec(ctx, s.q.writePlanLock, s.table)
	must(t, err)
	_, err = tx.Exec(ctx, fmt.Sprintf(`WITH l AS (DELETE FROM %s x WHERE x.id = $1 AND x.leased_by = $2 RETURNING x.id, x.attempts)
UPDATE %s o SET attempts = l.attempts, last_error = $3, due_at = $4 FROM l WHERE o.id = l.id AND o.status = 'pending'`, s.leases, s.table),
		head, "old", "boom", time.Now().Add(time.Hour))
	must(t, err)
	must(t, tx.Commit(ctx))
	if got := claim(t, s, "new", 10, time.Minute); len(got) != 0 {
		t.Fatalf("claimed %v while record %d of the key waits for its retry (next: %d)", idsOf(got), head, next)
	}
	if h := holdOf(t, s, head); h != "retry" {
		t.Fatalf("record %d nacked by version 3 has hold %q after a claim, want retry", head, h)
	}
}

// TestDeadLetterTakesTheClaimLockWithHoldOnDeadLetter: a dead-letter waits
// for the claim lock when dead records hold their key: a claim that saw the
// record's lease run out must not fail to take it over and still hand out
// the next record of its key.
func TestDeadLetterTakesTheClaimLockWithHoldOnDeadLetter(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{HoldOnDeadLetter: true})
	id := insert(t, s, rec("k"))[0]
	claim(t, s, "w", 1, time.Minute)
	tx, err := s.pool.Begin(ctx)
	must(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // test
	_, err = tx.Exec(ctx, s.q.writePlanLock, s.table)
	must(t, err)
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	err = s.DeadLetter(short, storage.DeadLetterParams{ID: id, WorkerID: "w", Error: "poison"})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("DeadLetter while the claim lock is held returned %v, want it to wait for the lock", err)
	}
}
