package postgres

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox/storage"
)

// unparkChunk is how many parked rows of a key an ack or a dead-letter of
// one of its rows unparks: the next rows in line, without writing a whole
// backlog behind a key at once. The next ack of the key unparks the next
// chunk, so a key's parked rows always follow an unparked pending row of it.
const unparkChunk = 1000

// queries holds the statements of one storage, built once in New.
type queries struct {
	walk, claim, claimAny string
	ack, nack, release    string
	deadLetter, extend    string
	unlease               string
}

// A note on locks, for every statement below. Claims never wait for another
// claim: they lock outbox rows FOR UPDATE SKIP LOCKED, and only the rows
// that follow a head they hold with plain FOR UPDATE (no other claim locks
// those; a write-back of the previous holder may, and it waits for nothing a
// claim holds). Write-backs lock the outbox rows they touch in id order
// first, then their lease rows in id order; claims insert or take over
// leases in id order, Extend locks them in id order. Every statement that
// waits, waits for one holding rows in the same order: no cycle, no
// deadlock.

func buildQueries(t, leases, delivered string, c Config) queries {
	// visible: old enough to hand out (VisibilityDelay).
	visible := func(a string) string {
		if c.VisibilityDelay <= 0 {
			return ""
		}
		return fmt.Sprintf(" AND %s.created_at <= (SELECT t FROM clk) - interval '%d microseconds'", a, c.VisibilityDelay.Microseconds())
	}
	// leased: a live lease on the row.
	leased := func(a string) string {
		return fmt.Sprintf("EXISTS (SELECT FROM %s l WHERE l.id = %s.id AND l.leased_until > (SELECT t FROM clk))", leases, a)
	}
	// "Now" is one clock reading taken once the statement runs, after its
	// snapshot: not now(), the start of the transaction.
	const clk = "WITH clk AS MATERIALIZED (SELECT clock_timestamp() AS t)"
	leaseUntil := "(SELECT t FROM clk) + $%d::bigint * interval '1 microsecond'"
	// takeLease leases the rows of a CTE (id, key, attempts): a row without
	// a lease row gets one; a lease that ran out is taken over, judged on
	// the latest committed lease (ON CONFLICT sees it), in id order.
	takeLease := func(from string, worker, lease int) string {
		return fmt.Sprintf(`INSERT INTO %[1]s AS l (id, key, leased_by, leased_until, attempts)
    SELECT id, key, $%[3]d, %[2]s, attempts + 1 FROM %[4]s ORDER BY id
    ON CONFLICT (id) DO UPDATE SET leased_by = excluded.leased_by, leased_until = excluded.leased_until,
        attempts = l.attempts + 1
    WHERE l.leased_until <= (SELECT t FROM clk)
    RETURNING l.id, l.attempts`, leases, fmt.Sprintf(leaseUntil, lease), worker, from)
	}

	var q queries

	// Strict ordering, part one: the walk. The heads of their keys (no
	// earlier pending row of the key: one probe of the key index each) that
	// are due, not parked and not leased, oldest due first, locked SKIP
	// LOCKED so that claims running side by side take different heads.
	// Rows behind a head in flight are walked over (a probe each); rows
	// behind a head waiting for its retry are parked (see nack) and rows
	// waiting for their retry are not due, so neither is walked.
	q.walk = clk + fmt.Sprintf(`
SELECT o.id FROM %[1]s o
WHERE o.status = 'pending' AND NOT o.parked AND o.due_at <= (SELECT t FROM clk)%[3]s
  AND NOT %[4]s
  AND (o.key = '' OR o.id = (
      SELECT p.id FROM %[1]s p WHERE p.key = o.key AND p.key <> '' AND p.status = 'pending'
      ORDER BY p.key, p.id LIMIT 1))
ORDER BY o.due_at, o.id
LIMIT $1
FOR UPDATE OF o SKIP LOCKED`, t, leases, visible("o"), leased("o"))

	// Strict ordering, part two, in the same transaction with a new
	// snapshot, taken after the heads were locked: it sees every lease
	// committed before the locks, so a head another claim leased meanwhile
	// is left out. Each keyed head brings the pending rows that follow it
	// in its key, as long as they are due, not parked and not leased: an
	// even share of what the heads leave of the batch. They are locked in id
	// order, waiting if need be (only the previous holder's write-back can
	// hold them). A row is handed out only if every earlier row of its key
	// in the batch got its lease too; the others are returned with whole =
	// false and Claim gives their lease back at once (a lease extended
	// between this statement's snapshot and its insert).
	q.claim = clk + fmt.Sprintf(`,
h AS MATERIALIZED (
    SELECT o.id, o.key FROM %[1]s o
    WHERE o.id = ANY($1) AND o.status = 'pending' AND NOT %[4]s),
f AS MATERIALIZED (
    SELECT r.id FROM h CROSS JOIN LATERAL (
        SELECT q.id, bool_and(q.ok) OVER (ORDER BY q.id) AS run FROM (
            SELECT p.id, (p.due_at <= (SELECT t FROM clk) AND NOT p.parked%[3]s AND NOT %[5]s) AS ok
            FROM %[1]s p
            WHERE p.key = h.key AND p.key <> '' AND p.status = 'pending' AND p.id > h.id
            ORDER BY p.id
            LIMIT (SELECT GREATEST($3 - count(*), 0) / GREATEST(count(*), 1) FROM h)) q) r
    WHERE h.key <> '' AND r.run),
b AS MATERIALIZED (
    SELECT o.id, o.uuid, o.topic, o.key, o.payload, o.metadata, o.attempts, o.created_at FROM %[1]s o
    WHERE o.id = ANY(ARRAY(SELECT id FROM h UNION ALL SELECT id FROM f)) AND o.status = 'pending'
    ORDER BY o.id
    FOR UPDATE),
ins AS (%[6]s),
a AS (
    SELECT b.*, ins.attempts AS leased,
        bool_and(ins.id IS NOT NULL) OVER (PARTITION BY b.key, CASE WHEN b.key = '' THEN b.id END ORDER BY b.id) AS whole
    FROM b LEFT JOIN ins ON ins.id = b.id)
SELECT a.id, a.uuid, a.topic, a.key, a.payload, a.metadata, a.leased, a.created_at, a.whole
FROM a WHERE a.leased IS NOT NULL
ORDER BY a.id`, t, leases, visible("p"), leased("o"), leased("p"), takeLease("b", 2, 4))

	// Without strict ordering claims run side by side: each locks its
	// candidates (SKIP LOCKED, so they skip each other's rows) and leases
	// them.
	q.claimAny = clk + fmt.Sprintf(`,
c AS MATERIALIZED (
    SELECT o.id, o.uuid, o.topic, o.key, o.payload, o.metadata, o.attempts, o.created_at FROM %[1]s o
    WHERE o.status = 'pending' AND NOT o.parked AND o.due_at <= (SELECT t FROM clk)%[2]s AND NOT %[3]s
    ORDER BY o.due_at, o.id
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED),
ins AS (%[4]s)
SELECT c.id, c.uuid, c.topic, c.key, c.payload, c.metadata, ins.attempts, c.created_at
FROM ins JOIN c ON c.id = ins.id
ORDER BY c.id`, t, visible("o"), leased("o"), takeLease("c", 2, 3))

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
        SELECT y.id FROM %[2]s y WHERE y.id IN (SELECT id FROM m) AND y.leased_by = $2 ORDER BY y.id FOR UPDATE))
    RETURNING x.id, x.attempts)`, t, leases, ids)
	}
	// unpark: the next parked rows of each key in d (rows written back).
	unpark := fmt.Sprintf(`,
up AS (
    UPDATE %[1]s o SET parked = false
    WHERE o.id = ANY(ARRAY(
        SELECT n.id FROM (SELECT DISTINCT key FROM d WHERE key <> '') k CROSS JOIN LATERAL (
            SELECT p.id FROM %[1]s p WHERE p.key = k.key AND p.parked AND p.status = 'pending'
            ORDER BY p.id LIMIT %[2]d) n))
      AND o.parked)`, t, unparkChunk)

	// An ack deletes the outbox row and records the delivery in the narrow
	// delivered table: an UPDATE to status 'delivered' wrote a new version of
	// the whole row (payload and metadata included) and its index entries.
	q.ack = fenced("= ANY($1)") + fmt.Sprintf(`,
d AS (
    DELETE FROM %[1]s o USING l WHERE o.id = l.id
    RETURNING o.id, o.uuid, o.topic, o.key, o.created_at, l.attempts, o.last_error)%[3]s
INSERT INTO %[2]s (id, uuid, topic, key, created_at, delivered_at, attempts, last_error)
SELECT d.id, d.uuid, d.topic, d.key, d.created_at, now(), d.attempts, d.last_error FROM d`, t, delivered, unpark)
	if c.DeleteOnAck {
		q.ack = fenced("= ANY($1)") + fmt.Sprintf(`,
d AS (DELETE FROM %[1]s o USING l WHERE o.id = l.id RETURNING o.key)%[2]s
SELECT count(*) FROM d`, t, unpark)
	}

	// A nack reschedules the row; with strict ordering it also parks the
	// pending rows of its key behind it, so that claims do not walk over
	// them while it waits for its retry. An ack of the key unparks them.
	q.nack = fenced("= $1") + fmt.Sprintf(`,
e AS (
    UPDATE %s o SET attempts = l.attempts, last_error = $3, due_at = $4
    FROM l WHERE o.id = l.id
    RETURNING o.id, o.key)`, t)
	if c.DisableStrictOrdering {
		q.nack += "\nSELECT count(*) FROM e"
	} else {
		q.nack += fmt.Sprintf(`
UPDATE %s p SET parked = true
FROM e WHERE p.key = e.key AND e.key <> '' AND p.status = 'pending' AND p.id > e.id AND NOT p.parked`, t)
	}

	// Release gives the claim's attempt back.
	q.release = fenced("= ANY($1)") + fmt.Sprintf(`
UPDATE %s o SET attempts = GREATEST(l.attempts - 1, 0), due_at = $3
FROM l WHERE o.id = l.id`, t)

	// A dead-lettered row holds nothing back: the next parked rows of its
	// key go back in line.
	q.deadLetter = fenced("= $1") + fmt.Sprintf(`,
d AS (
    UPDATE %s o SET status = 'dead', attempts = l.attempts, last_error = $3
    FROM l WHERE o.id = l.id
    RETURNING o.id, o.key)%s
SELECT count(*) FROM d`, t, unpark)

	// A lease that ran out is not extended, even when nobody took it over
	// yet: the forwarder may already have been overtaken.
	q.extend = fmt.Sprintf(`UPDATE %[1]s x SET leased_until = clock_timestamp() + $3::bigint * interval '1 microsecond'
WHERE x.id = ANY(ARRAY(
    SELECT y.id FROM %[1]s y WHERE y.id = ANY($1) AND y.leased_by = $2 AND y.leased_until > clock_timestamp()
    ORDER BY y.id FOR UPDATE))
RETURNING x.id`, leases)
	return q
}

// Claim implements [storage.Storage]. Without strict ordering it is one
// statement. With strict ordering it is a transaction of two: the walk
// locks the heads, then the claim, with a snapshot taken after the locks,
// leases them and the rows that follow them.
func (s *Storage) Claim(ctx context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	if p.BatchSize <= 0 || p.Lease <= 0 || p.WorkerID == "" {
		return nil, fmt.Errorf("claim outbox rows: need BatchSize > 0, Lease > 0 and a WorkerID (got %d, %s, %q)", p.BatchSize, p.Lease, p.WorkerID)
	}
	if s.config.DisableStrictOrdering {
		rows, err := s.pool.Query(ctx, s.q.claimAny, p.BatchSize, p.WorkerID, p.Lease.Microseconds())
		if err != nil {
			return nil, fmt.Errorf("claim outbox rows from %s: %w", s.table, err)
		}
		recs, _, err := scanClaimed(rows, s.table, p.BatchSize)
		return recs, err
	}
	var recs []storage.Record
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, s.q.walk, p.BatchSize)
		if err != nil {
			return err
		}
		heads, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil || len(heads) == 0 {
			return err
		}
		rows, err = tx.Query(ctx, s.q.claim, heads, p.WorkerID, p.BatchSize, p.Lease.Microseconds())
		if err != nil {
			return err
		}
		var broken []int64
		recs, broken, err = scanClaimed(rows, s.table, p.BatchSize)
		if err != nil || len(broken) == 0 {
			return err
		}
		_, err = tx.Exec(ctx, s.q.unlease, broken, p.WorkerID)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("claim outbox rows from %s: %w", s.table, err)
	}
	return recs, nil
}

// Ack implements [storage.Storage]: the whole batch in one statement.
func (s *Storage) Ack(ctx context.Context, p storage.AckParams) error {
	if len(p.IDs) == 0 {
		return nil
	}
	if err := s.exec(ctx, s.q.ack, p.IDs, p.WorkerID); err != nil {
		return fmt.Errorf("ack %d outbox rows in %s: %w", len(p.IDs), s.table, err)
	}
	return nil
}

// Nack implements [storage.Storage].
func (s *Storage) Nack(ctx context.Context, p storage.NackParams) error {
	if err := s.exec(ctx, s.q.nack, p.ID, p.WorkerID, p.Error, p.RetryAt); err != nil {
		return fmt.Errorf("nack outbox row %d in %s: %w", p.ID, s.table, err)
	}
	return nil
}

// Release implements [storage.Storage].
func (s *Storage) Release(ctx context.Context, p storage.ReleaseParams) error {
	if len(p.IDs) == 0 {
		return nil
	}
	if err := s.exec(ctx, s.q.release, p.IDs, p.WorkerID, p.RetryAt); err != nil {
		return fmt.Errorf("release %d outbox rows in %s: %w", len(p.IDs), s.table, err)
	}
	return nil
}

// DeadLetter implements [storage.Storage].
func (s *Storage) DeadLetter(ctx context.Context, p storage.DeadLetterParams) error {
	if err := s.exec(ctx, s.q.deadLetter, p.ID, p.WorkerID, p.Error); err != nil {
		return fmt.Errorf("dead-letter outbox row %d in %s: %w", p.ID, s.table, err)
	}
	return nil
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

// exec runs a write-back.
func (s *Storage) exec(ctx context.Context, sql string, args ...any) error {
	_, err := s.pool.Exec(ctx, sql, args...)
	return err
}
