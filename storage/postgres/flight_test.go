package postgres

import (
	"fmt"
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

// ackIn runs the statements of worker's ack of ids (as their live claims
// returned them) in tx, which the caller commits: the lease lock, then the
// ack.
func ackIn(t *testing.T, tx pgx.Tx, s *Storage, ids []int64, worker string) {
	t.Helper()
	_, attempts := splitRefs(liveRefs(t, s, ids...))
	_, err := tx.Exec(t.Context(), s.q.lockLeases, ids, worker)
	must(t, err)
	_, err = tx.Exec(t.Context(), s.q.ack, ids, worker, attempts)
	must(t, err)
}

// awaitLeasesRunOut waits until no lease on s's table is live.
func awaitLeasesRunOut(t *testing.T, s *Storage) {
	t.Helper()
	waitFor(t, 10*time.Second, "the leases to run out", func() bool {
		var live bool
		must(t, s.pool.QueryRow(t.Context(), "SELECT EXISTS (SELECT 1 FROM "+s.leases+" WHERE leased_until > clock_timestamp())").Scan(&live))
		return !live
	})
}

// claimTwice returns the ids two claims of up to 10 records as worker "v"
// hand out: after a parking claim the next one can be lean, which takes a
// head set free without the rows parked behind it.
func claimTwice(t *testing.T, s *Storage) []int64 {
	t.Helper()
	got := idsOf(claim(t, s, "v", 10, time.Minute))
	return append(got, idsOf(claim(t, s, "v", 10, time.Minute))...)
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
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, head), WorkerID: "w"}))
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
	ackIn(t, tx, s, []int64{head}, "w")
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
	go func() { done <- s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, head), WorkerID: "w"}) }()
	awaitLockWait(t, s) // the ack waits for the lease the claim locked
	must(t, tx.Commit(ctx))
	must(t, <-done)
	if got := idsOf(claim(t, s, "v", 10, time.Minute)); !slices.Equal(got, []int64{behind}) {
		t.Fatalf("claimed %v after the ack of %d, want %d (hold %q)", got, head, behind, holdOf(t, s, behind))
	}
}

// TestNoParkingBetweenRecordsInFlight: records e1, e2, e3 of key k are in
// flight; the worker gives e2 back (a nack due now, or a release) and keeps
// e1 and e3. A claim parks behind records in flight only the rows after the
// last of them (p), never e2: the ack of e1 and e3 sets free the first held
// row after e3, and would pass e2, which would then hold p back with
// nothing left to set it free until the sweep (a review found it).
func TestNoParkingBetweenRecordsInFlight(t *testing.T) {
	t.Parallel()
	for _, op := range []string{"nack", "release"} {
		t.Run(op, func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			s := newStore(t, Config{})
			s.nextSweep.Store(time.Now().Add(time.Hour).UnixNano())
			s.parkFlightMin = 1
			ids := insert(t, s, rec("k"), rec("k"), rec("k"))
			e1, e2, e3 := ids[0], ids[1], ids[2]
			if got := idsOf(claim(t, s, "w", 10, time.Minute)); !slices.Equal(got, ids) {
				t.Fatalf("claimed %v, want %v", got, ids)
			}
			p := insert(t, s, rec("k"))[0]
			if op == "nack" {
				must(t, s.Nack(ctx, storage.NackParams{Record: liveRef(t, s, e2), WorkerID: "w", Error: "x", RetryAt: time.Now()}))
			} else {
				must(t, s.Release(ctx, storage.ReleaseParams{Records: liveRefs(t, s, e2), WorkerID: "w", RetryAt: time.Now()}))
			}
			s.walkedFar.Store(true)
			if got := claim(t, s, "v", 10, time.Minute); len(got) != 0 {
				t.Fatalf("claimed %v while %d and %d are in flight", idsOf(got), e1, e3)
			}
			if h, hp := holdOf(t, s, e2), holdOf(t, s, p); h != "" || hp != "behind" {
				t.Fatalf("holds %q (%d, between records in flight) and %q (%d, after them), want none and behind", h, e2, hp, p)
			}
			must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, e1, e3), WorkerID: "w"}))
			got := claimTwice(t, s) // the first claim may take e2 alone: it is lean
			if !slices.Equal(got, []int64{e2, p}) {
				t.Fatalf("claimed %v with nothing of k in flight, want [%d %d]", got, e2, p)
			}
		})
	}
}

// TestNoParkingOfRowsWhoseLeaseRanOut: rows whose lease ran out and that
// nobody took over yet are not parked behind another worker's record in
// flight: their owner's late ack locks only their leases, and could read
// what to set free before the parking claim commits (a review stranded a
// row that way). The row after them is parked, and the ack of the record in
// flight sets it free.
func TestNoParkingOfRowsWhoseLeaseRanOut(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	s.nextSweep.Store(time.Now().Add(time.Hour).UnixNano())
	s.parkFlightMin = 1
	ids := insert(t, s, rec("k"), rec("k"), rec("k"))
	a, b, c := ids[0], ids[1], ids[2]
	if got := idsOf(claim(t, s, "w1", 10, 100*time.Millisecond)); !slices.Equal(got, ids) {
		t.Fatalf("w1 claimed %v, want %v", got, ids)
	}
	awaitLeasesRunOut(t, s)
	if got := idsOf(claim(t, s, "w2", 1, time.Minute)); !slices.Equal(got, []int64{a}) {
		t.Fatalf("w2 claimed %v, want %d (a takeover)", got, a)
	}
	d := insert(t, s, rec("k"))[0]
	s.walkedFar.Store(true)
	if got := claim(t, s, "v", 10, time.Minute); len(got) != 0 {
		t.Fatalf("claimed %v while %d is in flight", idsOf(got), a)
	}
	if hb, hc, hd := holdOf(t, s, b), holdOf(t, s, c), holdOf(t, s, d); hb != "" || hc != "" || hd != "behind" {
		t.Fatalf("holds %q, %q (leases ran out), %q (no lease), want none, none, behind", hb, hc, hd)
	}
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, a), WorkerID: "w2"}))
	got := claimTwice(t, s) // the first claim may take b and c alone: it is lean
	if !slices.Equal(got, []int64{b, c, d}) {
		t.Fatalf("claimed %v after the ack of %d, want [%d %d %d]", got, a, b, c, d)
	}
}

// TestParkingWaitsForLateAcksOfItsKey: records taken along behind their
// head stay parked while in flight; their lease runs out, another worker
// takes over the head and the first of them, and their first owner's late
// ack of the rest is under way when a claim parks the key's backlog behind
// them. The claim waits for that ack (it locks every lease of the key,
// live or run out), so the ack of the records taken over then sets the
// backlog free. Without the wait, the late ack read what to set free before
// the parking, the other ack found the late ack's rows locked and skipped
// them, and the backlog stayed parked until the sweep (a review).
func TestParkingWaitsForLateAcksOfItsKey(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	s.nextSweep.Store(time.Now().Add(time.Hour).UnixNano())
	ids := parkBehindHead(t, s, "k", 5)
	if got := idsOf(claim(t, s, "b", 10, 100*time.Millisecond)); !slices.Equal(got, ids) {
		t.Fatalf("b claimed %v, want %v", got, ids)
	}
	awaitLeasesRunOut(t, s)
	if got := idsOf(claim(t, s, "c", 2, time.Minute)); !slices.Equal(got, ids[:2]) {
		t.Fatalf("c claimed %v, want %v (a takeover)", got, ids[:2])
	}
	backlog := insert(t, s, rec("k"), rec("k"), rec("k"))
	s.parkFlightMin = 1
	tx, err := s.pool.Begin(ctx)
	must(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // committed below
	// b's late ack, not committed yet.
	ackIn(t, tx, s, ids[2:], "b")
	s.walkedFar.Store(true)
	done := claimAsync(ctx, s)
	awaitLockWait(t, s) // the parking claim waits for b's leases
	must(t, tx.Commit(ctx))
	if r := <-done; r.err != nil || len(r.recs) != 0 {
		t.Fatalf("claim beside the late ack: %v, %v; want nothing (%v are in flight)", idsOf(r.recs), r.err, ids[:2])
	}
	if h := holdOf(t, s, backlog[0]); h != "behind" {
		t.Fatalf("record %d has hold %q behind records in flight, want behind", backlog[0], h)
	}
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[:2]...), WorkerID: "c"}))
	got := claimTwice(t, s) // the first claim may take the first row alone: it is lean
	if !slices.Equal(got, backlog) {
		t.Fatalf("claimed %v after every ack, want %v", got, backlog)
	}
}

// TestNoParkingBelowARecordInFlight: no statement parks a row below a
// record of its key in flight, whichever parks it (a nack behind its record,
// a release behind a record waiting for its retry, a claim behind one). The
// ack of records on both sides of such a row sets free the first held row
// after the highest of them, and would pass it: here r0 waits for its retry
// while r1, r2 and r4 are in flight (taken along behind r0 before its second
// nack) and r3, between them, is set back. r0's ack sets free r1, parked
// while in flight; the ack of r1, r2 and r4 sets free r5; had r3 been
// parked, nothing would set it free but the sweep, and it would hold r5 and
// r6 back (the stress test found it).
func TestNoParkingBelowARecordInFlight(t *testing.T) {
	t.Parallel()
	for _, by := range []string{"nack", "release", "claim"} {
		t.Run(by, func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			s := newStore(t, Config{})
			s.nextSweep.Store(time.Now().Add(time.Hour).UnixNano())
			r := parkBehindHead(t, s, "k", 7)
			if got := idsOf(claim(t, s, "w", 5, time.Minute)); !slices.Equal(got, r[:5]) {
				t.Fatalf("claimed %v, want %v (the head and the rows parked behind it)", got, r[:5])
			}
			nack := func(id int64, due time.Time) {
				t.Helper()
				must(t, s.Nack(ctx, storage.NackParams{Record: liveRef(t, s, id), WorkerID: "w", Error: "x", RetryAt: due}))
			}
			due := time.Now().Add(time.Hour) // made due below, by hand
			switch by {
			case "nack": // r0's nack parks the rows behind it
				nack(r[3], time.Now())
				nack(r[0], due)
			case "release": // released behind r0, which waits for its retry
				nack(r[0], due)
				must(t, s.Release(ctx, storage.ReleaseParams{Records: liveRefs(t, s, r[3]), WorkerID: "w", RetryAt: time.Now()}))
			case "claim": // the claim parks the rows held back that it passes
				nack(r[0], due)
				nack(r[3], time.Now())
				if got := claim(t, s, "v", 10, time.Minute); len(got) != 0 {
					t.Fatalf("claimed %v while %d waits for its retry", idsOf(got), r[0])
				}
			}
			if h := holdOf(t, s, r[3]); h != "" {
				t.Fatalf("record %d has hold %q below %d in flight, want none", r[3], h, r[4])
			}
			_, err := s.pool.Exec(ctx, fmt.Sprintf(`UPDATE %s SET due_at = now() WHERE id = $1`, s.table), r[0])
			must(t, err)
			if got := claimTwice(t, s); !slices.Equal(got, r[:1]) {
				t.Fatalf("claimed %v once the retry is due, want %d", got, r[0])
			}
			must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, r[:1]...), WorkerID: "v"}))
			must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, r[1], r[2], r[4]), WorkerID: "w"}))
			if got, want := claimTwice(t, s), []int64{r[3], r[5], r[6]}; !slices.Equal(got, want) {
				t.Fatalf("claimed %v with nothing of the key in flight, want %v", got, want)
			}
		})
	}
}

// TestParkMoreParksNothingBelowALease: the later statements of a nack's
// parking (parkMore, a transaction each) park nothing below a lease of the
// key taken meanwhile. The nack of h parks its first parkChunk rows (up to
// last); before the next statement, h's retry comes due, a claim takes h
// and every row parked behind it up to l, x (between last and l) is
// released, and h is nacked again. parkMore must not park x: the acks of h
// and of the rest up to l would pass it (a review found it).
func TestParkMoreParksNothingBelowALease(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	s.nextSweep.Store(time.Now().Add(time.Hour).UnixNano())
	in := make([]storage.Record, parkChunk+4)
	for i := range in {
		in[i] = rec("k")
	}
	ids := insert(t, s, in...)
	h, last, x, l, tail := ids[0], ids[parkChunk], ids[parkChunk+1], ids[parkChunk+2], ids[parkChunk+3]
	if got := idsOf(claim(t, s, "w", 1, time.Minute)); !slices.Equal(got, ids[:1]) {
		t.Fatalf("claimed %v, want %d", got, h)
	}
	// dueNow makes h's retry due at once (its nack asked for an hour).
	dueNow := func() {
		t.Helper()
		_, err := s.pool.Exec(ctx, fmt.Sprintf(`UPDATE %s SET due_at = now() WHERE id = $1`, s.table), h)
		must(t, err)
	}
	// The first statement of Nack, whose loop then runs parkMore.
	found, l1, holds, key, err := s.park(ctx, s.q.nack, h, "w", "x", time.Now().Add(time.Hour), liveRef(t, s, h).Attempt)
	s.nothingHeld.Store(false) // as Nack does
	must(t, err)
	if found != parkChunk || l1 != last || !holds || key != "k" {
		t.Fatalf("nack: found %d, last %d, holds %v, key %q; want %d, %d, true, k", found, l1, holds, key, parkChunk, last)
	}
	if got := claim(t, s, "v", 10, time.Minute); len(got) != 0 { // parks x, l and tail behind h
		t.Fatalf("claimed %v while %d waits for its retry", idsOf(got), h)
	}
	dueNow()
	if got := idsOf(claim(t, s, "c", parkChunk+3, time.Minute)); !slices.Equal(got, ids[:parkChunk+3]) {
		t.Fatalf("claimed %d rows, want h and the %d rows parked behind it", len(got), parkChunk+2)
	}
	must(t, s.Release(ctx, storage.ReleaseParams{Records: liveRefs(t, s, x), WorkerID: "c", RetryAt: time.Now()}))
	must(t, s.Nack(ctx, storage.NackParams{Record: liveRef(t, s, h), WorkerID: "c", Error: "x", RetryAt: time.Now().Add(time.Hour)}))
	_, _, _, _, err = s.park(ctx, s.q.parkMore, "k", last, h)
	must(t, err)
	if hx := holdOf(t, s, x); hx != "" {
		t.Fatalf("parkMore parked %d (hold %q) below %d, which is in flight", x, hx, l)
	}
	dueNow()
	if got := idsOf(claim(t, s, "d", 10, time.Minute)); !slices.Equal(got, ids[:1]) {
		t.Fatalf("claimed %v once the retry is due, want %d", got, h)
	}
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[:1]...), WorkerID: "d"}))
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, append(slices.Clone(ids[1:parkChunk+1]), l)...), WorkerID: "c"}))
	if got, want := claimTwice(t, s), []int64{x, tail}; !slices.Equal(got, want) {
		t.Fatalf("claimed %v with nothing of the key in flight, want %v", got, want)
	}
}
