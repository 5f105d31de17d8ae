package mysql

import (
	"context"
	"database/sql"
	"strconv"
	"time"
)

// SweepInterval is how often a storage's claims look for parked rows that
// nothing would set free, and set them free; the first claim of a storage
// does it at once.
//
// A row parked behind an earlier row of its key is set free by that row's
// ack or dead-letter. Configuration changes break this: a process without
// strict ordering acks without setting anything free (and its claims skip
// parked rows like any claim), and a process without HoldOnDeadLetter never
// sees the rows parked behind a dead row. Setting a row free is always
// safe: a claim that walks it checks its key again and parks it again when
// it is still held back.
const SweepInterval = time.Minute

// sweepBatch is how many parked rows one sweep statement sets free.
const sweepBatch = 1000

// sweepIfDue runs sweep when SweepInterval has passed since the last one
// (one claim of the storage at a time runs it).
func (s *Storage) sweepIfDue(ctx context.Context) error {
	now := time.Now().UnixNano()
	next := s.nextSweep.Load()
	if now < next || !s.nextSweep.CompareAndSwap(next, now+int64(SweepInterval)) {
		return nil
	}
	return s.sweep(ctx)
}

// sweep sets free the parked rows that nothing else would: without strict
// ordering every parked row; with it, each parked row that is the lowest
// pending row of its key (and, with HoldOnDeadLetter, has no dead row of
// its key before it). It finds them with plain reads (a consistent read of
// the parked rows on claim_idx, each checked on key_idx), then unparks them
// by primary key, [sweepBatch] at a time, each batch its own READ COMMITTED
// transaction. The cost grows with the number of parked rows: one key_idx
// probe each.
func (s *Storage) sweep(ctx context.Context) error {
	q := "SELECT p.id FROM " + s.table + " p FORCE INDEX (claim_idx) WHERE p.status = 'pending' AND p.parked = 1"
	if !s.config.DisableStrictOrdering {
		q += " AND p.id = " + s.lowestOf("pending", "p")
		if s.hold {
			q += " AND NOT EXISTS (SELECT 1 FROM " + s.table + " d FORCE INDEX (key_idx) WHERE d.`key` = p.`key` AND d.status = 'dead' AND d.id < p.id)"
		}
	}
	for {
		var ids []int64
		err := s.inTx(ctx, func(tx *sql.Tx) error {
			var err error
			ids, err = queryIDs(ctx, tx, q+" LIMIT "+strconv.Itoa(sweepBatch))
			if err != nil || len(ids) == 0 {
				return err
			}
			_, err = tx.ExecContext(ctx, "UPDATE "+s.table+" SET parked = 0 WHERE id IN ("+idsText(ids)+") AND status = 'pending' AND parked = 1")
			return err
		})
		if err != nil || len(ids) < sweepBatch {
			return err
		}
	}
}
