package mysql

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// PurgeBatchSize is how many delivered rows one Purge statement deletes at
// most, so that a purge of millions of rows never holds a long lock.
const PurgeBatchSize = 1000

// Purge implements [storage.Maintainer]: it deletes the rows delivered more
// than olderThan ago, [PurgeBatchSize] per statement (each its own READ
// COMMITTED transaction), until none is left. On error it returns how many
// it had deleted so far. Then it empties [Storage.KeyTable] of the keys no
// producer holds (a row is only a lock: a producer that finds none inserts
// it), [PurgeBatchSize] per transaction, skipping locked rows, so that
// the table does not grow with every key ever used and no producer waits
// for the purge more than one short transaction.
func (s *Storage) Purge(ctx context.Context, olderThan time.Duration) (int64, error) {
	if olderThan < 0 {
		return 0, fmt.Errorf("purge outbox %s: olderThan is %s: must be >= 0", s.table, olderThan)
	}
	q := "DELETE FROM " + s.table + " WHERE status = 'delivered' AND delivered_at < UTC_TIMESTAMP(6) - INTERVAL " +
		strconv.FormatInt(olderThan.Microseconds(), 10) + " MICROSECOND ORDER BY delivered_at LIMIT " + strconv.Itoa(PurgeBatchSize)
	var total int64
	for {
		var n int64
		err := s.inTx(ctx, func(tx *sql.Tx) error {
			r, err := tx.ExecContext(ctx, q)
			if err != nil {
				return err
			}
			n, err = r.RowsAffected()
			return err
		})
		if err != nil {
			return total, fmt.Errorf("purge outbox %s: %w", s.table, err)
		}
		total += n
		if n < PurgeBatchSize {
			if err := s.purgeKeys(ctx); err != nil {
				return total, fmt.Errorf("purge key locks of %s: %w", s.table, err)
			}
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, fmt.Errorf("purge outbox %s: %w", s.table, err)
		}
	}
}

// Redrive implements [storage.Maintainer]: the selected dead-lettered rows go
// back to pending, due now, not parked, with attempts 0 and no error. A
// re-driven row may be ahead of later rows of its key that were delivered
// meanwhile: it is claimed as soon as no earlier row of its key is pending.
func (s *Storage) Redrive(ctx context.Context, p storage.RedriveParams) (int64, error) {
	if err := p.Validate(); err != nil {
		return 0, fmt.Errorf("redrive outbox rows: %w", err)
	}
	var b strings.Builder
	b.WriteString("UPDATE " + s.table + ` SET status = 'pending', parked = 0, attempts = 0, last_error = NULL,
    leased_by = NULL, leased_until = NULL, due_at = UTC_TIMESTAMP(6) WHERE status = 'dead' AND `)
	switch {
	case len(p.IDs) > 0:
		b.WriteString("id IN (")
		idList(&b, p.IDs)
		b.WriteByte(')')
	case p.Key != "":
		b.WriteString("TRUE")
		exactly(&b, "`key`", validText(p.Key))
	case p.All:
		b.WriteString("TRUE")
	default:
		b.WriteString("TRUE")
		exactly(&b, "topic", validText(p.Topic))
	}
	var n int64
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		r, err := tx.ExecContext(ctx, b.String())
		if err != nil {
			return err
		}
		n, err = r.RowsAffected()
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("redrive outbox rows in %s: %w", s.table, err)
	}
	return n, nil
}

// freeKeys locks and returns up to PurgeBatchSize keys of the key table
// that no producer holds.
func (s *Storage) freeKeys(ctx context.Context, tx *sql.Tx) ([]string, error) {
	rows, err := tx.QueryContext(ctx, "SELECT CAST(`key` AS BINARY) FROM "+s.KeyTable()+" LIMIT "+strconv.Itoa(PurgeBatchSize)+" FOR UPDATE SKIP LOCKED")
	if err != nil {
		return nil, err
	}
	defer func() { _ = rows.Close() }()
	var keys []string
	for rows.Next() {
		var k []byte
		if err := rows.Scan(&k); err != nil {
			return nil, err
		}
		keys = append(keys, string(k))
	}
	return keys, rows.Err()
}

// purgeKeys deletes the rows of the key table that no producer holds.
func (s *Storage) purgeKeys(ctx context.Context) error {
	for {
		var n int
		err := s.inTx(ctx, func(tx *sql.Tx) error {
			keys, err := s.freeKeys(ctx, tx)
			n = len(keys)
			if err != nil || n == 0 {
				return err
			}
			var b strings.Builder
			for i, k := range keys {
				if i > 0 {
					b.WriteByte(',')
				}
				strLit(&b, k)
			}
			_, err = tx.ExecContext(ctx, "DELETE FROM "+s.KeyTable()+" WHERE `key` IN ("+b.String()+")")
			return err
		})
		if isNoSuchTable(err) {
			return nil // a schema older than the key locks: nothing to purge
		}
		if err != nil || n < PurgeBatchSize {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}
