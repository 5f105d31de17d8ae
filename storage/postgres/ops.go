package postgres

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox/storage"
)

// walkBudget bounds how long one Claim goes on walking while its walks
// claim nothing but find rows to walk: rows held back behind heads that
// nobody parked yet (a backlog behind a head in flight, the rows behind
// heads that failed in an outage). Every walk parks the held-back rows of
// up to a batch of keys, each row once, so the heads behind them are
// reached within the same call, or within the next ones when the backlog
// is too deep for the budget.
const walkBudget = time.Second

// queries holds the statements of one storage, built once in New.
type queries struct {
	plan                  string
	claim, unlease        string
	ack, nack, release    string
	deadLetter, extend    string
	lock, unpark          string
	ackUnparks, deadKeeps bool
}

// A note on locks, for every statement below.
//
// Claims never wait for one another. The strict claim locks the heads it
// takes FOR UPDATE SKIP LOCKED, the heads of the keys whose rows it parks
// FOR KEY SHARE SKIP LOCKED, and the rows it parks FOR UPDATE SKIP LOCKED.
// Only the rows that follow a head it holds are locked with a plain FOR
// UPDATE, in id order, and no other claim locks those: a claim parks the
// rows of a key only while it holds that key's head FOR KEY SHARE, and takes
// followers only while it holds the head FOR UPDATE; the two exclude each
// other. So a claim waits only for a write-back of the previous holder.
//
// Write-backs lock the outbox rows they touch in id order first (FOR
// UPDATE), then their lease rows in id order; claims insert or take over
// leases in id order and Extend locks them in id order.
//
// Parking and unparking meet on the head's row lock: a claim parks the rows
// behind a head only while it holds that head FOR KEY SHARE, which every
// write-back's FOR UPDATE waits for. A write-back that removes a head (ack,
// dead-letter, skip) unparks the next row of its key in a second statement
// of its transaction, whose snapshot is taken after its locks: it sees every
// row a claim parked behind that head.

func buildQueries(t, leases, delivered string, c Config) queries {
	strict := !c.DisableStrictOrdering
	// ready: a row that may go out now: due, old enough (VisibilityDelay),
	// and with CommitFence written by a transaction that no transaction
	// still running can precede.
	ready := func(a string) string {
		s := fmt.Sprintf("%s.due_at <= (SELECT t FROM clk)", a)
		if c.VisibilityDelay > 0 {
			s += fmt.Sprintf(" AND %s.created_at <= (SELECT t FROM clk) - interval '%d microseconds'", a, c.VisibilityDelay.Microseconds())
		}
		if c.CommitFence {
			s += fmt.Sprintf(" AND (%s.created_xid IS NULL OR %[1]s.created_xid < (SELECT x FROM clk))", a)
		}
		return s
	}
	// leased: a live lease on the row.
	// The live leases are read once per statement into a hash (a hashed
	// SubPlan: the lease table holds only the rows in flight), and each row
	// walked costs one lookup in it rather than a probe of the lease
	// table's index: the walk meets every row in flight first.
	leased := func(a string) string {
		return fmt.Sprintf("%s.id IN (SELECT l.id FROM %s l WHERE l.leased_until > (SELECT t FROM clk))", a, leases)
	}
	// "Now" is one clock reading taken once the statement runs, after its
	// snapshot: not now(), the start of the transaction. With CommitFence,
	// x is the oldest transaction still running.
	clk := "WITH clk AS MATERIALIZED (SELECT clock_timestamp() AS t)"
	if c.CommitFence {
		clk = "WITH clk AS MATERIALIZED (SELECT clock_timestamp() AS t, pg_snapshot_xmin(pg_current_snapshot()) AS x)"
	}
	// takeLease leases the rows of a CTE (id, key, attempts): a row without
	// a lease row gets one; a lease that ran out is taken over, judged on
	// the latest committed lease (ON CONFLICT sees it), in id order.
	takeLease := func(from string) string {
		return fmt.Sprintf(`INSERT INTO %[1]s AS l (id, key, leased_by, leased_until, attempts)
    SELECT id, key, $2, (SELECT t FROM clk) + $3::bigint * interval '1 microsecond', attempts + 1 FROM %[2]s ORDER BY id
    ON CONFLICT (id) DO UPDATE SET leased_by = excluded.leased_by, leased_until = excluded.leased_until,
        attempts = l.attempts + 1
    WHERE l.leased_until <= (SELECT t FROM clk)
    RETURNING l.id, l.attempts`, leases, from)
	}
	// first: the first row of a's key before a: the lowest pending id (with
	// HoldOnDeadLetter, or dead id) of the key below a.id; NULL when a is
	// the first (its key's head).
	first := func(a string) string {
		s := fmt.Sprintf(`(SELECT p.id FROM %[1]s p
            WHERE p.key = %[2]s.key AND p.key <> '' AND p.status = 'pending' AND p.id < %[2]s.id
            ORDER BY p.key, p.id LIMIT 1)`, t, a)
		if c.HoldOnDeadLetter {
			s = fmt.Sprintf(`LEAST(%s, (SELECT d.id FROM %s d
            WHERE d.key = %s.key AND d.key <> '' AND d.status = 'dead' AND d.id < %[3]s.id
            ORDER BY d.key, d.id LIMIT 1))`, s, t, a)
		}
		return s
	}
	blocking := "'pending'"
	if c.HoldOnDeadLetter {
		blocking = "'pending', 'dead'"
	}

	var q queries
	if strict {
		// The strict claim, one statement:
		//
		// c: the walk. The first $1 rows of the walk index (pending, not
		// parked, due first) that are ready and not leased, each with the
		// first row of its key before it, if any (one probe of the key
		// index).
		//
		// h: the heads among them (no row before them), locked SKIP LOCKED,
		// so that claims running side by side take different heads. (Read
		// by id; a condition on parked here would let the planner read
		// them through the walk index, all of it.)
		//
		// k, pk: the others wait behind their key's head (or, with
		// HoldOnDeadLetter, a dead row). Every pending row of such a key
		// behind its head is parked, out of the walk, so that the walk meets
		// a held key once however many rows it has waiting, if the head can
		// be locked FOR KEY SHARE now (see the note on locks), and if the
		// head waits for its retry (or is dead), or is in flight and the
		// walk met more than one row behind it: the backlog of a hot key.
		// A key in flight with one row in the walk is just walked over:
		// its hold ends with the ack, and parking would cost a write of
		// each row of a busy key. A head this claim takes leaves its
		// followers unparked. (Locks taken SKIP LOCKED never wait, so their
		// order does not matter.)
		//
		// w, sh, n, f: each keyed head brings the pending rows that follow it in
		// its key, parked or not, as long as they are ready and not leased:
		// as many as the walk met, plus an even share of what the heads and
		// those leave of the batch (the rows of a key that waited behind
		// its head were parked, and the walk does not meet them). With
		// HoldOnDeadLetter a head that failed before goes alone, so that a
		// forwarder never holds later rows of a key whose head it may
		// dead-letter.
		//
		// b, ins, a: the followers are locked in id order (only the
		// previous holder's write-back can hold one), and heads and
		// followers leased. A row is handed out only if every earlier row
		// of its key in the batch got its lease too; the others come back
		// with whole = false and Claim gives their lease back (a lease
		// another claim took or its holder extended after this statement's
		// snapshot).
		//
		// When the walk claimed nothing but parked rows, one row with a
		// NULL id says so: Claim walks again.
		alone := ""
		if c.HoldOnDeadLetter {
			alone = " AND h.last_error IS NULL"
		}
		q.claim = clk + fmt.Sprintf(`,
c AS MATERIALIZED (
    SELECT o.id, CASE WHEN o.key = '' THEN NULL ELSE %[4]s END AS blocker
    FROM %[1]s o
    WHERE o.status = 'pending' AND NOT o.parked AND %[2]s AND NOT %[3]s
    ORDER BY o.due_at, o.id
    LIMIT $1),
h AS MATERIALIZED (
    SELECT o.id, o.uuid, o.topic, o.key, o.payload, o.metadata, o.attempts, o.created_at, o.last_error FROM %[1]s o
    WHERE o.id = ANY(ARRAY(SELECT id FROM c WHERE blocker IS NULL)) AND o.status = 'pending'
    FOR UPDATE SKIP LOCKED),
k AS MATERIALIZED (
    SELECT b.id, b.key FROM %[1]s b
    WHERE b.id = ANY(ARRAY(
            SELECT c.blocker FROM c WHERE c.blocker IS NOT NULL GROUP BY c.blocker
            HAVING count(*) > 1 OR NOT EXISTS (
                SELECT FROM %[10]s l WHERE l.id = c.blocker AND l.leased_until > (SELECT t FROM clk))))
      AND b.id <> ALL(ARRAY(SELECT id FROM h)) AND b.status IN (%[7]s)
    FOR KEY SHARE SKIP LOCKED),
pk AS (
    UPDATE %[1]s o SET parked = true
    FROM (SELECT x.id FROM k JOIN %[1]s x ON x.key = k.key AND x.key <> '' AND x.status = 'pending' AND x.id > k.id
          WHERE NOT x.parked
          FOR UPDATE OF x SKIP LOCKED) x
    WHERE o.id = x.id
    RETURNING o.id),
w AS MATERIALIZED (
    SELECT c.blocker AS id, count(*) AS walked FROM c WHERE c.blocker = ANY(ARRAY(SELECT id FROM h)) GROUP BY c.blocker),
sh AS MATERIALIZED (
    SELECT GREATEST($1 - (SELECT count(*) FROM h) - (SELECT COALESCE(sum(walked), 0)::bigint FROM w), 0)
        / GREATEST((SELECT count(*) FROM h), 1) AS share),
n AS MATERIALIZED (
    SELECT h.id, h.key, h.last_error, COALESCE(w.walked, 0) + (SELECT share FROM sh) AS follow
    FROM h LEFT JOIN w ON w.id = h.id
    WHERE h.key <> '' AND COALESCE(w.walked, 0) + (SELECT share FROM sh) > 0),
f AS MATERIALIZED (
    SELECT r.id FROM n h CROSS JOIN LATERAL (
        SELECT q.id, bool_and(q.ok) OVER (ORDER BY q.id) AS run FROM (
            SELECT p.id, (%[5]s AND NOT %[6]s) AS ok
            FROM %[1]s p
            WHERE p.key = h.key AND p.key <> '' AND p.status = 'pending' AND p.id > h.id
            ORDER BY p.key, p.id
            LIMIT h.follow) q) r
    WHERE r.run%[8]s),
b AS MATERIALIZED (
    SELECT o.id, o.uuid, o.topic, o.key, o.payload, o.metadata, o.attempts, o.created_at FROM %[1]s o
    WHERE o.id = ANY(ARRAY(SELECT id FROM f)) AND o.status = 'pending'
    ORDER BY o.id
    FOR UPDATE),
hb AS MATERIALIZED (
    SELECT id, uuid, topic, key, payload, metadata, attempts, created_at FROM h
    UNION ALL
    SELECT * FROM b),
ins AS (%[9]s),
a AS (
    SELECT hb.*, ins.attempts AS leased,
        bool_and(ins.id IS NOT NULL) OVER (PARTITION BY hb.key, CASE WHEN hb.key = '' THEN hb.id END ORDER BY hb.id) AS whole
    FROM hb LEFT JOIN ins ON ins.id = hb.id)
SELECT a.id, a.uuid, a.topic, a.key, a.payload, a.metadata, a.leased, a.created_at, a.whole
FROM a WHERE a.leased IS NOT NULL
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false
WHERE NOT EXISTS (SELECT FROM hb) AND EXISTS (SELECT FROM pk)`, t, ready("o"), leased("o"), first("o"), ready("p"), leased("p"), blocking, alone, takeLease("hb"), leases)
	} else {
		// Without strict ordering claims run side by side: each locks its
		// candidates (SKIP LOCKED, so they skip each other's rows) and
		// leases them. Nothing is ever parked.
		q.claim = clk + fmt.Sprintf(`,
c AS MATERIALIZED (
    SELECT o.id, o.uuid, o.topic, o.key, o.payload, o.metadata, o.attempts, o.created_at FROM %[1]s o
    WHERE o.status = 'pending' AND NOT o.parked AND %[2]s AND NOT %[3]s
    ORDER BY o.due_at, o.id
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED),
ins AS (%[4]s)
SELECT c.id, c.uuid, c.topic, c.key, c.payload, c.metadata, ins.attempts, c.created_at
FROM ins JOIN c ON c.id = ins.id
ORDER BY c.id`, t, ready("o"), leased("o"), takeLease("c"))
	}

	// Every statement runs with sorting and sequential scans off, for its
	// own transaction only (the settings and the statements go as one
	// batch, one round trip, which the server runs as one implicit
	// transaction), and without JIT:
	//
	//   - the claim walks the walk index in (due_at, id) order and stops
	//     after $1 rows. With statistics from when the table held few
	//     pending rows (a backlog that grew faster than autovacuum's
	//     ANALYZE: right after an outage, or a fresh table) the planner
	//     reads every due row and sorts them instead: 40 ms instead of
	//     under 10 for 1000 rows over a 30k backlog, and growing with it
	//     (TestClaimPlanWithStaleStatistics). Its other sorts are of a
	//     batch at most.
	//   - write-backs read the rows of a batch by id; with the same stale
	//     statistics the planner scans the whole table for them (14 ms for
	//     1000 rows of a 20k backlog, in the benchmark's drain).
	//   - a plan node the settings disable costs 1e10 in the planner's
	//     arithmetic, far above jit_above_cost, and compiling a statement
	//     with LLVM takes hundreds of milliseconds.
	//
	// Rows are locked in the order the statements' ORDER BY gives, not in
	// whatever order a plan reads them: the settings are about speed only.
	q.plan = "SELECT set_config('enable_sort', 'off', true), set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)"

	// A claim's rows that could not go out whole: the lease is given back
	// as it was (run out, attempt not counted).
	q.unlease = fmt.Sprintf(`UPDATE %s SET leased_until = clock_timestamp() - interval '1 microsecond', attempts = attempts - 1
WHERE id = ANY($1) AND leased_by = $2`, leases)

	// fenced locks the outbox rows of a write-back in id order, then the
	// worker's leases of them in id order, and deletes those leases: the
	// lease is the fence (a lease taken over by another worker has another
	// leased_by, so the write-back matches nothing), and its attempts, which
	// count claims whose lease ran out, go to the row.
	fenced := func(ids string) string {
		return fmt.Sprintf(`WITH m AS (SELECT id FROM %[1]s WHERE id %[3]s AND status = 'pending' ORDER BY id FOR UPDATE),
l AS (
    DELETE FROM %[2]s x WHERE x.id = ANY(ARRAY(
        SELECT y.id FROM %[2]s y WHERE y.id = ANY(ARRAY(SELECT id FROM m)) AND y.leased_by = $2 ORDER BY y.id FOR UPDATE))
    RETURNING x.id, x.attempts)`, t, leases, ids)
	}

	// An ack deletes the outbox row and records the delivery in the narrow
	// delivered table: an UPDATE to status 'delivered' wrote a new version of
	// the whole row (payload and metadata included) and its index entries.
	q.ack = fenced("= ANY($1)") + fmt.Sprintf(`,
d AS (
    DELETE FROM %[1]s o USING l WHERE o.id = l.id
    RETURNING o.id, o.uuid, o.topic, o.key, o.created_at, l.attempts, o.last_error)
INSERT INTO %[2]s (id, uuid, topic, key, created_at, delivered_at, attempts, last_error)
SELECT d.id, d.uuid, d.topic, d.key, d.created_at, now(), d.attempts, d.last_error FROM d`, t, delivered)
	if c.DeleteOnAck {
		q.ack = fenced("= ANY($1)") + fmt.Sprintf(`
DELETE FROM %[1]s o USING l WHERE o.id = l.id`, t)
	}
	q.ackUnparks = strict

	// A nack reschedules the row. It stays its key's head: the rows behind
	// it stay where they are (parked, or parked by the next claim that
	// walks them).
	q.nack = fenced("= $1") + fmt.Sprintf(`
UPDATE %s o SET attempts = l.attempts, last_error = $3, due_at = $4
FROM l WHERE o.id = l.id`, t)

	// Release gives the claim's attempt back.
	q.release = fenced("= ANY($1)") + fmt.Sprintf(`
UPDATE %s o SET attempts = GREATEST(l.attempts - 1, 0), due_at = $3
FROM l WHERE o.id = l.id`, t)

	// A dead-lettered row holds nothing back (unless HoldOnDeadLetter): the
	// next row of its key is unparked.
	q.deadLetter = fenced("= $1") + fmt.Sprintf(`
UPDATE %s o SET status = 'dead', attempts = l.attempts, last_error = $3, dead_at = now()
FROM l WHERE o.id = l.id`, t)
	q.deadKeeps = c.HoldOnDeadLetter

	// lock and unpark run before a write-back that removes heads (ack,
	// dead-letter, skip), in its transaction: lock takes the rows $1 in id
	// order, so that no claim can park rows behind them any more (a claim
	// parks only while it holds the head FOR KEY SHARE); unpark, with a
	// snapshot taken after those locks, unparks the first row of each of
	// their keys that is not among them, when it is parked and (with
	// HoldOnDeadLetter) no dead row of its key is before it; keys without
	// a parked row (most, most of the time) cost one probe of the parked
	// index. Unparking a
	// row that is not its key's head after all (the write-back found
	// another worker's lease) costs a walk over it, nothing more.
	q.lock = fmt.Sprintf(`SELECT id FROM %s WHERE id = ANY($1) ORDER BY id FOR UPDATE`, t)
	deadFirst := ""
	if c.HoldOnDeadLetter {
		deadFirst = fmt.Sprintf(`
  AND NOT EXISTS (SELECT FROM %s d WHERE d.key = o.key AND d.key <> '' AND d.status = 'dead' AND d.id < o.id AND d.id NOT IN (SELECT unnest($1::bigint[])))`, t)
	}
	q.unpark = fmt.Sprintf(`UPDATE %[1]s o SET parked = false
WHERE o.id = ANY(ARRAY(
    SELECT n.id FROM (SELECT DISTINCT key FROM %[1]s WHERE id = ANY($1) AND key <> '') k
    CROSS JOIN LATERAL (
        SELECT p.id FROM %[1]s p WHERE p.key = k.key AND p.key <> '' AND p.status = 'pending' AND p.id NOT IN (SELECT unnest($1::bigint[]))
        ORDER BY p.key, p.id LIMIT 1) n
    WHERE EXISTS (SELECT FROM %[1]s x WHERE x.key = k.key AND x.key <> '' AND x.status = 'pending' AND x.parked)))
  AND o.parked%[2]s`, t, deadFirst)

	// A lease that ran out is not extended, even when nobody took it over
	// yet: the forwarder may already have been overtaken.
	q.extend = fmt.Sprintf(`UPDATE %[1]s x SET leased_until = clock_timestamp() + $3::bigint * interval '1 microsecond'
WHERE x.id = ANY(ARRAY(
    SELECT y.id FROM %[1]s y WHERE y.id = ANY($1) AND y.leased_by = $2 AND y.leased_until > clock_timestamp()
    ORDER BY y.id FOR UPDATE))
RETURNING x.id`, leases)
	return q
}

// Claim implements [storage.Storage]: one statement (see buildQueries). With
// strict ordering, a walk that claimed nothing but parked rows is run
// again, for up to walkBudget.
func (s *Storage) Claim(ctx context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	if p.BatchSize <= 0 || p.Lease <= 0 || p.WorkerID == "" {
		return nil, fmt.Errorf("claim outbox rows: need BatchSize > 0, Lease > 0 and a WorkerID (got %d, %s, %q)", p.BatchSize, p.Lease, p.WorkerID)
	}
	start := time.Now()
	for {
		recs, broken, again, err := s.claimOnce(ctx, p)
		if err != nil {
			return nil, err
		}
		if len(broken) > 0 {
			if _, err := s.pool.Exec(ctx, s.q.unlease, broken, p.WorkerID); err != nil {
				// The leases run out by themselves; the records handed out
				// are leased whole.
				return recs, fmt.Errorf("claim outbox rows from %s: give back %d leases: %w", s.table, len(broken), err)
			}
		}
		if !again || time.Since(start) > walkBudget {
			return recs, nil
		}
	}
}

// claimOnce runs the planner settings and the claim as one batch. again
// reports a walk that claimed nothing but parked rows.
func (s *Storage) claimOnce(ctx context.Context, p storage.ClaimParams) (recs []storage.Record, broken []int64, again bool, err error) {
	b := &pgx.Batch{}
	b.Queue(s.q.plan)
	b.Queue(s.q.claim, p.BatchSize, p.WorkerID, p.Lease.Microseconds())
	br := s.pool.SendBatch(ctx, b)
	defer br.Close() //nolint:errcheck // the results are read and checked below; Close would repeat their error
	if _, err := br.Exec(); err != nil {
		return nil, nil, false, fmt.Errorf("claim outbox rows from %s: planner settings: %w", s.table, err)
	}
	rows, err := br.Query()
	if err != nil {
		return nil, nil, false, fmt.Errorf("claim outbox rows from %s: %w", s.table, err)
	}
	if recs, broken, again, err = scanClaimed(rows, s.table, p.BatchSize); err != nil {
		return nil, nil, false, err
	}
	// The batch is one implicit transaction, committed at its end: a failed
	// commit means the leases were not taken, so the records must not be
	// handed out.
	if err := br.Close(); err != nil {
		return nil, nil, false, fmt.Errorf("claim outbox rows from %s: commit: %w", s.table, err)
	}
	return recs, broken, again, nil
}

// Ack implements [storage.Storage]: the whole batch in one statement.
func (s *Storage) Ack(ctx context.Context, p storage.AckParams) error {
	if len(p.IDs) == 0 {
		return nil
	}
	if _, err := s.writeBack(ctx, s.q.ackUnparks, p.IDs, s.q.ack, p.IDs, p.WorkerID); err != nil {
		return fmt.Errorf("ack %d outbox rows in %s: %w", len(p.IDs), s.table, err)
	}
	return nil
}

// Nack implements [storage.Storage].
func (s *Storage) Nack(ctx context.Context, p storage.NackParams) error {
	if _, err := s.writeBack(ctx, false, nil, s.q.nack, p.ID, p.WorkerID, p.Error, p.RetryAt); err != nil {
		return fmt.Errorf("nack outbox row %d in %s: %w", p.ID, s.table, err)
	}
	return nil
}

// Release implements [storage.Storage].
func (s *Storage) Release(ctx context.Context, p storage.ReleaseParams) error {
	if len(p.IDs) == 0 {
		return nil
	}
	if _, err := s.writeBack(ctx, false, nil, s.q.release, p.IDs, p.WorkerID, p.RetryAt); err != nil {
		return fmt.Errorf("release %d outbox rows in %s: %w", len(p.IDs), s.table, err)
	}
	return nil
}

// DeadLetter implements [storage.Storage].
func (s *Storage) DeadLetter(ctx context.Context, p storage.DeadLetterParams) error {
	unpark := s.q.ackUnparks && !s.q.deadKeeps
	if _, err := s.writeBack(ctx, unpark, []int64{p.ID}, s.q.deadLetter, p.ID, p.WorkerID, p.Error); err != nil {
		return fmt.Errorf("dead-letter outbox row %d in %s: %w", p.ID, s.table, err)
	}
	return nil
}

// writeBack runs a write-back after the planner settings (see plan in
// buildQueries). With unpark set (ids: the rows whose heads the write-back
// may remove) it first locks those rows and unparks the next row of each of
// their keys (see lock and unpark). The statements go as one batch: one
// round trip, one implicit transaction, each statement with its own
// snapshot. It returns how many rows the write-back changed.
func (s *Storage) writeBack(ctx context.Context, unpark bool, ids any, sql string, args ...any) (int64, error) {
	b := &pgx.Batch{}
	b.Queue(s.q.plan)
	if unpark {
		b.Queue(s.q.lock, ids)
		b.Queue(s.q.unpark, ids)
	}
	b.Queue(sql, args...)
	br := s.pool.SendBatch(ctx, b)
	defer br.Close() //nolint:errcheck // the results are read and checked below; Close would repeat their error
	if _, err := br.Exec(); err != nil {
		return 0, fmt.Errorf("planner settings: %w", err)
	}
	if unpark {
		if _, err := br.Exec(); err != nil {
			return 0, fmt.Errorf("lock the rows: %w", err)
		}
		if _, err := br.Exec(); err != nil {
			return 0, fmt.Errorf("unpark the rows behind them: %w", err)
		}
	}
	tag, err := br.Exec()
	if err != nil {
		return 0, err
	}
	if err := br.Close(); err != nil {
		return 0, fmt.Errorf("commit: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Extend implements [storage.Storage].
func (s *Storage) Extend(ctx context.Context, p storage.ExtendParams) ([]int64, error) {
	if p.Lease <= 0 {
		return nil, fmt.Errorf("extend outbox leases in %s: Lease must be > 0, got %s", s.table, p.Lease)
	}
	if len(p.IDs) == 0 {
		return nil, nil
	}
	rows, err := s.pool.Query(ctx, s.q.extend, p.IDs, p.WorkerID, p.Lease.Microseconds())
	if err != nil {
		return nil, fmt.Errorf("extend the lease of %d outbox rows in %s: %w", len(p.IDs), s.table, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("extend the lease of %d outbox rows in %s: %w", len(p.IDs), s.table, err)
	}
	return ids, nil
}
