package postgres

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

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
	must(t, s.Nack(ctx, storage.NackParams{Record: liveRef(t, s, e), WorkerID: "w", Error: "boom", RetryAt: time.Now().Add(-time.Second)}))
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
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, e), WorkerID: "w"}))
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
	err = s.DeadLetter(short, storage.DeadLetterParams{Record: liveRef(t, s, id), WorkerID: "w", Error: "poison"})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("DeadLetter while the claim lock is held returned %v, want it to wait for the lock", err)
	}
}

// parkBehindHead inserts n records of key, claims the first and nacks it
// for a retry due in a moment, so that the rest are parked behind it, and
// waits until the retry is due. It returns the ids in order.
func parkBehindHead(t *testing.T, s *Storage, key string, n int) []int64 {
	t.Helper()
	var in []storage.Record
	for range n {
		in = append(in, rec(key))
	}
	ids := insert(t, s, in...)
	if got := idsOf(claim(t, s, "w", 1, time.Minute)); !slices.Equal(got, ids[:1]) {
		t.Fatalf("claimed %v, want the head %d", got, ids[0])
	}
	due := time.Now().Add(300 * time.Millisecond)
	must(t, s.Nack(t.Context(), storage.NackParams{Record: liveRef(t, s, ids[0]), WorkerID: "w", Error: "down", RetryAt: due}))
	for _, id := range ids[1:] {
		if h := holdOf(t, s, id); h != "behind" {
			t.Fatalf("record %d has hold %q after its head's nack, want behind", id, h)
		}
	}
	time.Sleep(time.Until(due) + 10*time.Millisecond)
	return ids
}

// countHold counts the pending rows of key whose hold is h ("" for none).
func countHold(t *testing.T, s *Storage, key, h string) int {
	t.Helper()
	var n int
	must(t, s.pool.QueryRow(t.Context(), fmt.Sprintf(`SELECT count(*) FROM %s WHERE status = 'pending' AND key = $1 AND COALESCE(hold, '') = $2`, s.table), key, h).Scan(&n))
	return n
}

// TestClaimTakesParkedRowsWithTheirHead: once a key's head is due again, a
// claim hands out the rows parked behind it with it, in order, and an ack
// sets free only the next parked row, not every row of the key: after an
// outage each row is written once more (parked), not twice.
func TestClaimTakesParkedRowsWithTheirHead(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	ids := parkBehindHead(t, s, "k", 250)
	got := idsOf(claim(t, s, "w", 100, time.Minute))
	if !slices.Equal(got, ids[:100]) {
		t.Fatalf("claimed %d rows %v..., want the head and the 99 rows parked behind it", len(got), got[:min(len(got), 5)])
	}
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, got...), WorkerID: "w"}))
	if n := countHold(t, s, "k", ""); n != 1 {
		t.Fatalf("%d rows of the key set free by the ack, want 1 (the next; the claim takes the rest with it)", n)
	}
	if h := holdOf(t, s, ids[100]); h != "" {
		t.Fatalf("the next row %d has hold %q after the ack, want none", ids[100], h)
	}
	var delivered []int64
	for len(delivered) < 150 {
		got := idsOf(claim(t, s, "w", 100, time.Minute))
		if len(got) == 0 {
			t.Fatalf("claimed nothing with %d rows of the key left", 150-len(delivered))
		}
		must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, got...), WorkerID: "w"}))
		delivered = append(delivered, got...)
	}
	if !slices.Equal(delivered, ids[100:]) {
		t.Fatalf("delivered %v, want the rest in id order", delivered)
	}
}

// TestNoParkingBehindRowsInFlight: rows taken along behind their head stay
// parked while in flight, and a row that arrives behind them is not parked
// behind them by a claim that is not told that walks span far (see
// flight_test.go for one that is).
func TestNoParkingBehindRowsInFlight(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	ids := parkBehindHead(t, s, "k", 5)
	if got := idsOf(claim(t, s, "w", 10, time.Minute)); !slices.Equal(got, ids) {
		t.Fatalf("claimed %v, want %v", got, ids)
	}
	late := insert(t, s, rec("k"))[0]
	if got := claim(t, s, "w", 10, time.Minute); len(got) != 0 {
		t.Fatalf("claimed %v while the earlier rows of its key are in flight", idsOf(got))
	}
	if h := holdOf(t, s, late); h != "" {
		t.Fatalf("record %d has hold %q behind rows in flight, want none", late, h)
	}
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids...), WorkerID: "w"}))
	if got := idsOf(claim(t, s, "w", 10, time.Minute)); !slices.Equal(got, []int64{late}) {
		t.Fatalf("claimed %v after the ack, want %d", got, late)
	}
}

// TestFollowersStopAtARowNotParked: the rows taken along behind a key's
// last walked row stop at the first row that is not parked, even when
// parked rows come after it (here a row the walk did not reach because the
// batch was full).
func TestFollowersStopAtARowNotParked(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	ids := insert(t, s, rec("k"), rec(""), rec(""), rec("k"), rec("k"))
	_, err := s.pool.Exec(t.Context(), fmt.Sprintf(`UPDATE %s SET hold = 'behind' WHERE id = $1`, s.table), ids[4])
	must(t, err)
	if got := idsOf(claim(t, s, "w", 3, time.Minute)); !slices.Equal(got, ids[:3]) {
		t.Fatalf("claimed %v, want %v (the parked row %d waits for %d)", got, ids[:3], ids[4], ids[3])
	}
}

// awaitLockWait waits until a statement on s's table waits for a lock.
func awaitLockWait(t *testing.T, s *Storage) {
	t.Helper()
	waitFor(t, 30*time.Second, "a statement waiting for a lock", func() bool { return lockWaiters(t, s) > 0 })
}

// lockWaiters counts the statements on s's tables that wait for a lock. It
// looks for the name of the schema, which each test has its own of: the
// server shows a statement's first 1024 bytes only, which need not name the
// outbox table.
func lockWaiters(t *testing.T, s *Storage) int {
	t.Helper()
	var n int
	must(t, s.pool.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND position($1 in query) > 0`, s.ident[0]).Scan(&n))
	return n
}

// claimAfterExpiry parks n records of key k behind their head, claims them
// all with a lease that then runs out (nobody takes it over), and returns
// their ids.
func claimAfterExpiry(t *testing.T, s *Storage, n int) []int64 {
	t.Helper()
	ids := parkBehindHead(t, s, "k", n)
	if got := idsOf(claim(t, s, "w", 10, 100*time.Millisecond)); !slices.Equal(got, ids) {
		t.Fatalf("claimed %v, want %v", got, ids)
	}
	time.Sleep(200 * time.Millisecond)
	return ids
}

// TestLateAckRacingAClaimStrandsNothing: the owner of rows whose lease ran
// out still acks them (an ack is fenced on the owner only, and takes no
// lock) while a claim runs. The claim must not park a new row of the key
// behind them: the ack, which looked before the claim committed, would not
// set it free, and nothing else would until the sweep.
func TestLateAckRacingAClaimStrandsNothing(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	ids := claimAfterExpiry(t, s, 5)
	late := insert(t, s, rec("k"))[0]
	tx, err := s.pool.Begin(ctx)
	must(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // committed below
	ackIn(t, tx, s, ids, "w")
	done := make(chan error, 1)
	go func() {
		// The same worker: its own key slots hold the key (a claim parks
		// in its own slots only).
		_, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 10, Lease: time.Minute, WorkerID: "w"})
		done <- err
	}()
	awaitLockWait(t, s) // the claim's takeover waits for the ack's leases
	must(t, tx.Commit(ctx))
	must(t, <-done)
	if got := idsOf(claim(t, s, "w", 10, time.Minute)); !slices.Equal(got, []int64{late}) {
		t.Fatalf("claimed %v after the ack of %v, want %d (hold %q)", got, ids, late, holdOf(t, s, late))
	}
}

// TestReleaseRacingAnAckStrandsNothing: a forwarder releases the untried
// rest of a group whose lease ran out while its ack of the front is in
// flight. The release must not park the rest behind the rows being acked.
func TestReleaseRacingAnAckStrandsNothing(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	ids := claimAfterExpiry(t, s, 6)
	tx, err := s.pool.Begin(ctx)
	must(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // committed below
	ackIn(t, tx, s, ids[:2], "w")
	done := make(chan error, 1)
	go func() {
		done <- s.Release(ctx, storage.ReleaseParams{Records: liveRefs(t, s, ids[2:]...), WorkerID: "w", RetryAt: time.Now()})
	}()
	awaitLockWait(t, s) // the release waits for the row the ack set free
	must(t, tx.Commit(ctx))
	must(t, <-done)
	if got := idsOf(claim(t, s, "w", 10, time.Minute)); !slices.Equal(got, ids[2:]) {
		t.Fatalf("claimed %v, want the released rows %v (holds %q ...)", got, ids[2:], holdOf(t, s, ids[2]))
	}
}

// TestExtendIsAllOrNone: the leases an Extend call asks for, which ran out
// together, are extended all or none, whenever they run out during the
// statement: extending the first records of a key and not the later ones
// would let a claim take the later ones over while the first is leased.
func TestExtendIsAllOrNone(t *testing.T) {
	if testing.Short() {
		t.Skip("extends 50 thousand leases a few times")
	}
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	const n = 50000
	_, err := s.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (id, key, leased_by, leased_until, attempts)
SELECT g, 'k', 'w', clock_timestamp() + interval '1 hour', 1 FROM generate_series(1, $1) g`, s.leases), n)
	must(t, err)
	ids := make([]int64, n)
	for i := range ids {
		ids[i] = int64(i + 1)
	}
	setUntil := func(until time.Time) {
		_, err := s.pool.Exec(ctx, fmt.Sprintf(`UPDATE %s SET leased_until = $1`, s.leases), until)
		must(t, err)
	}
	start := time.Now()
	setUntil(time.Now().Add(time.Hour))
	u := time.Since(start) // how long setting the leases takes
	start = time.Now()
	got, err := s.Extend(ctx, storage.ExtendParams{Records: liveRefs(t, s, ids...), WorkerID: "w", Lease: time.Hour})
	must(t, err)
	d := time.Since(start) // how long an Extend of them takes
	if len(got) != n {
		t.Fatalf("extended %d live leases, want %d", len(got), n)
	}
	// The leases run out at instants spread over the next Extend's run.
	for i := range 12 {
		setUntil(time.Now().Add(u + d*time.Duration(i)/8))
		got, err := s.Extend(ctx, storage.ExtendParams{Records: liveRefs(t, s, ids...), WorkerID: "w", Lease: time.Hour})
		must(t, err)
		if len(got) != 0 && len(got) != n {
			t.Fatalf("try %d: extended %d of %d leases that ran out together, want all or none", i, len(got), n)
		}
	}
}

// TestHeldProbeReadsBackwards: the claim's check for an earlier held row
// of a candidate's key reads the held index backwards from the candidate,
// so that it finds the nearest one at once: read forwards it passed every
// held entry of the key before the candidate, at every claim.
func TestHeldProbeReadsBackwards(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	parkBehindHead(t, s, "k", 50)
	insert(t, s, recs("a", "b", "c")...)
	plan := explainClaim(t, s, 10, false)
	if !regexp.MustCompile(`Index Only Scan Backward using \S+held_idx`).MatchString(plan) {
		t.Fatalf("the held probe does not read the held index backwards:\n%s", plan)
	}
}

// TestClaimAfterAnOutageWalksOnlyTheLeadingHeads: after an outage every
// key's head is free again and the rest of its rows are parked. A claim
// hands out the heads of the first keys of its walk with the rows parked
// behind them, and its walk (the CTE c) reads the first leadRows heads only,
// not a whole batch of heads that the batch has no room for.
func TestClaimAfterAnOutageWalksOnlyTheLeadingHeads(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	const keys, perKey, batch = 200, 21, 100
	var order []string
	for i := range keys * perKey {
		order = append(order, fmt.Sprintf("k%d", i%keys))
	}
	outageTable(t, s, order)

	if walked := claimWalkRows(t, s, batch); walked > leadRows {
		t.Errorf("the claim's walk read %d rows, want at most %d (the heads whose parked rows fill the batch)", walked, leadRows)
	}
	got := claim(t, s, "w", batch, time.Minute)
	if len(got) != batch {
		t.Fatalf("claimed %d rows, want %d", len(got), batch)
	}
	// Every key handed out goes from its head on, its rows in id order.
	var heads []int64
	must(t, s.pool.QueryRow(ctx, fmt.Sprintf(`SELECT array_agg(id) FROM %s WHERE hold IS NULL`, s.table)).Scan(&heads))
	next := map[string]int64{}
	for _, r := range got {
		want, seen := next[r.Key]
		if !seen && !slices.Contains(heads, r.ID) {
			t.Fatalf("row %d of key %s handed out without its head", r.ID, r.Key)
		}
		if seen && r.ID <= want {
			t.Fatalf("row %d of key %s after row %d", r.ID, r.Key, want)
		}
		next[r.Key] = r.ID
	}
	if len(next) > runKeys {
		t.Errorf("the batch holds %d keys, want at most %d", len(next), runKeys)
	}
}

// claimWalkRows runs the claim under EXPLAIN ANALYZE (rolled back) and
// returns how many rows its walk, the CTE c, produced.
func claimWalkRows(t *testing.T, s *Storage, batch int) int {
	t.Helper()
	out := explainClaimAs(t, s, s.q.claim, batch, "EXPLAIN (ANALYZE, FORMAT JSON) ")
	var plans []struct{ Plan planNode }
	must(t, json.Unmarshal([]byte(out), &plans))
	var find func(n planNode) int
	find = func(n planNode) int {
		if n.SubplanName == "CTE c" {
			return n.ActualRows
		}
		for _, c := range n.Plans {
			if r := find(c); r >= 0 {
				return r
			}
		}
		return -1
	}
	rows := find(plans[0].Plan)
	if rows < 0 {
		t.Fatalf("no CTE c in the claim's plan:\n%s", out)
	}
	return rows
}

// planNode is a node of EXPLAIN (FORMAT JSON).
type planNode struct {
	NodeType    string     `json:"Node Type"`
	SubplanName string     `json:"Subplan Name"`
	IndexName   string     `json:"Index Name"`
	IndexCond   string     `json:"Index Cond"`
	Filter      string     `json:"Filter"`
	ActualRows  int        `json:"Actual Rows"`
	Plans       []planNode `json:"Plans"`
}

// TestHoldWritesFindRowsByPrimaryKey: the statements that hold rows back
// or set them free (the wake, the unpark of an ack, a dead-letter and a
// Skip, the sweep, a Redrive; a claim's and a nack's parking) find the rows
// they lock and update by their primary key, whatever the statistics say. After an outage the statistics are those of
// a table with nothing held, and the wake's UPDATE, whose WHERE also said
// "hold = 'retry'", read the whole retry or held index and checked each
// entry against its ids: one wake took 4.4 s and 1.8 million buffers with
// 200,000 rows parked (txoutbox-bench's outage scenario, auto_explain).
// The unpark and the sweep had the same shape, in their UPDATE and in the
// subquery that locks, and so had an operator's Redrive of dead records by
// id, with the dead-letter indexes. Fails without the change (wake, ack,
// sweep, redrive): rows found by id in a Filter.
func TestHoldWritesFindRowsByPrimaryKey(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	ctx := t.Context()
	// Statistics of a table with nothing held, kept (no autovacuum)...
	_, err := s.pool.Exec(ctx, "ALTER TABLE "+s.table+" SET (autovacuum_enabled = false)")
	must(t, err)
	fill(t, s, 20_000, 20)
	_, err = s.pool.Exec(ctx, "VACUUM ANALYZE "+s.table)
	must(t, err)
	// ...then the outage: every key's head waits for its retry (due now),
	// the rest of each key is parked behind it; a fifth of the keys died.
	_, err = s.pool.Exec(ctx, fmt.Sprintf(`UPDATE %[1]s o SET
    hold = CASE WHEN o.id = (SELECT min(h.id) FROM %[1]s h WHERE h.key = o.key) THEN 'retry' ELSE 'behind' END,
    due_at = now() - interval '1 second'`, s.table))
	must(t, err)
	_, err = s.pool.Exec(ctx, fmt.Sprintf(`UPDATE %s SET status = 'dead', hold = NULL, dead_at = now() WHERE key IN ('k1', 'k2', 'k3', 'k4')`, s.table))
	must(t, err)
	redrive, redriveArgs := s.redriveStatement(storage.RedriveParams{IDs: []int64{21, 41}})
	byID := regexp.MustCompile(`\bid = (ANY|\$)`) // a lookup by id: "id = ANY (...)", "id = $1"

	plan := func(setting, sql string, args ...any) planNode {
		t.Helper()
		tx, err := s.pool.Begin(ctx)
		must(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // test
		_, err = tx.Exec(ctx, setting)
		must(t, err)
		var out string
		must(t, tx.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+sql, args...).Scan(&out))
		var plans []struct{ Plan planNode }
		must(t, json.Unmarshal([]byte(out), &plans))
		return plans[0].Plan
	}
	for name, p := range map[string]planNode{
		"wake":       plan(s.q.plan, s.q.wake),
		"ack":        plan(s.q.writePlan, s.q.ack, []int64{1, 2, 3}, "w", []int{1, 1, 1}),
		"sweep":      plan(s.q.plan, s.q.sweep),
		"claim":      plan(s.q.plan, s.q.claim, claimArgs(s, 100, "w", 1)...),
		"nack":       plan(s.q.writePlan, s.q.nack, int64(1), "w", "boom", time.Now().Add(time.Minute), 1),
		"more":       plan(s.q.writePlan, s.q.parkMore, "k1", int64(1), int64(1)),
		"deadLetter": plan(s.q.writePlan, s.q.deadLetter, int64(1), "w", "boom", 1),
		"skip":       plan(s.q.writePlan, s.skipStatement(), int64(21), "why"),
		"redrive":    plan(s.q.writePlan, redrive, redriveArgs...),
	} {
		var byFilter []string
		byKey := 0
		var walk func(n planNode)
		walk = func(n planNode) {
			if byID.MatchString(n.Filter) {
				byFilter = append(byFilter, fmt.Sprintf("%s %s: %s", n.NodeType, n.IndexName, n.Filter))
			}
			if strings.HasSuffix(n.IndexName, "_pkey") && byID.MatchString(n.IndexCond) {
				byKey++
			}
			for _, c := range n.Plans {
				walk(c)
			}
		}
		walk(p)
		if len(byFilter) > 0 || byKey == 0 {
			t.Errorf("%s: rows found by id in a filter %q, through a primary key %d times: want the primary key only", name, byFilter, byKey)
		}
	}
}

// outageTable inserts rows with the given keys, in that order, and parks
// every keyed row but its key's first, as an outage leaves a table once every
// key's head is due again.
func outageTable(t *testing.T, s *Storage, keys []string) {
	t.Helper()
	ctx := t.Context()
	var in []storage.Record
	for _, k := range keys {
		in = append(in, rec(k))
	}
	insert(t, s, in...)
	_, err := s.pool.Exec(ctx, fmt.Sprintf(`UPDATE %[1]s o SET hold = 'behind'
WHERE o.key <> '' AND o.id > (SELECT min(h.id) FROM %[1]s h WHERE h.key = o.key)`, s.table))
	must(t, err)
	var got []string
	must(t, s.pool.QueryRow(ctx, fmt.Sprintf(`SELECT array_agg(key ORDER BY id) FROM %s`, s.table)).Scan(&got))
	if !slices.Equal(got, keys) {
		t.Fatalf("rows inserted in another order: %v", got)
	}
}

// TestClaimFillsTheBatchPastRowsWithNothingParked: keyless rows, or a key
// with rows free, at the head of the walk do not crowd out the keys with
// parked rows behind them: a claim still takes those keys' rows along and
// fills the batch. (The keys that take rows along once came from the walk's
// first 16 rows only: these claims came back with 21 rows.)
func TestClaimFillsTheBatchPastRowsWithNothingParked(t *testing.T) {
	t.Parallel()
	for _, first := range []string{"", "hot"} {
		t.Run(fmt.Sprintf("first=%q", first), func(t *testing.T) {
			s := newStore(t, Config{})
			var keys []string
			for range runKeys {
				keys = append(keys, first)
			}
			for i := range 5 {
				for range 51 {
					keys = append(keys, fmt.Sprintf("k%d", i))
				}
			}
			outageTable(t, s, keys)
			if first != "" { // the key's rows are free, not parked
				_, err := s.pool.Exec(t.Context(), fmt.Sprintf(`UPDATE %s SET hold = NULL WHERE key = $1`, s.table), first)
				must(t, err)
			}
			if got := claim(t, s, "w", 100, time.Minute); len(got) != 100 {
				t.Errorf("claimed %d rows, want a full batch of 100", len(got))
			}
		})
	}
}

// TestCommitFenceClaimsTheOldestKeysFirst: with CommitFence, a claim after an
// outage takes the keys whose heads are oldest, not those whose names sort
// first (the fence's window over the walk sorts it by key; the claim reads a
// prefix of the walk). Here the oldest head's key sorts last.
func TestCommitFenceClaimsTheOldestKeysFirst(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{CommitFence: true})
	const keys = 200
	var order []string
	for range 21 {
		for i := keys - 1; i >= 0; i-- {
			order = append(order, fmt.Sprintf("k%03d", i))
		}
	}
	outageTable(t, s, order)
	oldest := fmt.Sprintf("k%03d", keys-1)
	// The fence is database-wide: a transaction of another test running
	// meanwhile holds the rows back (all of them: one insert) until it ends.
	var got []storage.Record
	for deadline := time.Now().Add(30 * time.Second); len(got) == 0 && time.Now().Before(deadline); {
		if got = claim(t, s, "w", 100, time.Minute); len(got) == 0 {
			time.Sleep(20 * time.Millisecond)
		}
	}
	if len(got) == 0 || got[0].Key != oldest {
		t.Fatalf("the claim's first key is %v, want %s (its head is the oldest row)", keysOf(got), oldest)
	}
}

// keysOf lists the records' keys, each once, in their order.
func keysOf(recs []storage.Record) []string {
	var keys []string
	for _, r := range recs {
		if !slices.Contains(keys, r.Key) {
			keys = append(keys, r.Key)
		}
	}
	return keys
}

// TestClaimRefreshesItsWorkerRowOnlyWhenDue: a claim writes its worker row
// (key slots) only when its membership no longer reaches from the lease's end
// (memberTTL at least) to half a memberTTL beyond, so that a claim that finds
// nothing writes nothing (and commits without a WAL flush), while a worker
// always counts for its lease, or memberTTL, after its last claim; a row set
// far ahead (a longer lease before) is brought back.
func TestClaimRefreshesItsWorkerRowOnlyWhenDue(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	version := func() (xmin string, left time.Duration) {
		t.Helper()
		var until time.Time
		must(t, s.pool.QueryRow(ctx, fmt.Sprintf(`SELECT xmin::text, seen_until FROM %s WHERE worker_id = 'w'`, s.workers)).Scan(&xmin, &until))
		return xmin, time.Until(until)
	}
	set := func(in string) string {
		t.Helper()
		var xmin string
		must(t, s.pool.QueryRow(ctx, fmt.Sprintf(`UPDATE %s SET seen_until = clock_timestamp() + interval '%s' WHERE worker_id = 'w' RETURNING xmin::text`, s.workers, in)).Scan(&xmin))
		return xmin
	}
	claim(t, s, "w", 10, time.Minute)
	first, left := version()
	if left < time.Minute {
		t.Fatalf("membership for %s, want the lease (a minute) and more", left)
	}
	claim(t, s, "w", 10, time.Minute)
	if again, _ := version(); again != first {
		t.Errorf("an empty claim rewrote its fresh worker row (xmin %s, then %s)", first, again)
	}
	for _, in := range []string{"59 seconds", "1 hour"} {
		old := set(in)
		claim(t, s, "w", 10, time.Minute)
		if again, left := version(); again == old || left < time.Minute || left > time.Minute+memberTTL {
			t.Errorf("membership set to %s: after a claim with a minute's lease, %s left (xmin %s, then %s), want a minute and up to half a memberTTL", in, left, old, again)
		}
	}
}

// blockedBy reports how many sessions wait for a lock that the session pid
// holds.
func blockedBy(t *testing.T, s *Storage, pid int32) int {
	t.Helper()
	var n int
	must(t, s.pool.QueryRow(t.Context(), "SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))", pid).Scan(&n))
	return n
}

// backendPID is the server process of tx's session.
func backendPID(t *testing.T, tx pgx.Tx) int32 {
	t.Helper()
	var pid int32
	must(t, tx.QueryRow(t.Context(), "SELECT pg_backend_pid()").Scan(&pid))
	return pid
}

// claimResult is what a Claim run by claimAsync returned.
type claimResult struct {
	recs []storage.Record
	err  error
}

// claimAsync runs a claim of up to 10 records as worker "y" in the
// background.
func claimAsync(ctx context.Context, s *Storage) <-chan claimResult {
	done := make(chan claimResult, 1)
	go func() {
		recs, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 10, Lease: time.Minute, WorkerID: "y"})
		done <- claimResult{recs, err}
	}()
	return done
}

// lockRow locks the row id of table in a transaction of its own, which the
// test ends (or its cleanup rolls back), and returns it with its session's
// server process.
func lockRow(t *testing.T, s *Storage, table string, id int64) (pgx.Tx, int32) {
	t.Helper()
	ctx := t.Context()
	tx, err := s.pool.Begin(ctx)
	must(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.WithoutCancel(ctx)) })
	_, err = tx.Exec(ctx, "SELECT 1 FROM "+table+" WHERE id = $1 FOR UPDATE", id)
	must(t, err)
	return tx, backendPID(t, tx)
}

// claimNotWaitingFor runs a claim (claimAsync) and returns what it
// returned, failing the test with why if it waits for a lock held by the
// session pid.
func claimNotWaitingFor(t *testing.T, s *Storage, pid int32, why string) claimResult {
	t.Helper()
	var r claimResult
	must(t, notWaitingFor(t, s, pid, why, func(ctx context.Context) error {
		r = <-claimAsync(ctx, s)
		return r.err
	}))
	return r
}

// TestParkingSkipsLockedRows: a claim never waits for an outbox row it would
// park that another transaction holds; it leaves the row unparked. A review
// found the claim deadlocking that way with a late ack of a forwarder whose
// leases ran out: the ack had deleted lease p and waited for outbox row p
// (here held by x), then needed lease a, which the claim had taken over,
// while the claim waited for outbox row p to park it.
func TestParkingSkipsLockedRows(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	ids := insert(t, s, rec("k1"), rec("k1"), rec("k2"))
	e, p, a := ids[0], ids[1], ids[2]
	// e waits for its retry, so p (behind it, its lease run out) is to be
	// parked; a's lease ran out, so a is to be taken over.
	_, err := s.pool.Exec(ctx, fmt.Sprintf(`UPDATE %s SET hold = 'retry', due_at = now() + interval '1 hour', last_error = 'x' WHERE id = $1`, s.table), e)
	must(t, err)
	_, err = s.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (id, key, leased_by, leased_until, attempts) VALUES ($1, 'k1', 'w', now() - interval '1 second', 1), ($2, 'k2', 'w', now() - interval '1 second', 1)`, s.leases), p, a)
	must(t, err)
	x, xpid := lockRow(t, s, s.table, p)
	r := claimNotWaitingFor(t, s, xpid, "the claim waits for the outbox row it would park, which another transaction holds")
	if got := idsOf(r.recs); !slices.Equal(got, []int64{a}) {
		t.Errorf("claimed %v, want only %d (taken over; p is held behind e)", got, a)
	}
	if h := holdOf(t, s, p); h != "" {
		t.Errorf("p's hold is %q: a row another transaction held was parked", h)
	}
	must(t, x.Rollback(ctx))
	// A later claim parks it.
	claim(t, s, "y", 10, time.Minute)
	if h := holdOf(t, s, p); h != "behind" {
		t.Errorf("p's hold is %q after the next claim, want behind", h)
	}
}

// TestSweepSkipsLockedRows: a claim's sweep (which sets free a parked row
// that nothing before it holds back) never waits for a row another
// transaction holds, such as an ack deleting a follower that is parked while
// in flight; it leaves the row parked, and a later sweep sets it free. What
// a sweep sets free goes out with the next claim (the sweep runs after the
// claim's statement).
func TestSweepSkipsLockedRows(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	ids := insert(t, s, rec("k1"), rec("k2"))
	p, q := ids[0], ids[1]
	// Parked with nothing before them: what the sweep is for.
	_, err := s.pool.Exec(ctx, fmt.Sprintf(`UPDATE %s SET hold = 'behind' WHERE id = ANY($1)`, s.table), ids)
	must(t, err)
	x, xpid := lockRow(t, s, s.table, p)
	s.nextSweep.Store(0)
	r := claimNotWaitingFor(t, s, xpid, "the sweep waits for a parked row another transaction holds")
	if len(r.recs) != 0 {
		t.Errorf("claimed %v while both rows were parked", idsOf(r.recs))
	}
	if h := holdOf(t, s, p); h != "behind" {
		t.Errorf("p's hold is %q: the sweep changed a row another transaction held", h)
	}
	if h := holdOf(t, s, q); h != "" {
		t.Errorf("q's hold is %q: the sweep did not set it free", h)
	}
	must(t, x.Rollback(ctx))
	s.nextSweep.Store(0)
	if got := idsOf(claim(t, s, "y", 10, time.Minute)); !slices.Equal(got, []int64{q}) {
		t.Errorf("the claim after the sweep took %v, want %d", got, q)
	}
	if got := idsOf(claim(t, s, "y", 10, time.Minute)); !slices.Equal(got, []int64{p}) {
		t.Errorf("the claim after the next sweep took %v, want %d", got, p)
	}
}

// TestSweepLocksNothingWhileTheTakeoverWaits: the sweep runs after the
// claim's statement, so the claim holds no outbox row while its takeover
// waits for a lease. Here a late ack of worker w deleted lease l (run out)
// and waits for lease m; the claim's takeover waits for l; the ack then
// deletes outbox row p, parked and first of its key, which a sweep before
// the takeover had locked: a deadlock (found by review).
func TestSweepLocksNothingWhileTheTakeoverWaits(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	ids := insert(t, s, rec("kA"), rec("kM"), rec("kB"))
	l, m, p := ids[0], ids[1], ids[2]
	_, err := s.pool.Exec(ctx, fmt.Sprintf(`UPDATE %s SET hold = 'behind' WHERE id = $1`, s.table), p)
	must(t, err)
	_, err = s.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (id, key, leased_by, leased_until, attempts) VALUES
 ($1, 'kA', 'w', now() - interval '1 second', 1), ($2, 'kM', 'w', now() + interval '1 hour', 1), ($3, 'kB', 'w', now() + interval '1 hour', 1)`, s.leases), l, m, p)
	must(t, err)
	x, xpid := lockRow(t, s, s.leases, m)
	ackDone := make(chan error, 1)
	go func() { ackDone <- s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, l, m, p), WorkerID: "w"}) }()
	var ackPID int32
	waitFor(t, 30*time.Second, "the ack to wait for lease m", func() bool {
		err := s.pool.QueryRow(ctx, "SELECT pid FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))", xpid).Scan(&ackPID)
		return err == nil
	})
	s.nextSweep.Store(0)
	done := claimAsync(ctx, s)
	waitFor(t, 30*time.Second, "the claim's takeover to wait for lease l", func() bool { return blockedBy(t, s, ackPID) > 0 })
	must(t, x.Rollback(ctx))
	r := <-done
	must(t, r.err)
	must(t, <-ackDone)
}

// TestTakeoverLostToAnExtensionTakesNothingBehindIt: a claim whose snapshot
// shows m's lease run out, while its owner extends it (the extension's clock
// read before the lease ran out, its commit after the claim's snapshot),
// takes over neither m nor m2, the next record of m's key: m's owner is still
// publishing m. Before, the claim skipped m and handed out m2 beside it.
func TestTakeoverLostToAnExtensionTakesNothingBehindIt(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	ids := insert(t, s, rec("K"), rec("K"), rec("other"))
	m, other := ids[0], ids[2]
	_, err := s.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (id, key, leased_by, leased_until, attempts) VALUES ($1, 'K', 'w', now() - interval '1 second', 1)`, s.leases), m)
	must(t, err)
	// What Extend writes when its clock was read just before the lease ran
	// out; committed once the claim waits for it.
	ext, err := s.pool.Begin(ctx)
	must(t, err)
	defer ext.Rollback(ctx) //nolint:errcheck // committed below; a no-op then
	_, err = ext.Exec(ctx, fmt.Sprintf(`UPDATE %s SET leased_until = now() + interval '1 hour' WHERE id = $1`, s.leases), m)
	must(t, err)
	pid := backendPID(t, ext)
	done := claimAsync(ctx, s)
	waitingFor(t, s, pid, "the claim to wait for the extension of m", done)
	must(t, ext.Commit(ctx))
	var r claimResult
	select {
	case r = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the claim did not finish once the extension committed")
	}
	must(t, r.err)
	if got := idsOf(r.recs); !slices.Equal(got, []int64{other}) {
		t.Errorf("claimed %v while m (%d) is still leased by its owner, want only %d (another key)", got, m, other)
	}
}

// notWaitingFor runs run and fails the test (with why) if it waits for the
// backend pid meanwhile; it returns run's error.
func notWaitingFor(t *testing.T, s *Storage, pid int32, why string, run func(context.Context) error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- run(t.Context()) }()
	var err error
	waitFor(t, 30*time.Second, "the statement", func() bool {
		select {
		case err = <-done:
			return true
		default:
		}
		if blockedBy(t, s, pid) > 0 {
			t.Fatal(why)
		}
		return false
	})
	return err
}

// waitingFor waits until a statement waits for a lock held by the backend
// pid, failing the test if the statement ends first (done delivers): it did
// not wait.
func waitingFor[T any](t *testing.T, s *Storage, pid int32, what string, done <-chan T) {
	t.Helper()
	waitFor(t, 30*time.Second, what, func() bool {
		select {
		case v := <-done:
			t.Fatalf("waiting for %s: the statement ended without waiting: %v", what, v)
		default:
		}
		return blockedBy(t, s, pid) > 0
	})
}

// TestUnparkSkipsLockedRows: an ack sets free the row parked behind what it
// delivered, and skips it, without waiting, when another transaction holds
// it (that transaction delivers it, parks it again or sets it free itself;
// the sweep sets free what is left parked). Only write-backs wait for
// outbox rows, and only for their own (see fenced in buildQueries).
func TestUnparkSkipsLockedRows(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	ids := insert(t, s, rec("k"), rec("k"), rec("k"))
	h, f1, f2 := ids[0], ids[1], ids[2]
	if got := idsOf(claim(t, s, "w", 1, time.Minute)); !slices.Equal(got, []int64{h}) {
		t.Fatalf("claimed %v, want [%d]", got, h)
	}
	_, err := s.pool.Exec(ctx, fmt.Sprintf(`UPDATE %s SET hold = 'behind' WHERE id = ANY($1)`, s.table), []int64{f1, f2})
	must(t, err)
	x, xpid := lockRow(t, s, s.table, f1)
	must(t, notWaitingFor(t, s, xpid, "the ack's unpark waits for a parked row another transaction holds", func(ctx context.Context) error {
		return s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, h), WorkerID: "w"})
	}))
	if hd := holdOf(t, s, f1); hd != "behind" {
		t.Errorf("f1's hold is %q: the unpark changed a row another transaction held", hd)
	}
	must(t, x.Rollback(ctx))
	s.nextSweep.Store(0)
	if got := claim(t, s, "y", 10, time.Minute); len(got) != 0 {
		t.Fatalf("claimed %v while the key's rows were parked", idsOf(got))
	}
	if got := idsOf(claim(t, s, "y", 10, time.Minute)); !slices.Equal(got, []int64{f1, f2}) {
		t.Errorf("the claim after the sweep took %v, want %v", got, []int64{f1, f2})
	}
}

// TestNackParkingSkipsLockedRows: a nack parks the rows behind its record
// that it can lock, and skips, without waiting, one that another
// transaction holds; the claims hold that row back all the same, and the
// first that meets it parks it.
func TestNackParkingSkipsLockedRows(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	ids := insert(t, s, rec("k"), rec("k"), rec("k"))
	h, r1, r2 := ids[0], ids[1], ids[2]
	if got := idsOf(claim(t, s, "w", 1, time.Minute)); !slices.Equal(got, []int64{h}) {
		t.Fatalf("claimed %v, want [%d]", got, h)
	}
	x, xpid := lockRow(t, s, s.table, r1)
	must(t, notWaitingFor(t, s, xpid, "the nack's parking waits for a row another transaction holds", func(ctx context.Context) error {
		return s.Nack(ctx, storage.NackParams{Record: liveRef(t, s, h), WorkerID: "w", Error: "boom", RetryAt: time.Now().Add(time.Hour)})
	}))
	if hd := holdOf(t, s, r1); hd != "" {
		t.Errorf("r1's hold is %q: the nack changed a row another transaction held", hd)
	}
	if hd := holdOf(t, s, r2); hd != "behind" {
		t.Errorf("r2's hold is %q, want behind", hd)
	}
	must(t, x.Rollback(ctx))
	if got := claim(t, s, "w", 10, time.Minute); len(got) != 0 {
		t.Fatalf("claimed %v while the key's head waits for its retry", idsOf(got))
	}
	if hd := holdOf(t, s, r1); hd != "behind" {
		t.Errorf("r1's hold is %q after a claim met it, want behind", hd)
	}
}

// TestLateAckAndNackParkingDoNotDeadlock: a former owner's late ack locks
// its outbox rows in the order its lease DELETE returns them (heap order of
// the lease table, here the reverse of id order), while the new owner's
// nack parks the rows behind the record it took over, in id order. Found by
// review: the nack's parking waited for r1, which the ack held, and the
// ack for r2, which the nack held. The nack's parking skips the rows the
// ack holds now.
func TestLateAckAndNackParkingDoNotDeadlock(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := newStore(t, Config{})
	ids := insert(t, s, rec("k"), rec("k"), rec("k"), rec("k"))
	n, r1, rm, r2 := ids[0], ids[1], ids[2], ids[3]
	if got := idsOf(claim(t, s, "w", 10, time.Minute)); !slices.Equal(got, ids) {
		t.Fatalf("w claimed %v", got)
	}
	// The lease table in descending id order, every lease run out.
	_, err := s.pool.Exec(ctx, fmt.Sprintf(`WITH d AS (DELETE FROM %[1]s RETURNING *)
INSERT INTO %[1]s (id, key, leased_by, leased_until, attempts) SELECT id, key, leased_by, now() - interval '1 second', attempts FROM d ORDER BY id DESC`, s.leases))
	must(t, err)
	if got := idsOf(claim(t, s, "y", 1, time.Minute)); !slices.Equal(got, []int64{n}) {
		t.Fatalf("y took over %v, want [%d]", got, n)
	}
	// rm held elsewhere orders the two: the nack's parking reaches r1
	// first (and, before the fix, waited for rm holding r1).
	blocker, _ := lockRow(t, s, s.table, rm)
	nackDone := make(chan error, 1)
	go func() {
		nackDone <- s.Nack(ctx, storage.NackParams{Record: liveRef(t, s, n), WorkerID: "y", Error: "boom", RetryAt: time.Now().Add(time.Hour)})
	}()
	ackDone := make(chan error, 1)
	go func() { ackDone <- s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, n, r1, r2), WorkerID: "w"}) }()
	// Both finish, or (before the fix) both wait: the nack for rm, the ack
	// for r1.
	waitFor(t, 30*time.Second, "the nack and the late ack to finish or wait", func() bool {
		return lockWaiters(t, s) >= 2 || len(nackDone) > 0 && len(ackDone) > 0
	})
	must(t, blocker.Rollback(ctx))
	for name, done := range map[string]chan error{"nack": nackDone, "late ack": ackDone} {
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("%s: %v", name, err)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%s did not finish", name)
		}
	}
	// The late ack delivered the rows it still held; n waits for its retry.
	var left []int64
	rows, err := s.pool.Query(ctx, fmt.Sprintf("SELECT id FROM %s ORDER BY id", s.table))
	must(t, err)
	left, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	must(t, err)
	if !slices.Equal(left, []int64{n, rm}) {
		t.Errorf("rows left %v, want %v", left, []int64{n, rm})
	}
}
