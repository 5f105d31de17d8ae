package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/txoutbox/txoutbox/storage"
)

// lockOwned locks the rows of refs, in id order, and returns those that are
// pending and leased by worker by the claim their ref names, with their
// keys. Write-backs lock in id order, so write-backs do not deadlock each
// other.
func (s *Storage) lockOwned(ctx context.Context, tx *sql.Tx, refs []storage.ClaimRef, worker, extra string) (owned []int64, keys []string, reps []int64, err error) {
	var b strings.Builder
	b.WriteString("SELECT id, " + bin("`key`") + " FROM " + s.table + " WHERE ")
	refsCond(&b, refs)
	b.WriteString(" AND status = 'pending' AND leased_by = ")
	strLit(&b, worker)
	b.WriteString(extra)
	b.WriteString(" ORDER BY id FOR UPDATE")
	rows, err := tx.QueryContext(ctx, b.String())
	if err != nil {
		return nil, nil, nil, err
	}
	defer func() { _ = rows.Close() }()
	seen := map[string]bool{}
	for rows.Next() {
		var id int64
		var k string
		if err := rows.Scan(&id, &k); err != nil {
			return nil, nil, nil, err
		}
		owned = append(owned, id)
		if k != "" && !seen[k] {
			seen[k] = true
			keys = append(keys, k)
			reps = append(reps, id)
		}
	}
	return owned, keys, reps, rows.Err()
}

// promote unparks the lowest pending row of each key after the rows ahead
// of it left (acked or dead-lettered) in this transaction. It finds that
// row with a plain read, then locks it (FOR UPDATE, in id order): another
// ack of the same key may hold the row it found and be about to move it out
// of pending (two holders of one key's rows ack at once after a lease ran
// out), so a row that is no longer pending once locked is looked for again.
// Two such acks can wait for each other; InnoDB then rolls one back and
// inTx runs it again. Claims skip locked rows, so a promote waits for a
// claim only as long as the claim runs (MariaDB 10.11 was seen with a claim's
// SKIP LOCKED read waiting for a promote anyway; InnoDB then rolls one back,
// and it runs again). acked holds one row of each key this transaction
// changed.
func (s *Storage) promote(ctx context.Context, tx *sql.Tx, acked []int64, keys []string) error {
	// Without strict ordering too: a row parked by a process with it (a
	// rolling deploy that turns it off or on) is then set free as it would
	// be there.
	if len(keys) == 0 {
		return nil
	}
	// Nothing parked at all (a plain read of one claim_idx entry, after
	// this transaction locked its rows: a claim parks only behind a row it
	// holds locked, so none can park behind these rows any more): nothing to
	// unpark.
	var parked int
	if err := tx.QueryRowContext(ctx, "SELECT COUNT(*) FROM (SELECT 1 FROM "+s.table+" FORCE INDEX (claim_idx) WHERE status = 'pending' AND parked = 1 LIMIT 1) AS p").Scan(&parked); err != nil {
		return err
	}
	if parked == 0 {
		return nil
	}
	for round := 0; len(keys) > 0; round++ {
		if round == 10 {
			return fmt.Errorf("promote: the lowest rows of %d keys kept changing", len(keys))
		}
		lowest, err := s.lowestPending(ctx, tx, acked, keys)
		if err != nil {
			return err
		}
		if len(lowest) == 0 {
			return nil
		}
		ids := make([]int64, 0, len(lowest))
		for _, id := range lowest {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		rows, err := tx.QueryContext(ctx, "SELECT id, "+bin("`key`")+", parked FROM "+s.table+" WHERE id IN ("+idsText(ids)+") AND status = 'pending' ORDER BY id FOR UPDATE")
		if err != nil {
			return err
		}
		var unpark []int64
		for rows.Next() {
			var id int64
			var k string
			var parked bool
			if err := rows.Scan(&id, &k, &parked); err != nil {
				_ = rows.Close()
				return err
			}
			delete(lowest, k)
			if parked {
				unpark = append(unpark, id)
			}
		}
		if err := errors.Join(rows.Err(), rows.Close()); err != nil {
			return err
		}
		if len(unpark) > 0 {
			if _, err := tx.ExecContext(ctx, "UPDATE "+s.table+" SET parked = 0 WHERE id IN ("+idsText(unpark)+")"); err != nil {
				return err
			}
		}
		// Keys whose row left pending meanwhile: look again.
		keys = keys[:0]
		for k := range lowest {
			keys = append(keys, k)
		}
		acked = nil
	}
	return nil
}

// lowestOf is the lowest id with status of the key of the row aliased
// outer, read on key_idx: a correlated ORDER BY id LIMIT 1, which reads one
// index entry (MariaDB answered MIN(id) by reading every pending entry of the
// key: 50 per probe in the drain benchmark, where it took half the drain's
// time). The index is named: left to itself, MariaDB 10.11 sometimes ran the
// probe as a scan of the primary key in id order, stopping at the first row
// of the key with that status (the ORDER BY LIMIT optimisation, chosen when it
// judged that row to come soon): near the end of a drain, with the pending
// rows at the top of the table, that read the whole table for each probe (an
// ack of 369 rows examined 17 million, 5.4 s; four forwarders, batch 1000,
// about one drain in ten fell to a quarter of its rate). The per-key reads
// of a head's next rows name key_idx for the same reason; the followers'
// read of many keys at once is bounded by the ids the walk covered.
func (s *Storage) lowestOf(status, outer string) string {
	return "(SELECT e.id FROM " + s.table + " e FORCE INDEX (key_idx) WHERE e.`key` = " + outer + ".`key` AND e.status = '" + status + "' ORDER BY e.id LIMIT 1)"
}

// lowestPending returns the lowest pending id of each key (a plain read).
// With acked (rows of the keys still in the table) it is one statement of
// correlated ORDER BY id LIMIT 1 subqueries (MIN(id) read every pending
// entry of the key on MariaDB); otherwise one such subquery per key.
func (s *Storage) lowestPending(ctx context.Context, tx *sql.Tx, acked []int64, keys []string) (map[string]int64, error) {
	var q string
	if len(acked) > 0 && !s.config.DeleteOnAck {
		q = "SELECT " + bin("o.`key`") + ", " + s.lowestOf("pending", "o") + " FROM " + s.table + " o WHERE o.id IN (" + idsText(acked) + ")"
	} else {
		var b strings.Builder
		for i, k := range keys {
			if i > 0 {
				b.WriteString(" UNION ALL ")
			}
			b.WriteString("(SELECT " + bin("`key`") + ", id FROM " + s.table + " FORCE INDEX (key_idx) WHERE `key` = ")
			strLit(&b, k)
			b.WriteString(" AND status = 'pending' ORDER BY id LIMIT 1)")
		}
		q = b.String()
	}
	rows, err := tx.QueryContext(ctx, q)
	if err != nil {
		return nil, err
	}
	defer func() { _ = rows.Close() }()
	out := make(map[string]int64, len(keys))
	for rows.Next() {
		var k string
		var id sql.NullInt64
		if err := rows.Scan(&k, &id); err != nil {
			return nil, err
		}
		if id.Valid {
			out[k] = id.Int64
		}
	}
	return out, rows.Err()
}

// Ack implements [storage.Storage]: the rows leased by the worker are marked
// delivered (deleted with [Config.DeleteOnAck]) and the next row of each of
// their keys is unparked, in one transaction.
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Ack(ctx context.Context, p storage.AckParams) error {
	if len(p.Records) == 0 {
		return nil
	}
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		owned, keys, reps, err := s.lockOwned(ctx, tx, p.Records, p.WorkerID, "")
		if err != nil || len(owned) == 0 {
			return err
		}
		q := "UPDATE " + s.table + " SET status = 'delivered', delivered_at = UTC_TIMESTAMP(6), leased_by = NULL, leased_until = NULL, parked = 0 WHERE id IN (" + idsText(owned) + ")"
		if s.config.DeleteOnAck {
			q = "DELETE FROM " + s.table + " WHERE id IN (" + idsText(owned) + ")"
		}
		if _, err := tx.ExecContext(ctx, q); err != nil {
			return err
		}
		return s.promote(ctx, tx, reps, keys)
	})
	if err != nil {
		return fmt.Errorf("ack %d outbox rows in %s: %w", len(p.Records), s.table, err)
	}
	return nil
}

// Nack implements [storage.Storage]. One fenced statement; parking is not
// changed (the row stays the lowest pending row of its key).
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Nack(ctx context.Context, p storage.NackParams) error {
	var b strings.Builder
	b.WriteString("UPDATE " + s.table + " SET leased_by = NULL, leased_until = NULL, due_at = " + timeLit(p.RetryAt) + ", last_error = ")
	strLit(&b, validText(p.Error))
	fmt.Fprintf(&b, " WHERE id = %d AND attempts = %d AND status = 'pending' AND leased_by = ", p.Record.ID, p.Record.Attempt)
	strLit(&b, p.WorkerID)
	if _, err := s.exec(ctx, b.String()); err != nil {
		return fmt.Errorf("nack outbox row %d in %s: %w", p.Record.ID, s.table, err)
	}
	return nil
}

// Release implements [storage.Storage]. One fenced statement; parking is not
// changed.
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Release(ctx context.Context, p storage.ReleaseParams) error {
	if len(p.Records) == 0 {
		return nil
	}
	var b strings.Builder
	b.WriteString("UPDATE " + s.table + " SET leased_by = NULL, leased_until = NULL, attempts = GREATEST(attempts - 1, 0), due_at = " + timeLit(p.RetryAt) + " WHERE ")
	refsCond(&b, p.Records)
	b.WriteString(" AND status = 'pending' AND leased_by = ")
	strLit(&b, p.WorkerID)
	if _, err := s.exec(ctx, b.String()); err != nil {
		return fmt.Errorf("release %d outbox rows in %s: %w", len(p.Records), s.table, err)
	}
	return nil
}

// DeadLetter implements [storage.Storage]: the row becomes dead and, unless
// [Config.HoldOnDeadLetter] is set, the next row of its key is unparked, in
// one transaction.
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) DeadLetter(ctx context.Context, p storage.DeadLetterParams) error {
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		owned, keys, reps, err := s.lockOwned(ctx, tx, []storage.ClaimRef{p.Record}, p.WorkerID, "")
		if err != nil || len(owned) == 0 {
			return err
		}
		var b strings.Builder
		// A dead row's due_at is when it was dead-lettered.
		b.WriteString("UPDATE " + s.table + " SET status = 'dead', leased_by = NULL, leased_until = NULL, parked = 0, due_at = UTC_TIMESTAMP(6), last_error = ")
		strLit(&b, validText(p.Error))
		fmt.Fprintf(&b, " WHERE id = %d", p.Record.ID)
		if _, err := tx.ExecContext(ctx, b.String()); err != nil {
			return err
		}
		if s.hold {
			return nil // the dead row holds its key: nothing moves on
		}
		return s.promote(ctx, tx, reps, keys)
	})
	if err != nil {
		return fmt.Errorf("dead-letter outbox row %d in %s: %w", p.Record.ID, s.table, err)
	}
	return nil
}

// Extend implements [storage.Storage]: live leases of the worker are pushed
// to now+params.Lease.
//
// The forwarder calls it (the relay protocol); an application does not.
func (s *Storage) Extend(ctx context.Context, p storage.ExtendParams) ([]int64, error) {
	if len(p.Records) == 0 {
		return nil, nil
	}
	if p.Lease <= 0 {
		return nil, fmt.Errorf("extend outbox leases: lease %s must be > 0", p.Lease)
	}
	var owned []int64
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		owned, _, _, err = s.lockOwned(ctx, tx, p.Records, p.WorkerID, " AND leased_until > UTC_TIMESTAMP(6)")
		if err != nil || len(owned) == 0 {
			return err
		}
		until := plusMicros("UTC_TIMESTAMP(6)", p.Lease)
		_, err = tx.ExecContext(ctx, "UPDATE "+s.table+" SET leased_until = "+until+", due_at = "+until+" WHERE id IN ("+idsText(owned)+")")
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("extend %d outbox leases in %s: %w", len(p.Records), s.table, err)
	}
	return owned, nil
}

// refsCond writes the fence of a write-back on the claims refs name: the
// ids in id order (the rows are found by primary key), and each id with the
// attempts its claim returned (see storage.ClaimRef).
func refsCond(b *strings.Builder, refs []storage.ClaimRef) {
	ids := make([]int64, len(refs))
	for i, r := range refs {
		ids[i] = r.ID
	}
	slices.Sort(ids)
	b.WriteString("id IN (")
	idList(b, ids)
	b.WriteString(") AND (id, attempts) IN (")
	for i, r := range refs {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(b, "(%d,%d)", r.ID, r.Attempt)
	}
	b.WriteByte(')')
}

// exec runs one statement on its own (autocommit). Its rows are found by
// primary key, so it takes record locks only; a deadlock is retried once.
func (s *Storage) exec(ctx context.Context, q string) (sql.Result, error) {
	r, err := s.db.ExecContext(ctx, q)
	if s.retryable(err) {
		r, err = s.db.ExecContext(ctx, q)
	}
	return r, err
}

// maxErrorBytes keeps an error text within its TEXT column (65535 bytes).
const maxErrorBytes = 60000

// validText makes an error text storable: invalid UTF-8 is replaced and a
// text too long for the column is cut at a character boundary.
func validText(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	if len(s) > maxErrorBytes {
		s = strings.ToValidUTF8(s[:maxErrorBytes], "")
	}
	return s
}
