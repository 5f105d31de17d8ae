package mysql

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/txoutbox/txoutbox/storage"
)

// followerProbes is the most heads whose followers are read with one
// subquery each; past it, one range read covers them all.
const followerProbes = 32

// candidate is a row the claim's walk locked.
type candidate struct {
	id   int64
	key  string
	live bool // leased, and the lease has not run out
	// failed: the row has a last error (with HoldOnDeadLetter, a failed row
	// is claimed without the later rows of its key).
	failed bool
}

// Claim implements [storage.Storage]. It runs in one READ COMMITTED
// transaction whose locking reads skip locked rows, run again at once if
// InnoDB rolls it back as a deadlock victim. docs/design.md describes the
// steps.
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Claim(ctx context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	if p.BatchSize <= 0 || p.Lease <= 0 {
		return nil, fmt.Errorf("claim outbox rows: batch size %d and lease %s must be > 0", p.BatchSize, p.Lease)
	}
	if err := checkWorker(p.WorkerID); err != nil {
		return nil, fmt.Errorf("claim outbox rows: %w", err)
	}
	if err := s.sweepIfDue(ctx); err != nil {
		return nil, fmt.Errorf("claim outbox rows from %s: sweep parked rows: %w", s.table, err)
	}
	var out []storage.Record
	var err error
	// A claim InnoDB rolled back as a deadlock victim runs again at once
	// (see docs/design.md, Locks and deadlocks), counted.
	for attempt := 1; ; attempt++ {
		err = s.tryTx(ctx, func(tx *sql.Tx) error {
			var err error
			out, err = s.claim(ctx, tx, p)
			return err
		})
		if attempt == deadlockAttempts || !s.retryable(err) {
			break
		}
		s.claimDeadlocks.Add(1)
	}
	if err != nil {
		return nil, fmt.Errorf("claim outbox rows from %s: %w", s.table, err)
	}
	return out, nil
}

func checkWorker(id string) error {
	if !utf8.ValidString(id) || utf8.RuneCountInString(id) > maxTextLen {
		return fmt.Errorf("worker id %q: must be valid UTF-8 of at most %d characters", id, maxTextLen)
	}
	return nil
}

func (s *Storage) claim(ctx context.Context, tx *sql.Tx, p storage.ClaimParams) ([]storage.Record, error) {
	strict := !s.config.DisableStrictOrdering
	walk := p.BatchSize
	if strict {
		walk *= s.config.WalkFactor
	}
	// 1. The walk: not-parked pending rows that are due, by due time, read
	// on claim_idx without locks, then locked through the primary key with
	// SKIP LOCKED. A claim takes no lock on a claim_idx entry: a locking
	// walk on claim_idx kept its lock on the entry of a row it skipped (a
	// row another claim held as a follower), and that claim's lease UPDATE,
	// which moves the entry, then waited for it; two claims doing this to
	// each other deadlocked. One clock reading (UTC_TIMESTAMP is fixed for
	// a statement, taken by the lock) serves a walk and the lease of the
	// rows it chose.
	visible := ""
	if d := s.config.VisibilityDelay; d > 0 {
		visible = " AND created_at <= UTC_TIMESTAMP(6) - INTERVAL " + strconv.FormatInt(d.Microseconds(), 10) + " MICROSECOND"
	}
	failed := "0"
	if s.hold {
		failed = "last_error IS NOT NULL"
	}
	due := " WHERE status = 'pending' AND parked = 0 AND due_at <= UTC_TIMESTAMP(6)" + visible
	var chosen []int64
	var nowLit string
	for walks := 1; ; walks++ {
		var parked int
		var err error
		chosen, parked, nowLit, err = s.claimWalk(ctx, tx, p, walk, due, visible, failed)
		if err != nil {
			return nil, err
		}
		// A walk that found only rows to park (every row it walked is
		// held back) is followed by another, up to maxWalkFactor batches
		// in all: the rows it parked left the walk, and the next one
		// reaches the rows behind them. Otherwise a backlog behind a key
		// whose head waits for a retry made claim after claim come back
		// empty, and the forwarder backed off between them, while other
		// keys' rows waited behind it.
		if len(chosen) > 0 || parked == 0 || (walks+1)*walk > maxWalkFactor*p.BatchSize {
			break
		}
	}
	if len(chosen) == 0 {
		return nil, nil
	}
	until := plusMicros(nowLit, p.Lease)
	var b strings.Builder
	b.WriteString("UPDATE " + s.table + " SET attempts = attempts + 1, leased_by = ")
	strLit(&b, p.WorkerID)
	// Leased rows are unparked: a follower may have been parked, and a
	// leased row must not stay parked once the rows ahead of it are gone
	// (see promote).
	b.WriteString(", leased_until = " + until + ", due_at = " + until + ", parked = 0 WHERE id IN (")
	idList(&b, chosen)
	b.WriteByte(')')
	if _, err := tx.ExecContext(ctx, b.String()); err != nil {
		return nil, fmt.Errorf("lease: %w", err)
	}
	return s.readRecords(ctx, tx, chosen)
}

// claimWalk is one walk of a claim: at most walk rows, locked, and of
// those the rows to lease (chosen) and the rows it parked (strict
// ordering), with the clock reading of the lock.
func (s *Storage) claimWalk(ctx context.Context, tx *sql.Tx, p storage.ClaimParams, walk int, due, visible, failed string) ([]int64, int, string, error) {
	strict := !s.config.DisableStrictOrdering
	walked, err := queryIDs(ctx, tx, "SELECT id FROM "+s.table+due+" ORDER BY due_at, id LIMIT "+strconv.Itoa(walk))
	if err != nil {
		return nil, 0, "", fmt.Errorf("walk: %w", err)
	}
	if len(walked) == 0 {
		return nil, 0, "", nil
	}
	// The lock re-checks the walk's conditions on the latest committed
	// rows: a row may have been claimed or acked since the walk read it.
	rows, err := tx.QueryContext(ctx, "SELECT id, "+bin("`key`")+", COALESCE(leased_until > UTC_TIMESTAMP(6), 0), "+failed+", CAST(UTC_TIMESTAMP(6) AS CHAR) FROM "+s.table+
		" FORCE INDEX (PRIMARY)"+due+" AND id IN ("+idsText(walked)+") FOR UPDATE SKIP LOCKED")
	if err != nil {
		return nil, 0, "", fmt.Errorf("lock walked rows: %w", err)
	}
	var cands []candidate
	var now string
	for rows.Next() {
		var c candidate
		if err := rows.Scan(&c.id, &c.key, &c.live, &c.failed, &now); err != nil {
			_ = rows.Close()
			return nil, 0, "", fmt.Errorf("lock walked rows: %w", err)
		}
		cands = append(cands, c)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return nil, 0, "", fmt.Errorf("lock walked rows: %w", err)
	}
	if len(cands) == 0 {
		return nil, 0, "", nil
	}
	nowLit := "'" + now + "'" // the server's own DATETIME text
	var chosen, park []int64
	if strict {
		chosen, park, err = s.strictPick(ctx, tx, cands, p.BatchSize, nowLit, visible, failed)
		if err != nil {
			return nil, 0, "", err
		}
	} else {
		for _, c := range cands {
			if !c.live {
				chosen = append(chosen, c.id)
			}
		}
	}
	if len(park) > 0 {
		if _, err := tx.ExecContext(ctx, "UPDATE "+s.table+" SET parked = 1 WHERE id IN ("+idsText(park)+")"); err != nil {
			return nil, 0, "", fmt.Errorf("park: %w", err)
		}
	}
	return chosen, len(park), nowLit, nil
}

// strictPick decides, among the walked candidates, which rows to lease (the
// heads of their keys, with their keys' next rows as followers, and keyless
// rows) and which to park (rows behind an earlier pending row of their key,
// which this transaction holds a lock on).
func (s *Storage) strictPick(ctx context.Context, tx *sql.Tx, cands []candidate, batch int, now, visible, failed string) (chosen, park []int64, err error) {
	// 2. The lowest pending id of every walked key (a consistent read: the
	// latest committed state), and with HoldOnDeadLetter its lowest dead id.
	keys := make(map[string]int64)
	dead := make(map[string]int64)
	for _, c := range cands {
		if c.key != "" && !c.live {
			keys[c.key] = 0
		}
	}
	if len(keys) > 0 {
		// One statement: for one walked row of each key, a correlated
		// ORDER BY id LIMIT 1 on key_idx (lowestOf).
		reps := make([]int64, 0, len(keys))
		seen := make(map[string]bool, len(keys))
		for _, c := range cands {
			if _, ok := keys[c.key]; ok && !seen[c.key] {
				seen[c.key] = true
				reps = append(reps, c.id)
			}
		}
		deadMin := "NULL"
		if s.hold {
			deadMin = s.lowestOf("dead", "c")
		}
		rows, err := tx.QueryContext(ctx, "SELECT "+bin("c.`key`")+", "+s.lowestOf("pending", "c")+", "+
			deadMin+" FROM "+s.table+" c WHERE c.id IN ("+idsText(reps)+")")
		if err != nil {
			return nil, nil, fmt.Errorf("lowest rows of keys: %w", err)
		}
		for rows.Next() {
			var k string
			var id, d sql.NullInt64
			if err := rows.Scan(&k, &id, &d); err != nil {
				_ = rows.Close()
				return nil, nil, fmt.Errorf("lowest rows of keys: %w", err)
			}
			keys[k] = id.Int64
			if d.Valid {
				dead[k] = d.Int64
			}
		}
		if err := errors.Join(rows.Err(), rows.Close()); err != nil {
			return nil, nil, fmt.Errorf("lowest rows of keys: %w", err)
		}
	}
	type head struct {
		id     int64
		key    string
		failed bool
	}
	var base []head             // claimable on their own: keyless rows and keys' heads
	behind := map[int64]int64{} // candidate -> the earlier pending row of its key
	for _, c := range cands {
		switch low, d := keys[c.key], dead[c.key]; {
		case c.live:
		case d != 0 && d < c.id:
			// HoldOnDeadLetter: held by a dead row of its key.
			behind[c.id] = d
		case c.key == "" || low == c.id:
			base = append(base, head{c.id, c.key, c.failed})
		case low != 0 && low < c.id:
			behind[c.id] = low
		}
	}
	slices.SortFunc(base, func(a, b head) int { return cmp.Compare(a.id, b.id) })

	// 3. Park only while holding a lock on the earlier row, so that it cannot
	// be acked or dead-lettered (and its key promoted) before this
	// transaction commits the parking. With HoldOnDeadLetter the earlier
	// row may be dead: dead-lettering does not promote, and a skip (which
	// deletes it and promotes) or a re-drive waits for the lock.
	lockedEarlier := map[int64]bool{}
	if len(behind) > 0 {
		var earlier []int64
		for _, e := range behind {
			earlier = append(earlier, e)
		}
		slices.Sort(earlier)
		earlier = slices.Compact(earlier)
		// An exclusive lock, skipping locked rows: MariaDB 10.11's
		// LOCK IN SHARE MODE SKIP LOCKED was seen waiting for a row another
		// claim had locked, and two claims then deadlocked. The cost: two
		// claims parking behind one row at once, the second leaves its rows
		// for later.
		statuses := "'pending'"
		if s.hold {
			statuses = "'pending', 'dead'"
		}
		ids, err := queryIDs(ctx, tx, "SELECT id FROM "+s.table+" FORCE INDEX (PRIMARY) WHERE id IN ("+idsText(earlier)+") AND status IN ("+statuses+") FOR UPDATE SKIP LOCKED")
		if err != nil {
			return nil, nil, fmt.Errorf("lock earlier rows: %w", err)
		}
		for _, id := range ids {
			lockedEarlier[id] = true
		}
	}

	// 4. Followers: each head's next pending rows of its key, a prefix of
	// them that is due, not under a live lease and lockable. Only rows that
	// can still make the batch are looked at.
	cutoff := int64(0) // followers must be below it to displace a base row
	if len(base) >= batch {
		cutoff = base[batch-1].id
	}
	var keyed []head
	for _, h := range base {
		// With HoldOnDeadLetter a failed head comes alone: if this attempt
		// dead-letters it, the rest of its key must not be in the batch.
		if h.key != "" && (cutoff == 0 || h.id < cutoff) && !h.failed {
			keyed = append(keyed, h)
		}
	}
	items := make([]int64, 0, len(base))
	for _, h := range base {
		items = append(items, h.id)
	}
	headOf := make(map[string]int64, len(keyed))
	for _, h := range keyed {
		headOf[h.key] = h.id
	}
	if len(keyed) > 0 {
		okExpr := fmt.Sprintf("due_at <= %[1]s AND COALESCE(leased_until <= %[1]s, 1)%[2]s, %[3]s", now, strings.ReplaceAll(visible, "UTC_TIMESTAMP(6)", now), failed)
		var b strings.Builder
		if len(keyed) <= followerProbes {
			// Few heads (hot keys): each head's next rows, LIMIT per head.
			per := max(16, 2*batch/len(keyed))
			for i, h := range keyed {
				if i > 0 {
					b.WriteString(" UNION ALL ")
				}
				b.WriteString("(SELECT id, " + bin("`key`") + ", " + okExpr + " FROM " + s.table + " FORCE INDEX (key_idx) WHERE `key` = ")
				strLit(&b, h.key)
				fmt.Fprintf(&b, " AND status = 'pending' AND id > %d", h.id)
				if cutoff != 0 {
					fmt.Fprintf(&b, " AND id < %d", cutoff)
				}
				fmt.Fprintf(&b, " ORDER BY id LIMIT %d)", min(per, batch-1-i))
			}
		} else {
			// Many heads (keys spread out): one range read per key over
			// the ids the walk covered, in one statement.
			upper := cutoff
			if upper == 0 {
				for _, c := range cands {
					upper = max(upper, c.id+1)
				}
			}
			b.WriteString("SELECT id, " + bin("`key`") + ", " + okExpr + " FROM " + s.table + " WHERE `key` IN (")
			for i, h := range keyed {
				if i > 0 {
					b.WriteByte(',')
				}
				strLit(&b, h.key)
			}
			fmt.Fprintf(&b, ") AND status = 'pending' AND id > %d AND id < %d ORDER BY id", keyed[0].id, upper)
		}
		rows, err := tx.QueryContext(ctx, b.String())
		if err != nil {
			return nil, nil, fmt.Errorf("followers: %w", err)
		}
		stopped := map[string]bool{}
		var want []int64
		var wantKey []string
		for rows.Next() {
			var id int64
			var k string
			var ok, failed bool
			if err := rows.Scan(&id, &k, &ok, &failed); err != nil {
				_ = rows.Close()
				return nil, nil, fmt.Errorf("followers: %w", err)
			}
			if stopped[k] || id <= headOf[k] {
				continue
			}
			if d := dead[k]; !ok || (d != 0 && id > d) {
				// Not claimable now, or (HoldOnDeadLetter) behind a dead
				// row of the key: the key's followers end here.
				stopped[k] = true
				continue
			}
			want = append(want, id)
			wantKey = append(wantKey, k)
			if failed {
				stopped[k] = true // HoldOnDeadLetter: a failed row ends its key's run
			}
		}
		if err := errors.Join(rows.Err(), rows.Close()); err != nil {
			return nil, nil, fmt.Errorf("followers: %w", err)
		}
		if len(want) > 0 {
			got, err := queryIDs(ctx, tx, "SELECT id FROM "+s.table+" FORCE INDEX (PRIMARY) WHERE id IN ("+idsText(want)+
				") AND status = 'pending' AND due_at <= "+now+" AND COALESCE(leased_until <= "+now+", 1) FOR UPDATE SKIP LOCKED")
			if err != nil {
				return nil, nil, fmt.Errorf("lock followers: %w", err)
			}
			locked := make(map[int64]bool, len(got))
			for _, id := range got {
				locked[id] = true
			}
			// want is in key order, then id order: a key's followers end at
			// its first row not locked.
			clear(stopped)
			for i, id := range want {
				k := wantKey[i]
				if stopped[k] || !locked[id] {
					stopped[k] = true
					continue
				}
				items = append(items, id)
			}
		}
	}
	slices.Sort(items)
	items = slices.Compact(items)
	if len(items) > batch {
		items = items[:batch] // each key keeps a prefix of its rows
	}
	taken := make(map[int64]bool, len(items))
	for _, id := range items {
		taken[id] = true
	}
	for id, e := range behind {
		if !taken[id] && lockedEarlier[e] {
			park = append(park, id)
		}
	}
	slices.Sort(park)
	return items, park, nil
}

// readRecords returns the rows ids in id order.
func (s *Storage) readRecords(ctx context.Context, tx *sql.Tx, ids []int64) ([]storage.Record, error) {
	rows, err := tx.QueryContext(ctx, "SELECT id, "+bin("uuid")+", "+bin("topic")+", "+bin("`key`")+", payload, "+binJSON("metadata")+", attempts, "+
		micros("created_at")+" FROM "+s.table+" WHERE id IN ("+idsText(ids)+") ORDER BY id")
	if err != nil {
		return nil, fmt.Errorf("read claimed rows: %w", err)
	}
	defer func() { _ = rows.Close() }()
	out := make([]storage.Record, 0, len(ids))
	var topic string
	for rows.Next() {
		var r storage.Record
		var uuid, t, key []byte
		var meta []byte
		var created int64
		if err := rows.Scan(&r.ID, &uuid, &t, &key, &r.Payload, &meta, &r.Attempts, &created); err != nil {
			return nil, fmt.Errorf("read claimed rows: %w", err)
		}
		r.UUID, r.Key = string(uuid), string(key)
		if string(t) != topic { // records of a batch mostly share a topic
			topic = string(t)
		}
		r.Topic = topic
		r.CreatedAt = fromMicros(created)
		if meta != nil {
			if err := json.Unmarshal(meta, &r.Metadata); err != nil {
				r.DecodeError = fmt.Errorf("decode metadata of outbox row %d: %w", r.ID, err)
			}
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read claimed rows: %w", err)
	}
	return out, nil
}

// queryIDs runs a query whose only column is an id.
func queryIDs(ctx context.Context, tx *sql.Tx, q string) ([]int64, error) {
	rows, err := tx.QueryContext(ctx, q)
	if err != nil {
		return nil, err
	}
	defer func() { _ = rows.Close() }()
	var ids []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		ids = append(ids, id)
	}
	return ids, rows.Err()
}
