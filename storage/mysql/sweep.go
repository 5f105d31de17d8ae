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
// ack or dead-letter (with or without strict ordering), or its skip.
// Configuration changes leave two kinds of parked rows that nothing sets
// free: without strict ordering, every parked row (claims skip parked rows
// whatever the configuration); without HoldOnDeadLetter, the rows parked
// behind a dead row by a process with it. Setting a row free is always
// safe: a claim that walks it checks its key again, and parks it again
// when it is still held back.
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

// sweep sets free the parked rows that nothing else would, with plain
// reads, then by primary key, [sweepBatch] at a time, each batch its own
// READ COMMITTED transaction. Without strict ordering: every parked row
// (one claim_idx entry read when there is none). With strict ordering and
// without HoldOnDeadLetter: the lowest pending row of each key with a dead
// row, when it is parked (the dead rows read on done_idx, each key probed
// on key_idx). With HoldOnDeadLetter nothing is stranded: there is nothing
// to do.
func (s *Storage) sweep(ctx context.Context) error {
	var q string
	switch {
	case s.config.DisableStrictOrdering:
		q = "SELECT id FROM " + s.table + " FORCE INDEX (claim_idx) WHERE status = 'pending' AND parked = 1"
	case !s.hold:
		q = "SELECT p.id FROM (SELECT DISTINCT `key` FROM " + s.table + " FORCE INDEX (done_idx) WHERE status = 'dead' AND `key` <> '') AS d\n" +
			"JOIN " + s.table + " AS p ON p.id = " + s.lowestOf("pending", "d") + " WHERE p.status = 'pending' AND p.parked = 1"
	default:
		return nil
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
