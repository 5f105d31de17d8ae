package postgres

import (
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox/storage"
)

// inFlightWithRowBehind leases the first record of key k to worker w (a
// minute) and inserts a second one behind it: it returns both ids. s parks
// behind records in flight at one row.
func inFlightWithRowBehind(t *testing.T, s *Storage) (head, behind int64) {
	t.Helper()
	s.parkFlightMin = 1
	head = insert(t, s, rec("k"))[0]
	if got := idsOf(claim(t, s, "w", 1, time.Minute)); !slices.Equal(got, []int64{head}) {
		t.Fatalf("claimed %v, want %d", got, head)
	}
	return head, insert(t, s, rec("k"))[0]
}

// TestClaimParksBehindARecordInFlight: a claim told that walks span far
// parks the rows it passes behind a record in flight, and the ack of that
// record sets the first of them free, which the next claim takes with the
// rest parked behind it.
func TestClaimParksBehindARecordInFlight(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	head, first := inFlightWithRowBehind(t, s)
	rest := insert(t, s, rec("k"), rec("k"))
	other := insert(t, s, rec("o"))

	s.walkedFar.Store(true)
	if got := idsOf(claim(t, s, "v", 10, time.Minute)); !slices.Equal(got, other) {
		t.Fatalf("claimed %v, want %v (the rows of k wait for %d)", got, other, head)
	}
	for _, id := range append([]int64{first}, rest...) {
		if h := holdOf(t, s, id); h != "behind" {
			t.Fatalf("record %d has hold %q behind %d in flight, want behind", id, h, head)
		}
	}
	must(t, s.Ack(ctx, storage.AckParams{IDs: []int64{head}, WorkerID: "w"}))
	if h := holdOf(t, s, first); h != "" {
		t.Fatalf("record %d has hold %q after the ack of %d, want none", first, h, head)
	}
	if got, want := idsOf(claim(t, s, "v", 10, time.Minute)), append([]int64{first}, rest...); !slices.Equal(got, want) {
		t.Fatalf("claimed %v after the ack, want %v", got, want)
	}
}

// TestNoParkingBehindRowsFewerThanTheMinimum: a claim parks nothing behind
// records in flight when it finds fewer rows behind them than the minimum
// (the rows of a drain's keys in flight), nor when it is not told that
// walks span far.
func TestNoParkingBehindRowsFewerThanTheMinimum(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	_, behind := inFlightWithRowBehind(t, s)
	claim(t, s, "v", 10, time.Minute)
	if h := holdOf(t, s, behind); h != "" {
		t.Fatalf("record %d has hold %q after a claim not told walks span far, want none", behind, h)
	}
	s.parkFlightMin = 2
	s.walkedFar.Store(true)
	claim(t, s, "v", 10, time.Minute)
	if h := holdOf(t, s, behind); h != "" {
		t.Fatalf("record %d has hold %q with 1 row behind records in flight and a minimum of 2, want none", behind, h)
	}
}

// TestAckBeforeAParkingClaimStrandsNothing: the owner's ack has locked the
// lease of the record in flight when a claim that would park behind it
// runs. The claim waits for the ack, finds the lease gone and parks
// nothing: the ack, which read what to set free before the claim committed,
// would not set a row parked then free, and nothing else would until the
// sweep.
func TestAckBeforeAParkingClaimStrandsNothing(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	s.nextSweep.Store(time.Now().Add(time.Hour).UnixNano())
	head, behind := inFlightWithRowBehind(t, s)
	tx, err := s.pool.Begin(ctx)
	must(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // committed below
	_, err = tx.Exec(ctx, s.q.lockLeases, []int64{head}, "w")
	must(t, err)
	_, err = tx.Exec(ctx, s.q.ack, []int64{head}, "w")
	must(t, err)
	s.walkedFar.Store(true)
	done := claimAsync(ctx, s)
	awaitLockWait(t, s) // the claim waits for the lease the ack holds
	must(t, tx.Commit(ctx))
	if r := <-done; r.err != nil || len(r.recs) != 0 {
		t.Fatalf("claim beside the ack: %v, %v; want nothing (its snapshot has %d in flight)", idsOf(r.recs), r.err, head)
	}
	if got := idsOf(claim(t, s, "v", 10, time.Minute)); !slices.Equal(got, []int64{behind}) {
		t.Fatalf("claimed %v after the ack of %d, want %d (hold %q)", got, head, behind, holdOf(t, s, behind))
	}
}

// TestAckAfterAParkingClaimSetsFree: a claim has parked a row behind a
// record in flight and not committed yet when the owner acks the record.
// The ack waits for the claim and then reads the parked row and sets it
// free: it locks its leases in a statement before the one that reads what
// to set free.
func TestAckAfterAParkingClaimSetsFree(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	s.nextSweep.Store(time.Now().Add(time.Hour).UnixNano())
	head, behind := inFlightWithRowBehind(t, s)
	tx, err := s.pool.Begin(ctx)
	must(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // committed below
	_, err = tx.Exec(ctx, s.q.planLock, s.table)
	must(t, err)
	_, err = tx.Exec(ctx, s.q.wake)
	must(t, err)
	rows, err := tx.Query(ctx, s.q.claim, claimArgs(s, 10, "v", 1)...)
	must(t, err)
	recs, err := pgx.CollectRows(rows, pgx.RowToMap)
	must(t, err)
	if len(recs) != 0 {
		t.Fatalf("claimed %v, want nothing (%d is in flight)", recs, head)
	}
	var hold string
	must(t, tx.QueryRow(ctx, "SELECT COALESCE(hold, '') FROM "+s.table+" WHERE id = $1", behind).Scan(&hold))
	if hold != "behind" {
		t.Fatalf("the claim left %d with hold %q behind %d in flight, want behind", behind, hold, head)
	}
	done := make(chan error, 1)
	go func() { done <- s.Ack(ctx, storage.AckParams{IDs: []int64{head}, WorkerID: "w"}) }()
	awaitLockWait(t, s) // the ack waits for the lease the claim locked
	must(t, tx.Commit(ctx))
	must(t, <-done)
	if got := idsOf(claim(t, s, "v", 10, time.Minute)); !slices.Equal(got, []int64{behind}) {
		t.Fatalf("claimed %v after the ack of %d, want %d (hold %q)", got, head, behind, holdOf(t, s, behind))
	}
}
