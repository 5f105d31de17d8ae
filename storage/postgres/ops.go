package postgres

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox/storage"
)

// walkFactor bounds a strict claim's walk: it looks at most walkFactor times
// the batch size of due, unparked candidates that are not in flight. Most of
// them are heads of their keys; the others get parked on the way, so the
// next claim does not walk them again.
const walkFactor = 2

// queries holds the statements of one storage, built once in New.
type queries struct {
	claim                 string
	lockAck, ack          string // strict: the locks, then the ack with a fresh snapshot
	lockDead, deadLetter  string
	nack, release, extend string
	unlease               string
}

// A note on locks, for every statement below. Claims never wait for a row
// lock: they lock outbox rows FOR UPDATE / FOR SHARE SKIP LOCKED, and insert
// leases in id order. Write-backs lock the outbox rows they touch FOR UPDATE
// in id order first (an ARRAY(... ORDER BY id FOR UPDATE) sub-select, which
// PostgreSQL evaluates whole, rows locked in sort order, before the statement
// that uses it), then their lease rows, in id order too. A write-back can
// wait for a claim (which waits for nobody) or for another write-back that
// locked a lower id first: no cycle, so no deadlock.

func buildQueries(t, leases, delivered string, c Config) queries {
	strict := !c.DisableStrictOrdering
	// visible: a row old enough to hand out (VisibilityDelay, CommitOrderFence).
	visible := func(a string) string {
		v := ""
		if c.VisibilityDelay > 0 {
			v += fmt.Sprintf(" AND %s.created_at <= (SELECT t FROM clk) - interval '%d microseconds'", a, c.VisibilityDelay.Microseconds())
		}
		if c.CommitOrderFence {
			// Rows from before the txid column existed have none: they are
			// old enough.
			v += fmt.Sprintf(" AND (%[1]s.txid IS NULL OR %[1]s.txid < (SELECT xmin FROM clk))", a)
		}
		return v
	}
	due := func(a string) string {
		return fmt.Sprintf("%s.due_at <= (SELECT t FROM clk)%s", a, visible(a))
	}
	// live: a lease that has not run out at the claim's clock reading.
	live := func(a string) string {
		return fmt.Sprintf("EXISTS (SELECT FROM %s l WHERE l.id = %s.id AND l.leased_until > (SELECT t FROM clk))", leases, a)
	}
	leaseUntil := "(SELECT t FROM clk) + $3::bigint * interval '1 microsecond'"

	// "Now" is one clock reading taken once the statement runs, after its
	// snapshot: not now(), the start of the transaction. Every visible row
	// committed before this reading, so its default due time (its
	// producer's now()) is behind it: a row committed by a transaction that
	// began early is never "not yet due" while a later row of its key is.
	clk := "WITH clk AS MATERIALIZED (SELECT clock_timestamp() AS t, pg_snapshot_xmin(pg_current_snapshot()) AS xmin),"

	// Taking a lease: a row with no lease row gets one; a row whose lease
	// ran out is taken over, judged on the latest committed lease (ON
	// CONFLICT sees leases committed after this statement's snapshot), so
	// two claimers never both hold a record. Inserted in id order (see the
	// note on locks).
	takeLease := func(from string) string {
		return fmt.Sprintf(`INSERT INTO %s AS l (id, key, leased_by, leased_until, attempts)
    SELECT id, key, $2, %s, attempts + 1 FROM %s ORDER BY id
    ON CONFLICT (id) DO UPDATE SET leased_by = excluded.leased_by, leased_until = excluded.leased_until,
        attempts = l.attempts + 1
    WHERE l.leased_until <= excluded.leased_until - $3::bigint * interval '1 microsecond'
    RETURNING l.id, l.attempts`, leases, leaseUntil, from)
	}

	var claim string
	if strict {
		// Strict ordering with parked rows; see the package documentation
		// for the invariant (the lowest pending row of a key is never
		// parked) and why this is race-free.
		claim = clk + fmt.Sprintf(`
-- The walk: due, unparked pending rows in (due_at, id) order, leaving out
-- the rows in flight (one probe of the lease table's primary key each).
c AS MATERIALIZED (
    SELECT o.id, o.key FROM %[1]s o
    WHERE o.status = 'pending' AND NOT o.parked AND %[3]s AND NOT %[4]s
    ORDER BY o.due_at, o.id
    LIMIT $4),
-- The nearest earlier pending row of each keyed candidate's key, if any.
-- (Here and below, the rows of one key are selected with row comparisons on
-- (key, id) and ordered by (key, id), which only the key index can serve:
-- with "key = x ... ORDER BY id" the planner may walk the primary key and
-- filter on the key, which behind a hot key of a million rows took
-- minutes.)
e AS MATERIALIZED (
    SELECT c.id, c.key, CASE WHEN c.key <> '' THEN (
        SELECT p.id FROM %[1]s p
        WHERE (p.key, p.id) > (c.key, (-9223372036854775808)::bigint) AND (p.key, p.id) < (c.key, c.id)
          AND p.key <> '' AND p.status = 'pending'
        ORDER BY p.key DESC, p.id DESC LIMIT 1) END AS before
    FROM c),
-- Heads: candidates with no earlier pending row. The row lock gives this
-- claim the key; a head another transaction holds is skipped, never waited
-- for. The lock re-checks the latest version of the row. (Here and in the
-- other locks by id, the re-check is wrapped in COALESCE so that no partial
-- index's predicate matches it: with statistics from an empty table the
-- planner otherwise walked the whole walk index to find the ids, 580 ms for
-- 1000 rows over 30k, instead of 1000 primary-key probes.)
h AS MATERIALIZED (
    SELECT o.id, o.key, o.attempts FROM %[1]s o
    WHERE o.id = ANY(ARRAY(SELECT e.id FROM e WHERE e.before IS NULL))
      AND COALESCE(o.status = 'pending' AND NOT o.parked AND o.due_at <= (SELECT t FROM clk), false)
    ORDER BY o.id
    LIMIT $1
    FOR UPDATE SKIP LOCKED),
-- Followers: after each head, the next pending rows of its key in id
-- order (parked or not), up to the first one that is in flight or not due:
-- a run the forwarder publishes in order. The batch is then filled in id
-- order, so each head reads at most twice its share of it (at least 16, at
-- most the batch), and when the heads fill the batch by themselves, only
-- followers below the highest head: the rows read stay a small multiple of
-- the batch, and one long run next to many single heads still fills it.
f AS MATERIALIZED (
    SELECT r.id, h.id AS head FROM h CROSS JOIN LATERAL (
        SELECT q.id, bool_and(q.ok) OVER (ORDER BY q.id) AS run FROM (
            SELECT p.id, (%[5]s AND NOT %[6]s) AS ok FROM %[1]s p
            WHERE (p.key, p.id) > (h.key, h.id)
              AND (p.key, p.id) < (h.key, (SELECT CASE WHEN count(*) >= $1 THEN max(id) ELSE 9223372036854775807 END FROM h))
              AND p.key <> '' AND p.status = 'pending'
            ORDER BY p.key, p.id
            LIMIT (SELECT LEAST($1, GREATEST(ceil(2.0 * $1 / GREATEST(count(*), 1))::int, 16)) FROM h)) q) r
    WHERE h.key <> '' AND r.run),
-- The batch: heads and followers in id order. A key's rows in it are a
-- prefix of its run.
b AS MATERIALIZED (
    SELECT id, head FROM (SELECT id, id AS head FROM h UNION ALL SELECT id, head FROM f) x
    ORDER BY id
    LIMIT $1),
-- Lock the followers too (a late write-back of an expired lease must not
-- slip between), skipping the ones another transaction holds.
fl AS MATERIALIZED (
    SELECT o.id, o.key, o.attempts FROM %[1]s o
    WHERE o.id = ANY(ARRAY(SELECT b.id FROM b WHERE b.id <> b.head))
      AND COALESCE(o.status = 'pending' AND o.due_at <= (SELECT t FROM clk), false)
    FOR UPDATE SKIP LOCKED),
-- What this claim holds, per key up to the first row it could not lock.
held AS MATERIALIZED (
    SELECT x.id, x.key, x.attempts, x.head FROM (
        SELECT b.id, b.head, COALESCE(h.key, fl.key) AS key, COALESCE(h.attempts, fl.attempts) AS attempts,
            bool_and(h.id IS NOT NULL OR fl.id IS NOT NULL) OVER (PARTITION BY b.head ORDER BY b.id) AS ok
        FROM b LEFT JOIN h ON h.id = b.id LEFT JOIN fl ON fl.id = b.id) x
    WHERE x.ok),
ins AS (%[7]s),
-- Parking: a candidate behind an earlier pending row E of its key (other
-- than this claim's own keys) is parked, but only while this claim holds E
-- FOR SHARE: E cannot be acked or dead-lettered before this claim commits,
-- and the ack that removes E then sees the parked row and unparks it if it
-- has become its key's lowest. If E is locked, the candidate is left alone.
pe AS MATERIALIZED (
    SELECT o.id FROM %[1]s o
    WHERE o.id = ANY(ARRAY(SELECT e.before FROM e WHERE e.before IS NOT NULL AND e.key NOT IN (SELECT h.key FROM h)))
      AND o.status = 'pending'
    FOR SHARE SKIP LOCKED),
pc AS MATERIALIZED (
    SELECT o.id FROM %[1]s o
    WHERE o.id = ANY(ARRAY(SELECT e.id FROM e WHERE e.before IN (SELECT pe.id FROM pe)))
      AND COALESCE(o.status = 'pending' AND NOT o.parked, false)
    FOR UPDATE SKIP LOCKED),
park AS (UPDATE %[1]s o SET parked = true FROM pc WHERE o.id = pc.id)
-- Hand out a row only if every earlier row of its key in this batch got its
-- lease too; the others come back with attempts 0 and Claim gives their
-- lease back at once.
SELECT o.id, o.uuid, o.topic, o.key, CASE WHEN a.whole THEN o.payload END, CASE WHEN a.whole THEN o.metadata END,
    CASE WHEN a.whole THEN a.attempts ELSE 0 END, o.created_at
FROM (
    SELECT held.id, ins.attempts,
        bool_and(ins.id IS NOT NULL) OVER (PARTITION BY held.head ORDER BY held.id) AS whole
    FROM held LEFT JOIN ins ON ins.id = held.id) a
JOIN %[1]s o ON o.id = a.id
WHERE a.attempts IS NOT NULL
ORDER BY o.id`, t, leases, due("o"), live("o"), due("p"), live("p"), takeLease("held"))
	} else {
		// Claimers run side by side: each locks its candidates (FOR UPDATE
		// SKIP LOCKED, so they skip each other's rows) and leases them.
		// Rows parked by strict claims before a switch are not walked: each
		// ack unparks the next row of its key (promote), so they follow one
		// by one.
		claim = clk + fmt.Sprintf(`
c AS MATERIALIZED (
    SELECT o.id, o.uuid, o.topic, o.key, o.payload, o.metadata, o.attempts, o.created_at FROM %[1]s o
    WHERE o.status = 'pending' AND NOT o.parked AND %[3]s AND NOT %[4]s
    ORDER BY o.due_at, o.id
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED),
ins AS (%[5]s)
SELECT c.id, c.uuid, c.topic, c.key, c.payload, c.metadata, ins.attempts, c.created_at
FROM ins JOIN c ON c.id = ins.id
ORDER BY c.id`, t, leases, due("o"), live("o"), takeLease("c"))
	}

	// lockRows locks the outbox rows a write-back touches, in id order,
	// before anything else; with heads, also the lowest pending row of each
	// key touched (an ack of a follower then waits for an ack of its head
	// running at the same time, so the later of the two sees the other's
	// effect when it promotes).
	lockRows := func(ids string, heads bool) string {
		extra := ""
		if heads {
			extra = fmt.Sprintf(`
        UNION ALL
        SELECT (SELECT p.id FROM %[1]s p
                WHERE (p.key, p.id) > (k.key, (-9223372036854775808)::bigint) AND (p.key, p.id) < (k.key, 9223372036854775807::bigint)
                  AND p.key <> '' AND p.status = 'pending'
                ORDER BY p.key, p.id LIMIT 1)
        FROM (SELECT DISTINCT key FROM %[1]s WHERE id %[2]s AND key <> '') k`, t, ids)
		}
		return fmt.Sprintf(`ARRAY(SELECT o.id FROM %[1]s o WHERE o.id = ANY(ARRAY(SELECT id FROM %[1]s WHERE id %[2]s%[3]s)) AND o.status = 'pending'
    ORDER BY o.id FOR UPDATE)`, t, ids, extra)
	}
	// fenced deletes the worker's leases of the given (locked) rows, lease
	// rows locked in id order: the lease is the fence (a lease taken over by
	// another worker has another leased_by, so the write-back matches
	// nothing), and its attempts, which count claims whose lease ran out, go
	// to the row.
	fenced := func(rows string) string {
		return fmt.Sprintf(`WITH l AS (
    DELETE FROM %[1]s x WHERE x.id = ANY(ARRAY(
        SELECT y.id FROM %[1]s y WHERE y.id = ANY(%[2]s) AND y.leased_by = $2 ORDER BY y.id FOR UPDATE))
    RETURNING x.id, x.attempts)`, leases, rows)
	}
	// promote unparks, for each key of the rows in d, its lowest pending
	// row other than those rows (d's deletes are not visible to the same
	// statement).
	promote := fmt.Sprintf(`,
pr AS (
    UPDATE %[1]s o SET parked = false
    WHERE o.id = ANY(ARRAY(
        SELECT (SELECT p.id FROM %[1]s p
                WHERE (p.key, p.id) > (k.key, (-9223372036854775808)::bigint) AND (p.key, p.id) < (k.key, 9223372036854775807::bigint)
                  AND p.key <> '' AND p.status = 'pending' AND p.id <> ALL(ARRAY(SELECT id FROM d))
                ORDER BY p.key, p.id LIMIT 1)
        FROM (SELECT DISTINCT key FROM d WHERE key <> '') k))
      AND o.parked)`, t)

	// Ack: the outbox row is deleted and the delivery recorded in the narrow
	// delivered table (an UPDATE to 'delivered' wrote a new version of the
	// whole row and its index entries).
	ackBody := func(rows string) string {
		if c.DeleteOnAck {
			return fenced(rows) + fmt.Sprintf(`,
d AS (DELETE FROM %s o USING l WHERE o.id = l.id AND o.status = 'pending' RETURNING o.id, o.key)%s
SELECT count(*) FROM d`, t, promote)
		}
		return fenced(rows) + fmt.Sprintf(`,
d AS (DELETE FROM %s o USING l WHERE o.id = l.id AND o.status = 'pending'
    RETURNING o.id, o.uuid, o.topic, o.key, o.created_at, l.attempts, o.last_error)%s
INSERT INTO %s (id, uuid, topic, key, created_at, delivered_at, attempts, last_error)
SELECT d.id, d.uuid, d.topic, d.key, d.created_at, now(), d.attempts, d.last_error FROM d`, t, promote, delivered)
	}
	deadBody := func(rows string) string {
		return fenced(rows) + fmt.Sprintf(`,
d AS (UPDATE %s o SET status = 'dead', parked = false, attempts = l.attempts, last_error = $3
    FROM l WHERE o.id = l.id AND o.status = 'pending' RETURNING o.id, o.key)%s
SELECT count(*) FROM d`, t, promote)
	}

	q := queries{claim: claim}
	if strict {
		// With strict ordering an ack or a dead-letter is two statements in
		// one transaction (one round trip): the first locks the rows (and
		// the heads of their keys); the second, with a snapshot taken once
		// those locks are held, sees every row a claim parked behind them
		// (a claim parks only while holding the row in front FOR SHARE) and
		// unparks the new lowest pending row of each key.
		q.lockAck = fmt.Sprintf("SELECT cardinality(%s)", lockRows("= ANY($1)", true))
		q.ack = ackBody("$1")
		q.lockDead = fmt.Sprintf("SELECT cardinality(%s)", lockRows("= $1", true))
		q.deadLetter = deadBody("ARRAY[$1::bigint]")
	} else {
		// Without strict ordering nothing parks rows, so one statement sees
		// every parked row (left by strict claims before a switch).
		q.ack = ackBody(lockRows("= ANY($1)", false))
		q.deadLetter = deadBody(lockRows("= $1", false))
	}
	// Nack and release leave the head the head: no promotion.
	q.nack = fenced(lockRows("= $1", false)) + fmt.Sprintf(`
UPDATE %s o SET attempts = l.attempts, last_error = $3, due_at = $4
FROM l WHERE o.id = l.id AND o.status = 'pending'`, t)
	// Release gives the claim's attempt back.
	q.release = fenced(lockRows("= ANY($1)", false)) + fmt.Sprintf(`
UPDATE %s o SET attempts = GREATEST(l.attempts - 1, 0), due_at = $3
FROM l WHERE o.id = l.id AND o.status = 'pending'`, t)
	// A lease that ran out is not extended, even when nobody took it over
	// yet: the forwarder may already have been overtaken. Lease rows are
	// locked in id order.
	q.extend = fmt.Sprintf(`UPDATE %[1]s SET leased_until = clock_timestamp() + $3::bigint * interval '1 microsecond'
WHERE id = ANY(ARRAY(SELECT id FROM %[1]s WHERE id = ANY($1) AND leased_by = $2 AND leased_until > clock_timestamp()
    ORDER BY id FOR UPDATE))
  AND leased_by = $2 AND leased_until > clock_timestamp()
RETURNING id`, leases)
	// unlease gives back leases a claim took but did not hand out.
	q.unlease = fmt.Sprintf(`DELETE FROM %[1]s WHERE id = ANY(ARRAY(
    SELECT id FROM %[1]s WHERE id = ANY($1) AND leased_by = $2 ORDER BY id FOR UPDATE))`, leases)
	return q
}

// noJIT turns JIT compilation off for the rest of the transaction.
const noJIT = "SELECT set_config('jit', 'off', true)"

// Claim implements [storage.Storage]: one statement, one round trip.
func (s *Storage) Claim(ctx context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	if p.BatchSize <= 0 || p.Lease <= 0 || p.WorkerID == "" {
		return nil, fmt.Errorf("claim outbox rows: need BatchSize > 0, Lease > 0 and a WorkerID (got %d, %s, %q)", p.BatchSize, p.Lease, p.WorkerID)
	}
	args := []any{p.BatchSize, p.WorkerID, p.Lease.Microseconds()}
	if !s.config.DisableStrictOrdering {
		args = append(args, walkFactor*p.BatchSize)
	}
	// JIT off, for this transaction only, sent in the same round trip (one
	// batch, one implicit transaction): the claim's estimated cost (range
	// probes of the key index, whose row counts the planner cannot know)
	// passes jit_above_cost, and compiling it took 180 ms for a claim that
	// runs in 2 (EXPLAIN ANALYZE, one hot key of 300k parked rows).
	b := &pgx.Batch{}
	b.Queue(noJIT)
	b.Queue(s.q.claim, args...)
	br := s.pool.SendBatch(ctx, b)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("claim outbox rows from %s: %w", s.table, err)
	}
	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("claim outbox rows from %s: %w", s.table, err)
	}
	recs, err := scanClaimed(rows, s.table, p.BatchSize)
	if err != nil {
		return nil, err
	}
	// The batch commits at its end: a failed commit means the leases were
	// not taken.
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("claim outbox rows from %s: commit: %w", s.table, err)
	}
	// A row that comes back with attempts 0 was leased but not handed out:
	// an earlier row of its key in the same batch lost its lease to another
	// claimer meanwhile. Its lease goes back at once (it would otherwise
	// run out by itself).
	var back []int64
	out := recs[:0]
	for _, r := range recs {
		if r.Attempts == 0 {
			back = append(back, r.ID)
			continue
		}
		out = append(out, r)
	}
	if len(back) > 0 {
		if _, err := s.pool.Exec(ctx, s.q.unlease, back, p.WorkerID); err != nil {
			return nil, fmt.Errorf("claim outbox rows from %s: give back %d leases: %w", s.table, len(back), err)
		}
	}
	return out, nil
}

// Ack implements [storage.Storage]: the whole batch in one round trip.
func (s *Storage) Ack(ctx context.Context, p storage.AckParams) error {
	if len(p.IDs) == 0 {
		return nil
	}
	if err := s.twoStep(ctx, s.q.lockAck, s.q.ack, p.IDs, p.WorkerID); err != nil {
		return fmt.Errorf("ack %d outbox rows in %s: %w", len(p.IDs), s.table, err)
	}
	return nil
}

// Nack implements [storage.Storage].
func (s *Storage) Nack(ctx context.Context, p storage.NackParams) error {
	if _, err := s.pool.Exec(ctx, s.q.nack, p.ID, p.WorkerID, p.Error, p.RetryAt); err != nil {
		return fmt.Errorf("nack outbox row %d in %s: %w", p.ID, s.table, err)
	}
	return nil
}

// Release implements [storage.Storage].
func (s *Storage) Release(ctx context.Context, p storage.ReleaseParams) error {
	if len(p.IDs) == 0 {
		return nil
	}
	if _, err := s.pool.Exec(ctx, s.q.release, p.IDs, p.WorkerID, p.RetryAt); err != nil {
		return fmt.Errorf("release %d outbox rows in %s: %w", len(p.IDs), s.table, err)
	}
	return nil
}

// DeadLetter implements [storage.Storage].
func (s *Storage) DeadLetter(ctx context.Context, p storage.DeadLetterParams) error {
	if err := s.twoStep(ctx, s.q.lockDead, s.q.deadLetter, p.ID, p.WorkerID, p.Error); err != nil {
		return fmt.Errorf("dead-letter outbox row %d in %s: %w", p.ID, s.table, err)
	}
	return nil
}

// twoStep runs lock (when set, with the first argument only) then sql, as
// one batch: one round trip, one implicit transaction, and sql's snapshot is
// taken once lock's row locks are held.
func (s *Storage) twoStep(ctx context.Context, lock, sql string, args ...any) error {
	if lock == "" {
		_, err := s.pool.Exec(ctx, sql, args...)
		return err
	}
	b := &pgx.Batch{}
	b.Queue(noJIT)
	b.Queue(lock, args[0])
	b.Queue(sql, args...)
	return s.pool.SendBatch(ctx, b).Close()
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
