package postgres

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox/storage"
)

// parkChunk is how many rows one statement parks at most (a nack's, a
// claim's): about half a second of work on a 2-core machine, far inside
// BookkeepingTimeout however long a key's backlog.
const parkChunk = 50000

// runKeys is how many keys of a strict claim's walk take the rows parked
// behind them along (an even share of the batch each): a claim after an
// outage takes runs of a few keys rather than one row of each, and a batch
// still fills the 16 lanes of the default Concurrency.
const runKeys = 16

// leadRows is how many rows at the head of a strict claim's walk are read for
// the keys that take parked rows along (the first runKeys keys among them),
// when some row is held. More than runKeys, so that keyless rows, or a key
// with many rows free, at the head of the walk leave room for keys with
// parked rows behind them; far fewer than a batch, which is what the walk read
// for them before (see followers in buildQueries).
const leadRows = 4 * runKeys

// flightSample is how many of the rows behind records in flight that its
// walk passed a claim told to look for them reads (see flight in
// buildQueries): about 1 ms.
const flightSample = 2000

// parkFlightMin is how many rows of one key among them make a claim park
// the key's backlog behind its records in flight (see flight in
// buildQueries). In a drain over many keys with several forwarders a claim
// passes a few rows of each key in flight, which cost less to walk again
// than to park; a hot key's backlog is most of the sample.
const parkFlightMin = 100

// walkFar is how many ids a claim's walk may span (from the lowest row not
// held to the last row it handed out) before the storage asks its next
// claim to look for rows behind records in flight (see Claim). Far below
// what a hot key's backlog spans, far above what a drain's claims span with
// a few batches in flight.
const walkFar = 10000

// slotCount is the number of key slots: the slot column of a row is the hash
// of its key (its id when keyless) modulo slotCount. Up to slotCount
// claimers get slots of their own.
const slotCount = 256

// memberTTL is how long a worker counts as claiming after its last claim, or
// its lease if that is longer (a round must end within its lease): long
// enough to cover a forwarder's idle poll (PollMax, 5s by default), short
// enough that the slots of a worker that stopped without [Storage.Leave] go
// to the others soon. A claim sets its worker row's seen_until to half a
// memberTTL beyond that, and writes it only when it is no longer between the
// two: a claim that finds nothing then usually writes nothing, so it commits
// without waiting for a WAL flush (an idle forwarder's poll, the empty claim
// after each batch at a low rate). A worker that stops without Leave keeps
// its slots for up to one and a half memberTTL (or its lease and half a
// memberTTL).
const memberTTL = 10 * time.Second

// queries holds the statements of one storage, built once in New.
type queries struct {
	claim, leanClaim, ack, nack, release string
	deadLetter                           string
	plan, planLock, leave, join          string
	writePlan, writePlanLock             string
	extend, wake, sweep, parkMore        string
	unparkCTEs                           string
	lockLeases                           string
}

// lockedByID is the UPDATE that sets free the rows of table t that the CTE
// locked (a MATERIALIZED CTE of the statement, with columns id, status and
// hold) and found still parked. The CTE locks its candidates by primary key
// alone and returns them as locked, and the UPDATE finds them by primary key
// alone: had either WHERE also said "hold = 'behind'", the held index could
// serve the ids too, read whole and checked entry by entry, and with
// statistics from a table with nothing held (before an outage, until the
// next ANALYZE) the planner chose that (TestHoldWritesFindRowsByPrimaryKey).
// A MATERIALIZED CTE, so that the check on what the row holds is not pushed
// down into the scan that locks.
func lockedByID(t, locked string) string {
	return fmt.Sprintf(`UPDATE %[1]s SET hold = NULL WHERE id = ANY(ARRAY(SELECT %[2]s.id FROM %[2]s WHERE %[2]s.status = 'pending' AND %[2]s.hold = 'behind'))`, t, locked)
}

func buildQueries(t, leases, workers, delivered string, strict bool, visibility time.Duration, deleteOnAck, holdDead, fence, prepared bool) queries {
	// A row is claimable when it is pending, due and not under a live lease.
	due := "o.due_at <= (SELECT t FROM clk)"
	if visibility > 0 {
		due += fmt.Sprintf(" AND o.created_at <= (SELECT t FROM clk) - interval '%d microseconds'", visibility.Microseconds())
	}
	// CommitFence: a row may go out only once no transaction older than its
	// producer's is still running (xmin of the statement's snapshot, read
	// once in clk). Ids are taken at insert and xids at a transaction's first
	// write, so a row that passes the fence can have a higher id than a row
	// of its key that does not (its transaction wrote something else first);
	// with strict ordering a fenced row therefore holds back the later rows
	// of its key that its claim walks (each walk is in id order, so those
	// come after it): blocked is true from a key's first fenced row on. A
	// keyless row is its own partition. The window returns the rows in key
	// order; they are put back in id order, on which the claim's prefixes of
	// the walk (lw and c) rely: in key order, the keys whose names sort first
	// went out first, and the oldest key could wait 40 claims.
	xmin, fenceOpen, fenceCol, fenceClose := "", "", "", ""
	// fenceClear: the row aliased o is clear of the fence.
	const fenceClear = "(o.created_xid IS NULL OR o.created_xid < (SELECT x FROM clk))"
	if fence {
		xmin = ", pg_snapshot_xmin(pg_current_snapshot()) AS x"
		fenceOpen = `
            SELECT * FROM (SELECT w.*, bool_or(NOT w.ok) OVER (
                PARTITION BY w.key, CASE WHEN w.key = '' THEN w.id END ORDER BY w.id) AS blocked FROM (`
		fenceCol = ",\n            " + fenceClear + " AS ok"
		fenceClose = ") w) b WHERE NOT b.blocked ORDER BY b.id"
	}
	// Strict ordering: what holds a row back. In flight: an earlier record
	// of its key under a live lease (hm, a map key -> the lowest leased id,
	// read once per claim from the lease table, which holds only the rows in
	// flight). Held: an earlier record of its key that waits for its retry or
	// is parked itself (hold set), or with HoldOnDeadLetter is dead or failed
	// before (a failed record is claimable itself, the records after it wait
	// until it is delivered). Each is one probe of a partial index that holds
	// only such rows (held_idx, dead_key_idx, failed_key_idx), keyed on
	// (key, id). The earlier rows of a key are written (key, id) < (the
	// row's key, id), which only that index can answer: with "id < the
	// row's id" the primary key answered it too, and a generic plan, with
	// statistics in which one key has most rows, walked the primary key back
	// from each candidate: 200 thousand rows a probe, 12 s a claim. The held
	// probe reads the nearest earlier held row, backwards from the row (a
	// range of (key, id) ordered by key and id descending, LIMIT 1, which
	// only held_idx can serve in that order; a scalar subquery, since EXISTS
	// drops ORDER BY and LIMIT): read forwards, with "key = the key", it
	// passed every held entry of the key before the row, and a key's next
	// row after a run of parked rows is walked and probed at every claim
	// (0.74 ms a probe with 10 hot keys after an outage; an EXISTS over the
	// range instead of the equality was planned as a primary-key scan).
	//
	// A row held that way is parked (hold 'behind') by the claim that meets
	// it, and leaves the walk: the claim then pays for the rows it hands out
	// and the rows in flight, not for the rows held back, however many. Only
	// a claim parks (under the advisory lock), and only behind a record that
	// nothing but a claim, or an operator's Skip under the same lock, can set
	// free: a waiting or parked record, a dead one. Behind a record in
	// flight a claim parks only a hot key's backlog, when told to look for
	// one (see flight in the claim), under a lock on every lease of the
	// key.
	//
	// The visibility delay needs no clause here: created_at is taken at
	// insert (clock_timestamp), so an earlier id is never younger than a row
	// that is old enough to claim.
	//
	// No statement parks a row below a lease of its key, live or run out:
	// a write-back sets free the first held row after the highest of its
	// rows of a key (see unpark), and a row parked between two records in
	// flight would be passed by an ack of both, and stay parked with
	// nothing but the sweep to set it free (the stress test found it: a
	// record taken along behind its head, nacked, then parked behind the
	// head's retry while a record after it was still in flight; a review,
	// the same through a nack's later parking statements, parkMore). Once
	// a row is parked, no row after it can be leased without it (the walk
	// holds them back, and a claim takes parked rows along only in a run
	// from the head), so a write-back of records of its key below it sets
	// free the first held row after them. (A record taken along behind its
	// head is parked while in flight: an ack of the records before and
	// after it, not of it, passes it, and should its lease then run out
	// with no ack, only the sweep sets it free. The forwarder acks a key's
	// records in order, so only another caller of the storage can do
	// that.)
	//
	// held(a, park) is that check for the row aliased a. When it decides a
	// parking (park), a parked or failed record holds its key only while it
	// has no lease, live or run out (a claim takes parked rows behind their
	// head without setting them free, see the claim): its owner's ack takes
	// no lock, is fenced on the lease's owner only, and could miss a row
	// parked behind it meanwhile.
	//
	// deadOrFailed (HoldOnDeadLetter): is an earlier record of the row
	// aliased a dead, or pending and failed before (and, with cond, more)?
	deadOrFailed := func(a, cond string) string {
		return fmt.Sprintf(`EXISTS (SELECT 1 FROM %[1]s e WHERE e.status = 'dead' AND e.key <> '' AND e.key = %[2]s.key AND (e.key, e.id) < (%[2]s.key, %[2]s.id))
              OR EXISTS (SELECT 1 FROM %[1]s e WHERE e.status = 'pending' AND e.key <> '' AND e.last_error IS NOT NULL AND e.key = %[2]s.key AND (e.key, e.id) < (%[2]s.key, %[2]s.id)%[3]s)`, t, a, cond)
	}
	held := func(a string, park bool) string {
		idle := ""
		if park {
			idle = fmt.Sprintf(" AND NOT EXISTS (SELECT 1 FROM %s y WHERE y.id = e.id)", leases)
		}
		q := fmt.Sprintf(`(SELECT e.id FROM %[1]s e WHERE e.status = 'pending' AND e.hold IS NOT NULL AND (e.key, e.id) < (%[2]s.key, %[2]s.id) AND e.key >= %[2]s.key%[3]s
              ORDER BY e.key DESC, e.id DESC LIMIT 1) IS NOT NULL`, t, a, idle)
		if holdDead {
			q += "\n              OR " + deadOrFailed(a, idle)
		}
		return "(" + q + ")"
	}
	// anyHeld: is any row held at all? Read once per statement, it spares
	// the probes above (and the parking walk) when nothing is held.
	holdSet := fmt.Sprintf(`EXISTS (SELECT 1 FROM %s WHERE status = 'pending' AND hold IS NOT NULL)`, t)
	anyHeld := holdSet
	if holdDead {
		anyHeld += fmt.Sprintf(`
    OR EXISTS (SELECT 1 FROM %[1]s WHERE status = 'dead' AND key <> '')
    OR EXISTS (SELECT 1 FROM %[1]s WHERE status = 'pending' AND key <> '' AND last_error IS NOT NULL)`, t)
	}
	// unpark sets free, for each key in d (a write-back's delivered or
	// dead-lettered rows, a re-driven or skipped one), the first held row
	// after its last row in d, when that row is parked. A claim then takes
	// it as the head of its key and the rows parked behind it with it (see
	// the claim), without setting them free one by one: after an outage,
	// each key costs a write per claim, not one per parked row. Setting a
	// row free never breaks order (a claim checks it again); the one set
	// free may be in flight already (a claim took it behind its head, and
	// this ack is of its head only), which is harmless: the ack of the
	// rest sets free the next one. The row is read from the held index
	// alone (the UPDATE leaves out a row waiting for a retry), as a range of
	// (key, id) that only that index can answer in order (see followers in
	// the claim): a generic plan walked the primary key in id order
	// instead, every pending row for each key (2.4 s an ack with 50
	// thousand rows parked). It skips a row another transaction holds and
	// never waits for one (see fenced): that transaction is delivering it
	// (its owner's ack, when it went out behind its head), parking it for a
	// retry, or setting it free itself (a sweep, another unpark); should it
	// roll back instead, the sweep sets the row free.
	//
	// The candidate is locked by its primary key alone (ul), and set free
	// if it is still parked as locked (see lockedByID). One found no longer
	// parked (waiting for its retry, say) stays locked until the commit and
	// is left as it is.
	unparkLock := fmt.Sprintf(`ul AS MATERIALIZED (
    SELECT u.id, u.status, u.hold FROM %[1]s u WHERE u.id = ANY(ARRAY(
        SELECT b.id FROM (SELECT d.key, max(d.id) AS id FROM d WHERE d.key <> '' AND %[2]s GROUP BY d.key) k
        CROSS JOIN LATERAL (
            SELECT b.id FROM %[1]s b WHERE b.status = 'pending' AND b.hold IS NOT NULL AND (b.key, b.id) > (k.key, k.id) AND b.key <= k.key
            ORDER BY b.key, b.id LIMIT 1) b))
    FOR UPDATE SKIP LOCKED)`, t, holdSet)
	unparkSet := lockedByID(t, "ul")
	// unparkCTEs: the unpark as the last CTEs of an operator's statement
	// whose CTE d returns the rows it changed (Skip, Redrive); nothing
	// without strict ordering, which parks nothing.
	unparkCTEs := ""
	if strict {
		unparkCTEs = fmt.Sprintf(",\n%s,\nu AS (%s)", unparkLock, unparkSet)
	}
	// Every write-back deletes the worker's lease and updates the outbox row
	// in one statement: the lease is the fence (a lease taken over by another
	// worker has another leased_by, and one this worker claimed again since
	// has other attempts, so the write-back matches nothing; see
	// storage.ClaimRef), and its attempts, which count claims whose lease ran
	// out, go to the row. ids selects the records by $1, one id or an array;
	// parameter $n holds the attempts their claims returned (an array in
	// the order of $1's).
	//
	// Many records are matched by a join on the pairs (id, attempts), so
	// that each pair finds its lease through the primary key: a condition
	// (x.id, x.attempts) IN (SELECT ... unnest) was planned as a nested
	// loop that compared every lease with every pair (Extend of 5,000
	// leases: 2.2 s).
	fenced := func(ids string, n int, returning string, locked bool) string {
		many := ids != "= $1"
		pairs := fmt.Sprintf("unnest($1::bigint[], $%d::integer[]) a (id, attempts)", n)
		if strict && locked {
			// An ack, and a dead-letter that sets free, lock their leases
			// in id order in a statement of their own before this one (see
			// lockLeases): they are its rows already, and the DELETE waits
			// for none.
			if many {
				return fmt.Sprintf(`WITH l AS (DELETE FROM %[1]s x USING %[2]s WHERE x.id = a.id AND x.attempts = a.attempts AND x.leased_by = $2 RETURNING %[3]s)
`, leases, pairs, returning)
			}
			return fmt.Sprintf(`WITH l AS (DELETE FROM %[1]s x WHERE x.id = $1 AND x.leased_by = $2 AND x.attempts = $%[3]d RETURNING %[2]s)
`, leases, returning, n)
		}
		if strict {
			// Strict claims hand out rows without locking them (the
			// advisory lock keeps claimers apart), so the lease is deleted
			// first and the outbox row updated after it: a claim that takes
			// over an expired lease waits for the DELETE and then finds the
			// lease gone.
			//
			// Why no two statements wait for each other in a circle, from
			// the SQL alone (no planner setting decides an order):
			//   - The advisory lock, where taken, comes first in its
			//     transaction.
			//   - Every statement that waits for lease rows locks them in
			//     id order: here k (ORDER BY id FOR UPDATE), or for an ack
			//     and a dead-letter that sets free the statement before
			//     (lockLeases), the claim's takeover (tk), Extend (k).
			//   - Only a write-back waits for outbox rows (operator
			//     statements aside, which wait for dead rows only), and only
			//     for rows whose lease it has locked and still holds (k): no
			//     other write-back can want them. It locks them in the order
			//     its DELETE returns them, which is free. Every other
			//     statement that locks outbox rows skips those another
			//     transaction holds and waits for none: the claim's wake,
			//     parking and sweep, the nack's parking, the unpark (of an
			//     ack, a dead-letter, an operator's Skip or Redrive). The
			//     unpark and the sweep may lock a row and leave it as it is
			//     (see lockedByID); each is the last step of its
			//     transaction, and waits for nothing once it holds one.
			//   - A claim holds no outbox row while its takeover waits,
			//     other than the rows its wake set free, which have no lease
			//     and so no write-back wants (its parking and its sweep
			//     come after the takeover).
			// (The DELETE alone locked the leases in the order of its scan:
			// id order through a plain index scan, heap order through a
			// bitmap scan, which only a planner setting kept away; and its
			// outbox rows then went in heap order too, against the nack's
			// parking, which waited for them in id order. Both deadlocks
			// were reproduced.)
			//
			// Nack and release also take the advisory lock (writeBack); an
			// ack and a dead-letter do not need it (a delivered or dead row
			// holds nothing back).
			k := fmt.Sprintf("SELECT x.id FROM %s x WHERE x.id = $1 AND x.leased_by = $2 AND x.attempts = $%d", leases, n)
			if many {
				k = fmt.Sprintf("SELECT x.id FROM %s x JOIN %s ON x.id = a.id AND x.attempts = a.attempts WHERE x.leased_by = $2", leases, pairs)
			}
			return fmt.Sprintf(`WITH k AS MATERIALIZED (%[2]s ORDER BY x.id FOR UPDATE OF x),
l AS (DELETE FROM %[1]s x WHERE x.id = ANY(ARRAY(SELECT k.id FROM k)) AND x.leased_by = $2 RETURNING %[3]s)
`, leases, k, returning)
		}
		// Claims without strict ordering run side by side and lock their
		// outbox rows (FOR UPDATE SKIP LOCKED) before leasing them, so a
		// write-back locks the outbox rows first too, in id order, then
		// deletes the lease: a write-back and a claim that takes over an
		// expired lease of the same row then wait for each other one way
		// only and never deadlock. The DELETE re-reads a lease updated
		// meanwhile, so a takeover committed while the write-back waited
		// fences it out. m carries the attempts of each claim, so that the
		// DELETE is still a plain join on m, which deletes (and locks) the
		// leases in m's id order.
		if many {
			return fmt.Sprintf(`WITH m AS (SELECT o.id, a.attempts FROM %s o JOIN %s ON a.id = o.id
    WHERE o.status = 'pending' ORDER BY o.id FOR UPDATE OF o),
l AS (DELETE FROM %s x USING m WHERE x.id = m.id AND x.leased_by = $2 AND x.attempts = m.attempts RETURNING %s)
`, t, pairs, leases, returning)
		}
		return fmt.Sprintf(`WITH m AS (SELECT id FROM %s WHERE id = $1 AND status = 'pending' ORDER BY id FOR UPDATE),
l AS (DELETE FROM %s x USING m WHERE x.id = m.id AND x.leased_by = $2 AND x.attempts = $%d RETURNING %s)
`, t, leases, n, returning)
	}
	// An ack deletes the outbox row and records the delivery in the narrow
	// delivered table: an UPDATE to status 'delivered' wrote a new version of
	// the whole row (payload and metadata included) and two index entries
	// (primary key, delivered index), never a HOT update since status is in
	// the partial indexes' predicates: 9.4 of the 15 ms of database time a
	// claim and ack of 1000 rows took, against about 6 now (BenchmarkClaimAck).
	// The delivered table keeps what Stats, Purge and an audit need, without
	// the payload; the outbox table holds only pending and dead rows.
	ack := fenced("= ANY($1)", 3, "x.id, x.attempts", false) + fmt.Sprintf(`, d AS (
    DELETE FROM %s o USING l WHERE o.id = l.id AND o.status = 'pending'
    RETURNING o.id, o.uuid, o.topic, o.key, o.created_at, l.attempts, o.last_error)
INSERT INTO %s (id, uuid, topic, key, created_at, delivered_at, attempts, last_error)
SELECT d.id, d.uuid, d.topic, d.key, d.created_at, now(), d.attempts, d.last_error FROM d`, t, delivered)
	if deleteOnAck {
		ack = fenced("= ANY($1)", 3, "x.id", false) + fmt.Sprintf(`DELETE FROM %s o USING l WHERE o.id = l.id AND o.status = 'pending'`, t)
	}
	deadLetter := fenced("= $1", 4, "x.id, x.attempts", false) + fmt.Sprintf(`UPDATE %s o SET status = 'dead', attempts = l.attempts, last_error = $3, dead_at = now()
FROM l WHERE o.id = l.id AND o.status = 'pending'`, t)
	sweepDead := ""
	if holdDead {
		sweepDead = fmt.Sprintf(`
      AND NOT EXISTS (SELECT 1 FROM %s e WHERE e.status = 'dead' AND e.key <> '' AND e.key = k.key AND (e.key, e.id) < (k.key, k.id))`, t)
	}
	// A nacked or released row due later waits in the retry index.
	nackSet := `attempts = l.attempts, last_error = $3, due_at = $4,
    hold = CASE WHEN $4::timestamptz > clock_timestamp() THEN 'retry' END`
	nack := fenced("= $1", 5, "x.id, x.attempts", false) + fmt.Sprintf(`UPDATE %s o SET %s
FROM l WHERE o.id = l.id AND o.status = 'pending'`, t, nackSet)
	parkMore := "" // strict ordering only
	releaseSet := `attempts = GREATEST(l.attempts - 1, 0), due_at = $3,
    hold = CASE WHEN $3::timestamptz > clock_timestamp() THEN 'retry'`
	release := fenced("= ANY($1)", 4, "x.id, x.attempts", false) + fmt.Sprintf(`UPDATE %s o SET %s END
FROM l WHERE o.id = l.id AND o.status = 'pending'`, t, releaseSet)
	if strict {
		// A nack that holds its key (a retry later, or a failure that
		// holds the key's later records with HoldOnDeadLetter) parks the
		// rows behind it at once (those after the last lease of its key,
		// see held: none of them is leased), parkChunk of them in the
		// nack's statement and the rest in further statements of parkChunk
		// each (parkMore, from Nack; each again after the last lease): an
		// outage parks each row once, when its key's head fails, not in the
		// claims that follow, and no statement grows with the backlog of a
		// key. Under the claim lock, like every parking (see writeBack).
		// Both return how many rows they found to park (not parked yet),
		// the last row they looked at, whether the head still holds its
		// key, and the key. (A nack again of a record whose rows are parked
		// already finds none and goes no further.) They skip a row another
		// transaction holds and never wait for one (see fenced): a former
		// owner's late ack deletes it, say, and locks its outbox rows in
		// the order its lease DELETE returns them; a row left unparked is
		// held back by every claim's walk all the same, and the claim
		// that meets it parks it.
		holds := "n.hold IS NOT NULL"
		headHolds := "h.hold IS NOT NULL"
		if holdDead {
			holds = "true"
			headHolds = fmt.Sprintf(`(h.hold IS NOT NULL OR (h.last_error IS NOT NULL
                AND NOT EXISTS (SELECT 1 FROM %s y WHERE y.id = h.id)))`, leases)
		}
		// afterLastLease is where a parking of key's rows starts: after the
		// row after, or after the key's last lease above it, live or run out
		// (no row is parked below a lease of its key, see held).
		afterLastLease := func(after, key string) string {
			return fmt.Sprintf(`GREATEST(%[1]s, (SELECT COALESCE(max(y.id), 0) FROM %[3]s y WHERE y.id > %[1]s AND y.key = %[2]s))`, after, key, leases)
		}
		parkRows := func(from string) string {
			return fmt.Sprintf(`p AS (
    UPDATE %[1]s f SET hold = 'behind'
    WHERE f.status = 'pending' AND f.hold IS NULL AND f.id = ANY(ARRAY(
        SELECT q.id FROM %[1]s q WHERE q.status = 'pending' AND q.hold IS NULL AND q.id = ANY(ARRAY(SELECT x.id FROM x))
        FOR UPDATE SKIP LOCKED)))
SELECT (SELECT count(*) FROM x WHERE x.hold IS NULL), (SELECT COALESCE(max(x.id), 0) FROM x), %[2]s, (SELECT COALESCE(min(x.key), '') FROM x)`, t, from)
		}
		nack = fenced("= $1", 5, "x.id, x.attempts", false) + fmt.Sprintf(`, n AS (
    UPDATE %[1]s o SET %[5]s
    FROM l WHERE o.id = l.id AND o.status = 'pending'
    RETURNING o.id, o.key, o.hold),
x AS (
    SELECT b.id, b.key, b.hold FROM n CROSS JOIN LATERAL (
        SELECT b.id, b.key, b.hold FROM %[1]s b WHERE b.status = 'pending' AND b.key <> '' AND b.key = n.key
          AND (b.key, b.id) > (n.key, %[6]s)
        ORDER BY b.id LIMIT %[2]d) b
    WHERE n.key <> '' AND %[3]s),
%[4]s`, t, parkChunk, holds, parkRows(fmt.Sprintf("(SELECT COALESCE(bool_or(%s), false) FROM n)", holds)), nackSet, afterLastLease("n.id", "n.key"))
		// The next parkChunk rows of key $1 after id $2, while the record
		// $3 still holds the key.
		parkMore = fmt.Sprintf(`WITH hd AS MATERIALIZED (
    SELECT COALESCE((SELECT %[3]s FROM %[1]s h WHERE h.id = $3 AND h.status = 'pending'), false) AS holds),
x AS (
    SELECT b.id, b.key, b.hold FROM %[1]s b
    WHERE (SELECT holds FROM hd) AND b.status = 'pending' AND b.key <> '' AND b.key = $1
      AND (b.key, b.id) > ($1::text, %[5]s)
    ORDER BY b.id LIMIT %[2]d),
%[4]s`, t, parkChunk, headHolds, parkRows("(SELECT holds FROM hd)"), afterLastLease("$2::bigint", "$1"))
		// Released rows behind a held record are parked at once, unless a
		// later record of their key is still leased (see held).
		release = fenced("= ANY($1)", 4, "x.id, x.attempts", false) + fmt.Sprintf(`UPDATE %s o SET %s WHEN o.key <> '' AND %s
        AND NOT EXISTS (SELECT 1 FROM %s y WHERE y.id > o.id AND y.key = o.key AND y.id NOT IN (SELECT l.id FROM l)) THEN 'behind' END
FROM l WHERE o.id = l.id AND o.status = 'pending'`, t, releaseSet, held("o", true), leases)
		// A delivered record sets free the rows parked behind it, and so
		// does a dead one unless dead records hold their key.
		ack = fenced("= ANY($1)", 3, "x.id, x.attempts", true) + fmt.Sprintf(`, d AS (
    DELETE FROM %s o USING l WHERE o.id = l.id AND o.status = 'pending'
    RETURNING o.id, o.uuid, o.topic, o.key, o.created_at, l.attempts, o.last_error),
i AS (
    INSERT INTO %s (id, uuid, topic, key, created_at, delivered_at, attempts, last_error)
    SELECT d.id, d.uuid, d.topic, d.key, d.created_at, now(), d.attempts, d.last_error FROM d),
%s
%s`, t, delivered, unparkLock, unparkSet)
		if deleteOnAck {
			ack = fenced("= ANY($1)", 3, "x.id", true) + fmt.Sprintf(`, d AS (DELETE FROM %s o USING l WHERE o.id = l.id AND o.status = 'pending' RETURNING o.id, o.key),
%s
%s`, t, unparkLock, unparkSet)
		}
		if !holdDead {
			deadLetter = fenced("= $1", 4, "x.id, x.attempts", true) + fmt.Sprintf(`, d AS (
    UPDATE %s o SET status = 'dead', attempts = l.attempts, last_error = $3, dead_at = now()
    FROM l WHERE o.id = l.id AND o.status = 'pending' RETURNING o.id, o.key),
%s
%s`, t, unparkLock, unparkSet)
		}
	}
	// leases maps every lease row's id to whether it is live at the claim's
	// clock reading. The lease rows from head on are read in id order (ORDER
	// BY id, with the claim's enable_sort off: a plain scan of the primary
	// key), as is lv in the strict claim. Above head too there are dead
	// versions of acked leases: while a record is in flight the head stays
	// at it, and every lease acked since is above it until VACUUM. A plain
	// index scan marks their index entries dead once no transaction can see
	// them, and the next claims skip them; a bitmap scan, which the planner
	// chose once the table had grown, visits every one of them again each
	// claim. With 45k leases acked above a record in flight a claim of 100
	// took 4.9 ms (strict; 3.3 ms without) against 1.5 ms with none, and
	// takes 1.9 ms (1.5 ms) now (TestClaimReadsLeasesOnceInIdOrder).
	leaseRows := fmt.Sprintf(`SELECT x.id, x.key, x.leased_until > (SELECT t FROM clk) AS live FROM %s x
    WHERE x.id >= (SELECT id FROM head)
    ORDER BY x.id`, leases)
	leaseMap := `(SELECT COALESCE(jsonb_object_agg(x.id::text, x.live), '{}') FROM (` + leaseRows + `) x)`
	// head is the lowest pending id. Every lease worth reading is above it
	// (a leased row is pending), and below it the lease table holds only the
	// dead versions of acked leases until VACUUM comes by, which at
	// thousands of messages a second is tens of thousands of them: the
	// lease table is read through its primary key from head on, never
	// scanned whole. (The slot condition, always true, makes the pending
	// index the one to read; see the claim without strict ordering.) The
	// wake reads the same id (lowestReady) for Claim's walkFar.
	lowestReady := fmt.Sprintf(`COALESCE((SELECT o.id FROM %s o
    WHERE o.status = 'pending' AND o.hold IS NULL AND o.slot BETWEEN (SELECT 0) AND (SELECT %d) ORDER BY o.id LIMIT 1), 0)`, t, slotCount-1)
	head := "head AS MATERIALIZED (SELECT " + lowestReady + " AS id),"
	leaseUntil := "(SELECT t FROM clk) + $3::bigint * interval '1 microsecond'"
	var claim, leanClaim string
	if strict {
		// Claims are serialised by the advisory lock and see every lease
		// committed before them, so the candidates need no row lock: a row
		// with no lease row gets one by a plain INSERT (nothing else inserts
		// leases meanwhile), and a row whose lease ran out is taken over by
		// an UPDATE of that lease. The takeover locks the leases first, in
		// id order (tk, which also locks the leases of the keys whose
		// backlog the claim parks, see flight: only the leases of rows it
		// hands out are taken over), waiting for those another transaction
		// holds, and re-checks them then: a lease its owner's write-back deleted
		// meanwhile is not taken over, and neither is a lease its owner
		// extended meanwhile (its clock read before the lease ran out, its
		// commit after this claim's snapshot). Either way the rows of its
		// key after it are neither taken over nor leased this time (lost):
		// an owner that extended is still publishing that record. (Until a
		// review found it, the next row of the key went out beside it.)
		// The takeover waits for a lease another transaction holds; it does
		// not skip it. Skipping let a claim take over a former owner's other
		// leases while that owner's late ack was halfway through them; the
		// new owner's ack then waited to unpark a row the late ack held,
		// while the late ack waited for a lease the new ack held (a review
		// reproduced the deadlock).
		//
		// Key slots: every row has a slot (hash of its key, or its id when
		// keyless; a generated column). The workers that claimed in the last
		// memberTTL, or in the last lease when that is longer (a round that
		// is still publishing holds its keys), and up to half a memberTTL
		// more (see memberTTL), share the slots: sorted by worker id,
		// each owns one contiguous range, and a claim walks the pending rows
		// of its own slots (the slot range is a condition on the pending
		// index, so other slots' rows cost no heap visit). Workers then hold
		// disjoint keys and do not walk each other's held rows. If its own
		// slots do not fill the batch, a claim also takes the first
		// claimable rows of the others' slots (two walks, below and above
		// its own range, so that the slot range is checked in the index
		// there too, each filtered before its LIMIT, so that rows leased by
		// their owner do not hide the claimable ones behind them): the rows
		// of a worker that died, other than those it still holds, go out at
		// once, and so does a small backlog whoever owns it. Which slots a worker walks never decides what is
		// claimable: every key lives in one slot, and the held-back check is
		// the same for all of them: the lease map is built from every live
		// lease and the probes read every held row, not the own slots' only, so that order
		// per key never rests on every row of a key having the same slot
		// (it would not, should hashtext change under a pg_upgrade with rows
		// pending).
		//
		// walk is one walk over the ready index: the rows of a slot range
		// that are due, not leased and not held back, in id order, at most
		// $1 (with CommitFence, up to the first fenced row of each key).
		// unleased(a): the row aliased a has no live lease (ls, the lease map).
		// ls and hm (a key's first live lease) are built from lv, one read of
		// the lease rows from head on, in id order (leaseRows, see leaseMap).
		unleased := func(a string) string {
			return fmt.Sprintf("NOT COALESCE(((SELECT m FROM ls) -> %s.id::text)::boolean, false)", a)
		}
		walk := func(slots string) string {
			return fmt.Sprintf(`%[1]s
        SELECT o.id, o.uuid, o.topic, o.key, o.payload, o.metadata, o.attempts, o.created_at,
            (SELECT m FROM ls) ? o.id::text AS expired%[2]s
        FROM %[3]s o
        WHERE o.status = 'pending' AND o.hold IS NULL AND o.slot BETWEEN %[4]s AND %[5]s
          AND %[8]s
          AND (o.key = '' OR (o.id < COALESCE(((SELECT m FROM hm) ->> o.key)::bigint, 9223372036854775807)
              AND (NOT (SELECT g FROM anyheld) OR NOT %[7]s)))
        ORDER BY o.id
        LIMIT $1%[6]s`, fenceOpen, fenceCol, t, slots, due, fenceClose, held("o", false), unleased("o"))
		}
		// bound: the last row the walk handed out, or every row when it did
		// not fill the batch (it walked them all).
		const bound = "(SELECT CASE WHEN count(*) < $1 THEN 9223372036854775807 ELSE max(cf.id) FILTER (WHERE cf.walked) END FROM cf)"
		// flight: a hot key's backlog behind its records in flight. A key
		// whose first record is in flight holds back every row behind it,
		// and without parking each claim walks past them all until the
		// key's backlog is delivered: one hot key with 200 thousand rows
		// behind its batch in flight made every claim take 65 ms instead of
		// 2. Parked, they leave the walk, and the ack of the key's last
		// record in flight sets the first of them free (unpark), which the
		// next claim takes with the rows parked behind it (followers), as
		// after an outage.
		//
		// Only when the storage asks ($4 > 0, see Claim: an earlier
		// claim's walk spanned more than walkFar ids). pf is a sample: the
		// first flightSample rows behind a record in flight that the walk
		// passed (up to bound), in every slot. hot is the keys with at least
		// $4 of them: a drain over many keys passes a few rows of each key
		// in flight, and parking them all sent four forwarders into the
		// outage's pace (a batch of 1000 at 1 ms went from 25k to 12k
		// messages a second). What is parked of a hot key is its rows after
		// its last lease (tk locks them all, see park) and after its last
		// held row, read through the key index, parkChunk at most; rows with
		// no lease row at all.
		flight := fmt.Sprintf(`pf AS MATERIALIZED (
    SELECT p.id, p.key FROM %[1]s p
    WHERE $4::integer > 0 AND p.status = 'pending' AND p.hold IS NULL AND p.key <> ''
      AND p.slot BETWEEN (SELECT 0) AND (SELECT %[2]d)
      AND p.id <= %[3]s
      AND p.id > COALESCE(((SELECT m FROM hm) ->> p.key)::bigint, 9223372036854775807)
      AND NOT (SELECT m FROM ls) ? p.id::text
    ORDER BY p.id
    LIMIT %[4]d),
hot AS MATERIALIZED (
    SELECT pf.key FROM pf GROUP BY pf.key HAVING count(*) >= $4::integer),`, t, slotCount-1, bound, flightSample)
		// The leases of the hot keys: every lease of each, live or run out,
		// locked with the takeover's (see tk in the claim), so that every
		// write-back that deletes one of them either comes before this claim
		// or sees what it parked. All of them, not only those from the head
		// on (as ls and hm read them): a record taken along behind its head
		// stays parked while in flight, and can be below the head once its
		// head is delivered.
		flightLeases := fmt.Sprintf(`
        UNION ALL
        SELECT x.id FROM %[1]s x
        WHERE EXISTS (SELECT 1 FROM hot) AND x.key = ANY(ARRAY(SELECT hot.key FROM hot))`, leases)
		// park parks what the claim found held back (it never waits for a
		// row: see below), at the end of the statement, after tk, which
		// it reads: every lease the claim waits for is locked before it
		// locks an outbox row. Two kinds of row:
		//
		// The held rows of the claimer's own slots that its walk passed (up
		// to bound), not in flight and at or above the last lease of their
		// key (lx, from lv: a row not held is at or above head; see held;
		// its own lease, run out, does not keep it from being parked),
		// parkChunk at most. (The CASE keeps the check a probe per row, as
		// in the walk, rather than a join with every held row.)
		//
		// The backlog of each hot key after its last lease, live or run
		// out, all of which tk locked, and after its last held row: the ack
		// of a key's records sets free the first held row after the highest
		// of its own ids, and would pass a row parked between two records in
		// flight (a review stranded one so, behind a record nacked or
		// released between two others), and a late ack of records taken
		// along behind their head, whose lease ran out, would miss a row
		// parked behind them if the claim did not wait for it (another
		// review). The lock is what makes parking behind a record in flight
		// safe:
		// its owner's ack takes no claim lock, and sets free the first row
		// parked behind it (unpark) as its snapshot shows them; an ack locks
		// its leases in a statement of its own before the one that deletes
		// them and reads what to set free (see Ack), so that either this
		// claim waited for the ack's commit and found the lease gone (and
		// parks nothing behind it), or the ack waited for this claim's
		// commit and its snapshot shows what it parked. (Should an ack of
		// the key's last record in flight still miss a parked row, when a
		// lease below the walk's head, not locked here, is the last to go,
		// the sweep sets the row free.)
		//
		// It skips rows that another transaction has locked and never waits
		// for one: the ack of a forwarder whose leases ran out locks its
		// lease rows and outbox rows one after the other, and could wait for
		// a lease this claim takes over (tk) while the claim waited for an
		// outbox row it deletes (a review reproduced that deadlock). A held
		// row left unparked stays out of the walk (the held probe), and a
		// later claim parks it.
		park := fmt.Sprintf(`lx AS MATERIALIZED (
    SELECT jsonb_object_agg(x.key, x.last) AS m FROM (
        SELECT lv.key, max(lv.id) AS last FROM lv WHERE lv.key <> '' GROUP BY lv.key) x),
park AS (
    UPDATE %[1]s parked SET hold = 'behind' WHERE parked.status = 'pending' AND parked.hold IS NULL AND parked.id = ANY(ARRAY(
        SELECT q.id FROM %[1]s q WHERE q.status = 'pending' AND q.hold IS NULL AND q.id = ANY(ARRAY(
            SELECT h.id FROM (
                SELECT h.id FROM %[1]s h
                WHERE (SELECT g FROM anyheld) AND h.status = 'pending' AND h.hold IS NULL AND h.key <> ''
                  AND h.slot BETWEEN (SELECT lo FROM own) AND (SELECT hi FROM own)
                  AND h.id <= %[4]s
                  AND h.id >= COALESCE(((SELECT m FROM lx) ->> h.key)::bigint, 0) AND %[5]s
                  AND CASE WHEN (SELECT g FROM anyheld) THEN %[2]s ELSE false END
                ORDER BY h.id
                LIMIT %[3]d) h
            UNION ALL
            SELECT r.id FROM (
                SELECT tk.key, max(tk.id) AS last FROM tk WHERE tk.key IN (SELECT hot.key FROM hot) GROUP BY tk.key) f
            CROSS JOIN LATERAL (
                SELECT b.id FROM %[1]s b
                WHERE b.status = 'pending' AND b.key <> '' AND b.key <= f.key
                  AND (b.key, b.id) > (f.key, GREATEST(f.last, COALESCE((
                      SELECT max(e.id) FROM %[1]s e WHERE e.status = 'pending' AND e.hold IS NOT NULL AND e.key = f.key), 0)))
                  AND b.hold IS NULL AND NOT (SELECT m FROM ls) ? b.id::text
                ORDER BY b.key, b.id
                LIMIT %[3]d) r))
        FOR UPDATE OF q SKIP LOCKED))),`, t, held("h", true), parkChunk, bound, unleased("h"))
		// lw: the walk's first leadRows rows (the same walk as c, in id
		// order, so they are the first rows of c), read only when something
		// is held. Their first runKeys keys (lead) take followers: the rows
		// parked right behind lw's last row of each key, in id order, as long
		// as they are parked, not in flight and due (and pass the fence; with
		// HoldOnDeadLetter no dead or failed record comes before them), an
		// even share of the batch per key at most. They go out with their
		// head and stay parked while in flight: the head's ack sets free
		// only the next parked row (unpark). cf is what the claim hands out:
		// the walk's rows and the followers, a key's rows together, keys in
		// the order of their first row, at most $1 (whatever is cut off is
		// the end of a key's rows, so its order holds); the walk's rows as
		// they are when there are no followers. Only ids are sorted (cut),
		// not the rows with their payloads. c, the walk, reads what the
		// followers leave of the batch, and never fewer rows than lw. After
		// an outage (every key's head set free, the rest parked) a claim
		// used to walk a whole batch of heads, of which cut kept the 16 that
		// lead the followers (8 of a claim's 27 ms under auto_explain); now
		// it walks leadRows rows twice. A claim can still come back short of
		// the batch, never wrong: when more than leadRows keyless rows, or
		// rows of keys with nothing parked, come first and the walk runs out
		// of rows before the batch is full, the keys with parked rows behind
		// them that it met after lw take none along this time.
		//
		// The rows of a key after its last walked row are written as a range
		// of (key, id), "(key, id) > (the key, last) AND key <= the key",
		// not as "key = the key AND id > last": with the equality, id order
		// was all the ORDER BY asked for, and with statistics in which one
		// key has most rows, the planner walked the primary key for it,
		// 50 thousand rows for each key (the range needs the key index's
		// order). ok is never NULL (hold is NULL for a row not parked, and
		// bool_and passes over NULLs).
		okFollower := "o.hold = 'behind' AND " + unleased("o") + " AND " + due
		if fence {
			okFollower += " AND " + fenceClear
		}
		if holdDead {
			okFollower += " AND NOT (" + deadOrFailed("o", "") + ")"
		}
		walks := fmt.Sprintf(`SELECT * FROM (%s) mine
    UNION ALL
    SELECT * FROM (%s) below
    UNION ALL
    SELECT * FROM (%s) above`, walk("(SELECT lo FROM own) AND (SELECT hi FROM own)"), walk("0 AND (SELECT lo FROM own) - 1"),
			walk(fmt.Sprintf("(SELECT hi FROM own) + 1 AND %d", slotCount-1)))
		followers := fmt.Sprintf(`lw AS MATERIALIZED (
    SELECT w.id, w.key FROM (
    %[4]s
    LIMIT LEAST($1, %[5]d)) w
    WHERE (SELECT g FROM anyheld)),
lead AS MATERIALIZED (
    SELECT lw.key, min(lw.id) AS first, max(lw.id) AS last FROM lw
    WHERE lw.key <> ''
    GROUP BY lw.key ORDER BY min(lw.id) LIMIT %[3]d),
f AS MATERIALIZED (
    SELECT r.id, r.uuid, r.topic, r.key, r.payload, r.metadata, r.attempts, r.created_at, r.expired, r.grp FROM lead
    CROSS JOIN LATERAL (
        SELECT w.* FROM (
            SELECT v.*, bool_and(v.ok) OVER (ORDER BY v.key, v.id) AS run FROM (
                SELECT o.id, o.uuid, o.topic, o.key, o.payload, o.metadata, o.attempts, o.created_at,
                    (SELECT m FROM ls) ? o.id::text AS expired, lead.first AS grp, COALESCE(%[2]s, false) AS ok
                FROM %[1]s o
                WHERE o.status = 'pending' AND o.key <> '' AND (o.key, o.id) > (lead.key, lead.last) AND o.key <= lead.key
                ORDER BY o.key, o.id
                LIMIT GREATEST($1 / (SELECT count(*) FROM lead), 1)) v) w
        WHERE w.run) r),
c AS MATERIALIZED (
    %[4]s
    LIMIT GREATEST($1 - (SELECT count(*) FROM f), LEAST($1, %[5]d))),
cut AS MATERIALIZED (
    SELECT x.id FROM (
        SELECT c.id, CASE WHEN c.key = '' THEN c.id ELSE min(c.id) OVER (PARTITION BY c.key) END AS grp FROM c
        UNION ALL
        SELECT f.id, f.grp FROM f) x
    ORDER BY x.grp, x.id
    LIMIT $1),
cf AS MATERIALIZED (
    SELECT c.id, c.uuid, c.topic, c.key, c.payload, c.metadata, c.attempts, c.created_at, c.expired, true AS walked FROM c
    WHERE NOT EXISTS (SELECT 1 FROM f) OR c.id IN (SELECT cut.id FROM cut)
    UNION ALL
    SELECT f.id, f.uuid, f.topic, f.key, f.payload, f.metadata, f.attempts, f.created_at, f.expired, false FROM f
    WHERE f.id IN (SELECT cut.id FROM cut)),`, t, okFollower, runKeys, walks, leadRows)
		// lean is the claim without the followers and the parking: cf is
		// the walk's first $1 rows (one copy of the walk; lw, lead, f, cut
		// and park are left out). A claim needs neither when no row is held
		// (nothing is parked, so no row follows a head, and nothing is to
		// park), and with nothing held the full claim hands out exactly the
		// rows the lean one does; but the full claim's plan is twice the
		// size, and a claim pays to start every node, read or not: 0.26 of
		// the 0.63 ms of server time a small claim took at the median
		// (docs/benchmarks.md, "The lean claim"). Which one a claim runs
		// is decided from the wake of an earlier claim (see Claim), which
		// can be stale. The lean one keeps order whatever it is told: its
		// walk checks in the statement itself what holds a row back
		// (anyheld, the held probes, the lease map), so rows held meanwhile
		// stay out; they are only not parked, and a head set free meanwhile
		// takes no parked rows along, until a full claim (the lean one's own
		// wake saw them held: usually the next claim).
		lean := fmt.Sprintf(`cf AS MATERIALIZED (
    SELECT c.id, c.uuid, c.topic, c.key, c.payload, c.metadata, c.attempts, c.created_at, c.expired FROM (
    %s
    LIMIT $1) c),`, walks)
		// The claim's last column, drained, says that it left no
		// claimable row out (see [Storage.ClaimDrained]): its walk handed
		// out fewer rows than asked, so it walked them all, nothing is
		// held, and no takeover was lost. With a row held, rows parked
		// behind a head that this claim did not lead could be left out, or
		// a key's followers cut at its share of the batch. A takeover lost
		// to its owner's write-back leaves the next row of its key out,
		// claimable once that write-back commits (rows lost to an extension
		// are not claimable, but a claim cannot tell the two apart). With
		// CommitFence never: the fence drops its rows after each walk's
		// LIMIT, so a walk that stopped at the batch can come back short (a
		// review found both).
		drained := "(SELECT count(*) FROM cf) < $1 AND NOT (SELECT g FROM anyheld) AND NOT EXISTS (SELECT 1 FROM lost)"
		if fence {
			drained = "false"
		}
		strictClaim := func(followers, flight, flightLeases, park string) string {
			return fmt.Sprintf(`WITH clk AS MATERIALIZED (SELECT clock_timestamp() AS t%[13]s),
hb AS (
    INSERT INTO %[7]s (worker_id, seen_until)
    SELECT $2, m.need + interval '%[14]d microseconds'
    FROM (SELECT (SELECT t FROM clk) + GREATEST(interval '%[8]d microseconds', $3::bigint * interval '1 microsecond') AS need) m
    WHERE NOT EXISTS (SELECT 1 FROM %[7]s WHERE worker_id = $2
        AND seen_until BETWEEN m.need AND m.need + interval '%[14]d microseconds')
    ON CONFLICT (worker_id) DO UPDATE SET seen_until = excluded.seen_until),
gone AS (
    DELETE FROM %[7]s WHERE seen_until < (SELECT t FROM clk) - interval '%[8]d microseconds' AND worker_id <> $2),
%[10]s
own AS MATERIALIZED (
    SELECT n.r * %[9]d / n.f AS lo, (n.r + 1) * %[9]d / n.f - 1 AS hi FROM (
        SELECT count(*) AS f, count(*) FILTER (WHERE w.id < $2) AS r FROM (
            SELECT worker_id AS id FROM %[7]s WHERE seen_until > (SELECT t FROM clk)
            UNION SELECT $2) w) n),
lv AS MATERIALIZED (
    %[5]s),
ls AS MATERIALIZED (
    SELECT COALESCE(jsonb_object_agg(lv.id::text, lv.live), '{}') AS m FROM lv),
hm AS MATERIALIZED (
    SELECT jsonb_object_agg(h.key, h.first) AS m FROM (
        SELECT lv.key, min(lv.id) AS first FROM lv WHERE lv.live AND lv.key <> '' GROUP BY lv.key) h),
anyheld AS MATERIALIZED (SELECT %[4]s AS g),
%[12]s
%[11]s
tk AS MATERIALIZED (
    SELECT l.id, l.key, l.leased_until <= (SELECT t FROM clk) AND l.id = ANY(ARRAY(SELECT cf.id FROM cf WHERE cf.expired)) AS takeover FROM %[2]s l
    WHERE l.id = ANY(ARRAY(SELECT cf.id FROM cf WHERE cf.expired%[15]s))
    ORDER BY l.id FOR UPDATE),
%[16]s
lost AS MATERIALIZED (
    SELECT cf.key, min(cf.id) AS id FROM cf
    WHERE cf.expired AND cf.key <> '' AND cf.id NOT IN (SELECT tk.id FROM tk WHERE tk.takeover)
    GROUP BY cf.key),
up AS (
    UPDATE %[2]s l SET leased_by = $2, leased_until = %[6]s, attempts = l.attempts + 1
    WHERE l.id = ANY(ARRAY(SELECT tk.id FROM tk WHERE tk.takeover AND NOT EXISTS (SELECT 1 FROM lost WHERE lost.key = tk.key AND lost.id < tk.id)))
      AND l.leased_until <= (SELECT t FROM clk)
    RETURNING l.id, l.attempts),
ins AS (
    INSERT INTO %[2]s (id, key, leased_by, leased_until, attempts)
    SELECT cf.id, cf.key, $2, %[6]s, cf.attempts + 1 FROM cf
    WHERE NOT cf.expired AND NOT EXISTS (SELECT 1 FROM lost WHERE lost.key = cf.key AND lost.id < cf.id)
    RETURNING id, attempts),
a AS (SELECT id, attempts FROM up UNION ALL SELECT id, attempts FROM ins)
SELECT cf.id, cf.uuid, cf.topic, cf.key, cf.payload, cf.metadata, a.attempts, cf.created_at,
    %[17]s AS drained
FROM a JOIN cf ON cf.id = a.id`, t, leases, due, anyHeld, leaseRows, leaseUntil, workers, memberTTL.Microseconds(), slotCount, head,
				flight, followers, xmin, (memberTTL / 2).Microseconds(), flightLeases, park, drained)
		}
		claim = strictClaim(followers, flight, flightLeases, park)
		leanClaim = strictClaim(lean, "", "", "")
	} else {
		// The slot condition is always true: it is there so that the planner
		// walks the pending index (where it is an index condition) rather
		// than the primary key, which also lists every delivered row; with
		// statistics taken when the table held only pending rows the two
		// looked alike and the primary key won.
		//
		// Claimers run side by side: each locks its candidates (FOR UPDATE
		// SKIP LOCKED, so they skip each other's rows) and leases them with
		// ON CONFLICT, which takes over a lease only once it has run out,
		// judged on the latest committed lease, so two claimers never both
		// hold a row even when one's snapshot predates the other's commit.
		nsDue := due
		if fence {
			nsDue += " AND " + fenceClear
		}
		claim = fmt.Sprintf(`WITH clk AS MATERIALIZED (SELECT clock_timestamp() AS t%[8]s),
%[7]s
c AS MATERIALIZED (
    SELECT o.id, o.uuid, o.topic, o.key, o.payload, o.metadata, o.attempts, o.created_at FROM %[1]s o
    WHERE o.status = 'pending' AND o.hold IS NULL AND o.slot BETWEEN (SELECT 0) AND (SELECT %[6]d) AND %[3]s
      AND NOT COALESCE((%[4]s -> o.id::text)::boolean, false)
    ORDER BY o.id
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED),
ins AS (
    INSERT INTO %[2]s AS l (id, key, leased_by, leased_until, attempts)
    SELECT c.id, c.key, $2, %[5]s, c.attempts + 1 FROM c
    ON CONFLICT (id) DO UPDATE SET leased_by = excluded.leased_by, leased_until = excluded.leased_until,
        attempts = l.attempts + 1
    WHERE l.leased_until <= excluded.leased_until - $3::bigint * interval '1 microsecond'
    RETURNING l.id, l.attempts)
SELECT c.id, c.uuid, c.topic, c.key, c.payload, c.metadata, ins.attempts, c.created_at,
    (SELECT count(*) FROM c) < $1 AS drained
FROM ins JOIN c ON c.id = ins.id`, t, leases, nsDue, leaseMap, leaseUntil, slotCount-1, head, xmin)
	}
	adopted, wakeOpen, wakeClose := "", "", ""
	if strict {
		adopted = " RETURNING 1"
		wakeOpen = ",\nwoken AS ("
		wakeClose = fmt.Sprintf(`)
SELECT %s
    OR EXISTS (SELECT 1 FROM adopt),
    %s`, anyHeld, lowestReady)
	}
	// The rows whose retry is due go back to the walk, the 10000 due
	// first at most per claim. Its own statement, before the claim's, so
	// that the claim sees them. (The clock is read once, in a subquery,
	// so that it bounds the scan of the retry index: compared row by row
	// it was a filter over every row waiting, 4 ms a claim with 10
	// thousand.)
	//
	// A row that a process of schema version 3 failed for later (it
	// knows no hold) is first given its hold, so that it holds its key
	// back: that process's nack takes the same lock, so none slips in
	// between this statement and the claim's.
	//
	// With strict ordering it also answers whether any row is held, as its
	// snapshot shows them (before what it sets free, and counting what it
	// adopts): when none is, the next claim is the lean one (see lean in the
	// claim, and Claim). And the lowest id of the rows not held (a probe of
	// the ready index, 0 when there is none): where a walk starts (see
	// walkFar).
	//
	// Each UPDATE changes the rows its subquery locked, found by their
	// primary key alone (see lockedByID): the subquery checked them as
	// locked, and they cannot change before the UPDATE. With the subquery's
	// conditions repeated in the UPDATE, the retry index (or the held one)
	// could serve the ids too, read whole and checked entry by entry, and
	// after an outage, with statistics from before it, the planner chose
	// that: one wake took 4.4 s with 200,000 rows parked.
	wake := fmt.Sprintf(`WITH adopt AS (
    UPDATE %[1]s SET hold = 'retry' WHERE id = ANY(ARRAY(
        SELECT id FROM %[1]s WHERE status = 'pending' AND hold IS NULL AND due_at > created_at AND due_at > (SELECT clock_timestamp())
        ORDER BY due_at LIMIT 10000 FOR UPDATE SKIP LOCKED))%[2]s)%[3]s
UPDATE %[1]s SET hold = NULL WHERE id = ANY(ARRAY(
    SELECT id FROM %[1]s WHERE status = 'pending' AND hold = 'retry' AND due_at <= (SELECT clock_timestamp())
    ORDER BY due_at LIMIT 10000 FOR UPDATE SKIP LOCKED))%[4]s`, t, adopted, wakeOpen, wakeClose)
	// The pairs (id, attempts) Extend's leases are matched on (see fenced):
	// without strict ordering, those of pending rows, whose outbox rows m
	// locks first (see extend).
	extendPairs := "unnest($1::bigint[], $4::integer[]) a (id, attempts)"
	extendOutbox := ""
	if !strict {
		extendOutbox = fmt.Sprintf(`
m AS MATERIALIZED (SELECT o.id, a.attempts FROM %s o JOIN %s ON a.id = o.id WHERE o.status = 'pending' ORDER BY o.id FOR UPDATE OF o),`, t, extendPairs)
		extendPairs = "m a"
	}
	// The settings of a claim's transaction (see plan below) and of a
	// write-back's, and the claim lock that planLock and writePlanLock add.
	genericPlan := ""
	if prepared {
		genericPlan = "set_config('plan_cache_mode', 'force_generic_plan', true), "
	}
	claimSettings := "SELECT set_config('synchronous_commit', 'off', true), " + genericPlan +
		"set_config('enable_sort', 'off', true), set_config('enable_nestloop', 'off', true), set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)"
	writeSettings := "SELECT set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)"
	claimLock := ", pg_advisory_xact_lock(hashtextextended('txoutbox claim ' || $1::regclass::oid::text, 0))"
	lockLeases := "" // strict ordering only
	if strict {
		// An ack (and a dead-letter that sets free) locks its leases in a
		// statement of its own, in id order, before the statement that
		// deletes them and reads what to set free, which then takes its
		// snapshot after every claim that locked one of them to park rows
		// behind it has committed (see flight in the claim).
		lockLeases = fmt.Sprintf(`SELECT count(*) FROM (SELECT x.id FROM %s x WHERE x.id = ANY($1) AND x.leased_by = $2 ORDER BY x.id FOR UPDATE) k`, leases)
	}
	return queries{
		lockLeases: lockLeases,

		// "Now" is one clock reading taken once the statement runs, after
		// its snapshot (and, with strict ordering, after the advisory lock):
		// not now(), the start of the transaction, which with strict ordering
		// is when the claimer began to wait for the lock. With that stale
		// now() a row committed meanwhile could be visible but not yet due
		// (its due_at is its producer's transaction start) while a later row
		// of its key, from a transaction that began earlier, was due: the
		// later row was handed out first. Every visible row committed before
		// this reading, so its default due time is behind it.
		//
		// The lease table is read once (an InitPlan: it holds only the rows
		// in flight, plus the leases of crashed workers until they are taken
		// over) into a jsonb object id -> whether the lease is live, and each
		// candidate costs one lookup in it, like the strict-ordering map: the
		// walk over the pending index then involves no join for the planner
		// to choose. The candidates are read with the columns handed out, so
		// the outbox rows are visited once.
		claim:     claim,
		leanClaim: leanClaim,

		ack: ack,

		// A nacked or released row due later waits in the retry index
		// (hold 'retry') until a claim finds it due (wake): it leaves the
		// walk.
		nack:     nack,
		parkMore: parkMore,

		// Release gives the claim's attempt back.
		release: release,

		wake: wake,

		deadLetter: deadLetter,

		unparkCTEs: unparkCTEs,

		// sweep sets free the first held row of every key when it is parked
		// with nothing before it that holds it back: no pending row (in
		// flight, or due), no dead one with HoldOnDeadLetter. (A claim takes
		// the rows parked behind it along.) Every write-back that removes
		// what a row was parked behind sets it free itself; this is for the
		// rows whose head a process of an earlier schema version delivered
		// (it knows no parking). It reads the first held row of each key (a
		// walk over held_idx key by key: one probe a held key, not one a held
		// row). It skips the rows another transaction holds (an ack deleting
		// a follower, parked while in flight) and never waits for one: a
		// later sweep sets free what is still parked then.
		sweep: fmt.Sprintf(`WITH RECURSIVE k AS (
    (SELECT h.key, h.id, h.hold FROM %[1]s h WHERE h.status = 'pending' AND h.hold IS NOT NULL ORDER BY h.key, h.id LIMIT 1)
    UNION ALL
    SELECT n.key, n.id, n.hold FROM k CROSS JOIN LATERAL (
        SELECT h.key, h.id, h.hold FROM %[1]s h WHERE h.status = 'pending' AND h.hold IS NOT NULL AND h.key > k.key
        ORDER BY h.key, h.id LIMIT 1) n),
sl AS MATERIALIZED (
    SELECT o.id, o.status, o.hold FROM %[1]s o WHERE o.id = ANY(ARRAY(
        SELECT k.id FROM k
        WHERE k.hold = 'behind' AND k.key <> ''
          AND NOT EXISTS (SELECT 1 FROM %[1]s e WHERE e.status = 'pending' AND e.key <> '' AND e.key = k.key AND (e.key, e.id) < (k.key, k.id))%[2]s))
    FOR UPDATE SKIP LOCKED)
%[3]s`, t, sweepDead, lockedByID(t, "sl")),

		// The claim must walk the pending index in id order and stop after
		// the batch. With statistics from when the table held few pending
		// rows (a backlog that grew faster than autovacuum's ANALYZE: right
		// after an outage, or a fresh table) the planner preferred reading
		// every pending row and sorting them (on disk, payloads included):
		// 70 ms instead of 19 for 1000 rows over a 30k backlog, and growing
		// with it. Sorting is turned off for the claim's transaction only
		// (is_local: the settings and the claim are sent as one batch, one
		// round trip, which PostgreSQL runs as one implicit transaction).
		//
		// The same stale estimates (one candidate row) made the generic plan
		// of the prepared statement join the 1000 leases to the 1000
		// candidates with a nested loop: a million comparisons, 200-430 ms
		// per claim (auto_explain, "Rows Removed by Join Filter: 999000").
		// Nested loops are turned off too: the claim has no other join.
		//
		// Sequential scans are off too: a cached plan made while the lease
		// table was small would go on scanning it whole once it has grown
		// dead rows between two VACUUMs.
		//
		// And JIT: a disabled plan node costs 1e10 in the planner's
		// arithmetic, far above jit_above_cost, and compiling the claim with
		// LLVM took 600 ms for a claim that runs in under one.
		//
		// Where the pool prepares statements (pgx's default exec mode:
		// prepared), the claim runs on the generic plan of its prepared
		// statement (plan_cache_mode), made once per connection and again
		// whenever PostgreSQL drops it (an ANALYZE of a table it reads, DDL).
		// Left to choose from the costs of its first executions, PostgreSQL
		// could plan the full strict claim (anything held) anew at every
		// claim: 29 plannings for 28 claims, 3.3 ms each on top of 1.6 ms of
		// execution, with 200k rows parked behind a record in flight, and the
		// claim took 5.5 ms instead of 2.1 (TestClaimCostWithHeldRows failed
		// a CI run on it). In the extended protocol's other exec modes the
		// statement is unnamed and planned at every execution anyway, best
		// with its parameters; the simple protocol sends the values in the
		// SQL text. No setting there.
		//
		// Bitmap scans are allowed: the claim's row locks do not depend on
		// the scan. Its takeover locks leases in id order by its SQL (tk),
		// and its parking, its sweep and its wake skip the rows another
		// transaction holds.
		//
		// The claim's transaction commits without waiting for its WAL to
		// reach the disk (synchronous_commit off for it alone): a claim is
		// on the way of every record from its producer's commit to its
		// publish, and a flush that waits behind a busy disk (a producer's
		// commit, an ack's) held the record back that long, and, with
		// strict ordering, every other claimer waiting for the claim lock,
		// which a transaction holds until its commit is done. What a
		// server crash can lose is the last claims before it, never an
		// ack: WAL is written in order, so an ack's flush makes the claims
		// committed before it durable too. A claim lost that way leaves its
		// records claimable again after the restart: published twice, and
		// each key's first deliveries still in order (a forwarder publishes
		// a key's records in id order and claims none behind a record
		// another holds).
		plan:     claimSettings,
		planLock: claimSettings + claimLock,

		// Write-backs read the lease table by id; with a plan cached while
		// it was small they would scan it whole (see plan). They lock lease
		// rows in id order by their SQL (see fenced), so any index scan
		// will do: locking first costs an ack of 1000 rows about 0.5 ms
		// (BenchmarkClaimAck, strict: 6.3-6.5 ms against 5.6-6.2; see
		// docs/benchmarks.md for the drains).
		writePlan:     writeSettings,
		writePlanLock: writeSettings + claimLock,

		// A lease that ran out is not extended, even when nobody took it
		// over yet: the forwarder may already have been overtaken. The clock
		// is read once, so that the leases of a claim (which run out
		// together) are extended all or none: read row by row, a statement
		// that ran at the instant they ran out extended the first rows of a
		// key and not the later ones, which a claim could then take over
		// while the first was still leased.
		//
		// The leases are locked in id order first (ORDER BY id FOR UPDATE,
		// whichever scan reads them), the order of an ack's and a claim's
		// takeover: without it the planner read a lease table of 2000 rows
		// with a sequential scan for 1000 ids, in heap order, which after a
		// takeover or an extension is not id order, and an extension
		// racing its own forwarder's ack of the same records could
		// deadlock. It waits rather than skipping a lease held elsewhere: a
		// former owner's late write-back keeps the lock of a lease it no
		// longer matches until it commits, and a lease skipped would read
		// as lost to the forwarder that holds it.
		//
		// Without strict ordering a write-back locks its outbox rows first
		// (see fenced) and deletes the leases in the order its plan reads
		// them, so Extend locks the outbox rows first too, in id order: an
		// ack and an extension of the same records then queue on the first
		// outbox row they share and never hold lease rows the other wants.
		extend: fmt.Sprintf(`WITH n AS MATERIALIZED (SELECT clock_timestamp() AS t),%[2]s
k AS MATERIALIZED (
    SELECT x.id FROM %[1]s x JOIN %[3]s ON x.id = a.id AND x.attempts = a.attempts
    WHERE x.leased_by = $2 AND x.leased_until > (SELECT t FROM n)
    ORDER BY x.id FOR UPDATE OF x)
UPDATE %[1]s x SET leased_until = (SELECT t FROM n) + $3::bigint * interval '1 microsecond'
WHERE x.id = ANY(ARRAY(SELECT k.id FROM k)) AND x.leased_by = $2 AND x.leased_until > (SELECT t FROM n)
RETURNING x.id`, leases, extendOutbox, extendPairs),

		leave: fmt.Sprintf("DELETE FROM %s WHERE worker_id = $1", workers),
		join: fmt.Sprintf(`INSERT INTO %s (worker_id, seen_until) VALUES ($1, clock_timestamp() + interval '%d microseconds')
ON CONFLICT (worker_id) DO UPDATE SET seen_until = GREATEST(%[1]s.seen_until, excluded.seen_until)`, workers, memberTTL.Microseconds()),
	}
}

// Claim implements [storage.Storage]: [Storage.ClaimDrained] without its
// report.
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Claim(ctx context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	recs, _, err := s.ClaimDrained(ctx, p)
	return recs, err
}

// ClaimDrained implements [storage.DrainClaimer]. It sends the planner
// settings (with strict ordering also the advisory lock) and the claim as
// one batch: one round trip, one implicit transaction, and the claim's
// snapshot is taken after the lock is held. It reports drained when the
// claim's walk handed out fewer rows than asked and, with strict ordering,
// no row is held back (parked, waiting for a retry, or dead or failed with
// HoldOnDeadLetter) and no takeover was lost; never with strict ordering
// and CommitFence. A forwarder that claims while records are held does
// not pace its claims.
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) ClaimDrained(ctx context.Context, p storage.ClaimParams) (_ []storage.Record, drained bool, err error) {
	if p.BatchSize <= 0 || p.Lease <= 0 || p.WorkerID == "" {
		return nil, false, fmt.Errorf("claim outbox rows: need BatchSize > 0, Lease > 0 and a WorkerID (got %d, %s, %q)", p.BatchSize, p.Lease, p.WorkerID)
	}
	args := []any{p.BatchSize, p.WorkerID, p.Lease.Microseconds()}
	b := &pgx.Batch{}
	if s.config.DisableStrictOrdering {
		b.Queue(s.q.plan)
	} else {
		b.Queue(s.q.planLock, s.table)
	}
	b.Queue(s.q.wake)
	// With strict ordering the claim is the lean one when the wake of an
	// earlier claim found nothing held and that claim's walk did not span
	// far. Otherwise it is the full one, told ($4) whether to look for a hot
	// key's backlog behind its records in flight to park, and how many rows
	// of the sample make a key hot: when the earlier walk spanned more than
	// walkFar ids, which is what such a backlog looks like. Both answers can be stale: another storage's
	// nack since, say, or, with claims of this storage running side by
	// side, the answer of a wake that ran before this storage's own nack,
	// stored after it. Either claim keeps order all the same (see lean in
	// buildQueries); what a stale answer costs is a walk that parks nothing.
	// This claim's answers replace them.
	claim := s.q.claim
	far := s.walkedFar.Load()
	if s.q.leanClaim != "" {
		switch {
		case s.nothingHeld.Load() && !far:
			claim = s.q.leanClaim
		case far:
			args = append(args, s.parkFlightMin)
		default:
			args = append(args, 0)
		}
	}
	b.Queue(claim, args...)
	// The sweep comes after the claim, so that it holds no row while the
	// claim's takeover waits for a lease: a late ack holding that lease
	// could need a row the sweep locked (a review reproduced the deadlock).
	// The rows it sets free go out with the next claim.
	sweep := s.sweepDue()
	if sweep {
		b.Queue(s.q.sweep)
	}
	br := s.pool.SendBatch(ctx, b)
	defer br.Close() //nolint:errcheck // the results are read and checked below; Close would repeat their error
	if sweep {
		// A claim that fails rolls its sweep back: the next one sweeps.
		defer func() {
			if err != nil {
				s.nextSweep.Store(0)
			}
		}()
	}
	if _, err := br.Exec(); err != nil {
		return nil, false, fmt.Errorf("claim outbox rows from %s: planner settings or advisory lock: %w", s.table, err)
	}
	var held bool
	var head int64
	if s.q.leanClaim == "" {
		_, err = br.Exec()
	} else {
		err = br.QueryRow().Scan(&held, &head)
	}
	if err != nil {
		return nil, false, fmt.Errorf("claim outbox rows from %s: wake the rows due for a retry: %w", s.table, err)
	}
	rows, err := br.Query()
	if err != nil {
		return nil, false, fmt.Errorf("claim outbox rows from %s: %w", s.table, err)
	}
	recs, drained, err := scanClaimed(rows, s.table, p.BatchSize)
	if err != nil {
		return nil, false, err
	}
	if s.q.leanClaim != "" {
		// A claim that looked for rows behind records in flight may have
		// parked some, after its wake looked: the next claim is a full one,
		// which takes them along when their head is set free. The span of
		// this claim's walk: from the lowest row not held to the last row
		// it handed out (a claim that found nothing tells nothing: an idle
		// poll, or a backlog all behind records in flight, which the next
		// rows written after it show).
		s.nothingHeld.Store(!held && !far)
		s.walkedFar.Store(len(recs) > 0 && head > 0 && recs[len(recs)-1].ID-head > walkFar)
	}
	if sweep {
		if _, err := br.Exec(); err != nil {
			return nil, false, fmt.Errorf("claim outbox rows from %s: set free parked rows nothing holds: %w", s.table, err)
		}
	}
	// The batch is one implicit transaction, committed at its end: a failed
	// commit means the leases were not taken, so the records must not be
	// handed out.
	if err := br.Close(); err != nil {
		return nil, false, fmt.Errorf("claim outbox rows from %s: commit: %w", s.table, err)
	}
	return recs, drained, nil
}

// sweepEvery is how often a storage's claims look for parked rows that
// nothing holds back (see queries.sweep).
var sweepEvery = time.Minute

// sweepDue reports whether this claim sweeps, and if so moves the next sweep
// on (strict ordering only: nothing is parked without it).
func (s *Storage) sweepDue() bool {
	if s.config.DisableStrictOrdering {
		return false
	}
	now := time.Now().UnixNano()
	next := s.nextSweep.Load()
	return now >= next && s.nextSweep.CompareAndSwap(next, now+sweepEvery.Nanoseconds())
}

// Ack implements [storage.Storage]: the whole batch in one statement.
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Ack(ctx context.Context, p storage.AckParams) error {
	if len(p.Records) == 0 {
		return nil
	}
	ids, attempts := splitRefs(p.Records)
	if err := s.setFree(ctx, ids, p.WorkerID, s.q.ack, ids, p.WorkerID, attempts); err != nil {
		return fmt.Errorf("ack %d outbox rows in %s: %w", len(p.Records), s.table, err)
	}
	return nil
}

// setFree runs a write-back that deletes the leases of ids held by worker
// and sets free the rows parked behind them: with strict ordering the leases
// are locked first, in a statement of their own (see lockLeases), so that
// sql reads the parked rows in a snapshot taken once they are locked. One
// round trip, one (implicit) transaction.
func (s *Storage) setFree(ctx context.Context, ids []int64, worker, sql string, args ...any) error {
	b := &pgx.Batch{}
	b.Queue(s.q.writePlan)
	if s.q.lockLeases != "" {
		b.Queue(s.q.lockLeases, ids, worker)
	}
	b.Queue(sql, args...)
	return s.pool.SendBatch(ctx, b).Close()
}

// Nack implements [storage.Storage].
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Nack(ctx context.Context, p storage.NackParams) error {
	if s.config.DisableStrictOrdering {
		if err := s.writeBack(ctx, s.q.nack, p.Record.ID, p.WorkerID, p.Error, p.RetryAt, p.Record.Attempt); err != nil {
			return fmt.Errorf("nack outbox row %d in %s: %w", p.Record.ID, s.table, err)
		}
		return nil
	}
	// With strict ordering the nack parks the rows behind the record (see
	// buildQueries), parkChunk per statement, each its own transaction under
	// the claim lock, so that claims go on between them. The nack itself is
	// the first; the rest is best effort (a claim parks what is left, as it
	// meets it), and stops when ctx is done.
	found, last, holds, key, err := s.park(ctx, s.q.nack, p.Record.ID, p.WorkerID, p.Error, p.RetryAt, p.Record.Attempt)
	s.nothingHeld.Store(false) // the record and the rows behind it may be held now
	if err != nil {
		return fmt.Errorf("nack outbox row %d in %s: %w", p.Record.ID, s.table, err)
	}
	for found == parkChunk && holds && ctx.Err() == nil {
		if found, last, holds, _, err = s.park(ctx, s.q.parkMore, key, last, p.Record.ID); err != nil {
			return nil //nolint:nilerr // the nack is done; the claims park the rest
		}
	}
	return nil
}

// park runs a parking statement (the nack, or parkMore) under the claim
// lock and returns how many rows it found to park, the last row it looked
// at, whether the record they are parked behind still holds its key, and
// the key.
func (s *Storage) park(ctx context.Context, sql string, args ...any) (found, last int64, holds bool, key string, err error) {
	err = s.queryRow(ctx, true, []any{&found, &last, &holds, &key}, sql, args...)
	return found, last, holds, key, err
}

// Release implements [storage.Storage].
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Release(ctx context.Context, p storage.ReleaseParams) error {
	if len(p.Records) == 0 {
		return nil
	}
	ids, attempts := splitRefs(p.Records)
	err := s.writeBack(ctx, s.q.release, ids, p.WorkerID, p.RetryAt, attempts)
	s.nothingHeld.Store(false) // the rows may wait for their retry now
	if err != nil {
		return fmt.Errorf("release %d outbox rows in %s: %w", len(p.Records), s.table, err)
	}
	return nil
}

// DeadLetter implements [storage.Storage].
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) DeadLetter(ctx context.Context, p storage.DeadLetterParams) error {
	// Without HoldOnDeadLetter no advisory lock: a dead row holds nothing
	// back, so a claim running meanwhile may hand out the next row of its
	// key either way. With it, the lock: a claim that saw the row's lease
	// run out could otherwise fail to take it over (the dead-letter deleted
	// the lease) and still hand out the next row of its key.
	lock := s.config.HoldOnDeadLetter && !s.config.DisableStrictOrdering
	var err error
	if lock {
		err = s.exec(ctx, true, s.q.deadLetter, p.Record.ID, p.WorkerID, p.Error, p.Record.Attempt)
		s.nothingHeld.Store(false) // the dead record holds its key now
	} else {
		// It sets free the rows parked behind the record, as an ack does.
		err = s.setFree(ctx, []int64{p.Record.ID}, p.WorkerID, s.q.deadLetter, p.Record.ID, p.WorkerID, p.Error, p.Record.Attempt)
	}
	if err != nil {
		return fmt.Errorf("dead-letter outbox row %d in %s: %w", p.Record.ID, s.table, err)
	}
	return nil
}

// Extend implements [storage.Storage].
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Extend(ctx context.Context, p storage.ExtendParams) ([]int64, error) {
	if p.Lease <= 0 {
		return nil, fmt.Errorf("extend outbox leases in %s: Lease must be > 0, got %s", s.table, p.Lease)
	}
	if len(p.Records) == 0 {
		return nil, nil
	}
	ids, attempts := splitRefs(p.Records)
	rows, err := s.pool.Query(ctx, s.q.extend, ids, p.WorkerID, p.Lease.Microseconds(), attempts)
	if err != nil {
		return nil, fmt.Errorf("extend the lease of %d outbox rows in %s: %w", len(p.Records), s.table, err)
	}
	extended, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("extend the lease of %d outbox rows in %s: %w", len(p.Records), s.table, err)
	}
	return extended, nil
}

// splitRefs returns the ids of refs and, in the same order, the attempts
// their claims returned: the two arrays a fenced write-back takes.
func splitRefs(refs []storage.ClaimRef) (ids []int64, attempts []int) {
	ids = make([]int64, len(refs))
	attempts = make([]int, len(refs))
	for i, r := range refs {
		ids[i] = r.ID
		attempts[i] = r.Attempt
	}
	return ids, attempts
}

// writeBack runs a statement that makes leased rows unclaimable until a retry
// time. With strict ordering it takes the claim lock first: a claim running
// meanwhile could otherwise see such a row as claimable in its snapshot (its
// lease expired), fail to take it over (the write-back deleted the lease),
// and still hand out a later row of the same key, which its snapshot shows
// as not held back.
func (s *Storage) writeBack(ctx context.Context, sql string, args ...any) error {
	return s.exec(ctx, !s.config.DisableStrictOrdering, sql, args...)
}

// exec runs a write-back with the planner settings and, when lock is set,
// the advisory lock first: one round trip, one (implicit) transaction.
func (s *Storage) exec(ctx context.Context, lock bool, sql string, args ...any) error {
	return s.pool.SendBatch(ctx, s.writeBatch(lock, sql, args...)).Close()
}

// queryRow is exec for a statement that returns one row, scanned into dest.
func (s *Storage) queryRow(ctx context.Context, lock bool, dest []any, sql string, args ...any) error {
	br := s.pool.SendBatch(ctx, s.writeBatch(lock, sql, args...))
	_, err := br.Exec()
	if err == nil {
		err = br.QueryRow().Scan(dest...)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return err
}

// writeBatch is the planner settings (and the claim lock when lock is set),
// then sql: one round trip, one implicit transaction.
func (s *Storage) writeBatch(lock bool, sql string, args ...any) *pgx.Batch {
	b := &pgx.Batch{}
	if lock {
		b.Queue(s.q.writePlanLock, s.table)
	} else {
		b.Queue(s.q.writePlan)
	}
	b.Queue(sql, args...)
	return b
}

// Join implements [storage.Membership] (a no-op without strict ordering,
// which has no key slots to share): the worker counts as a claimer for
// memberTTL from now, so that the others leave it its share of the key slots
// from their next claim on. A claim joins too; the forwarder calls Join when
// Run starts, so that forwarders started together do not all claim from
// every slot at first.
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Join(ctx context.Context, workerID string) error {
	if s.config.DisableStrictOrdering {
		return nil // without strict ordering there are no key slots to share
	}
	if _, err := s.pool.Exec(ctx, s.q.join, workerID); err != nil {
		return fmt.Errorf("join %s as worker %q: %w", s.workers, workerID, err)
	}
	return nil
}

// Leave implements [storage.Membership]: the worker stops counting as a
// claimer at once, so the other workers share its key slots from their next
// claim on instead of after memberTTL. The forwarder calls it when Run
// returns.
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Leave(ctx context.Context, workerID string) error {
	if s.config.DisableStrictOrdering {
		return nil
	}
	if _, err := s.pool.Exec(ctx, s.q.leave, workerID); err != nil {
		return fmt.Errorf("leave %s as worker %q: %w", s.workers, workerID, err)
	}
	return nil
}
