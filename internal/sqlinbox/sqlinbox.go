// Package sqlinbox is the inbox table over database/sql, for the SQL
// storages: each gives its statements, the rest is shared.
package sqlinbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// Store implements [storage.InboxStore] over a *sql.DB.
type Store struct {
	DB *sql.DB
	// Insert records an entry: args consumer, uuid, received_at (through
	// Time). It affects one row, or none when the pair is there, after
	// waiting for a transaction that holds it uncommitted.
	Insert string
	// Prune deletes entries: args consumer, before (through Time), limit.
	Prune string
	// Stats returns the number of entries and the oldest received_at in
	// microseconds since the Unix epoch (NULL without entries).
	Stats string
	// Time converts a time into the argument its column takes.
	Time func(time.Time) any
	// Retry, if set, runs the begin and the insert, retrying what the
	// database refused for a moment (SQLite's SQLITE_BUSY).
	Retry func(ctx context.Context, fn func(context.Context) error) error
}

var _ storage.InboxStore = (*Store)(nil)

// BeginInbox implements [storage.InboxStore].
func (s *Store) BeginInbox(ctx context.Context, p storage.InboxParams) (storage.InboxTx, bool, error) {
	var tx *sql.Tx
	var n int64
	try := func(ctx context.Context) error {
		var err error
		if tx, err = s.DB.BeginTx(ctx, nil); err != nil {
			return err
		}
		res, err := tx.ExecContext(ctx, s.Insert, p.Consumer, p.UUID, s.Time(p.ReceivedAt))
		if err == nil {
			n, err = res.RowsAffected()
		}
		if err != nil {
			_ = tx.Rollback()
		}
		return err
	}
	var err error
	if s.Retry != nil {
		err = s.Retry(ctx, try)
	} else {
		err = try(ctx)
	}
	if err != nil {
		return nil, false, fmt.Errorf("insert inbox entry: %w", err)
	}
	if n == 0 {
		if err := tx.Rollback(); err != nil {
			return nil, true, fmt.Errorf("roll back after a duplicate inbox entry: %w", err)
		}
		return nil, true, nil
	}
	return sqlTx{tx}, false, nil
}

// PruneInbox implements [storage.InboxStore].
func (s *Store) PruneInbox(ctx context.Context, p storage.InboxPruneParams) (int64, error) {
	var n int64
	run := func(ctx context.Context) error {
		res, err := s.DB.ExecContext(ctx, s.Prune, p.Consumer, s.Time(p.Before), p.Limit)
		if err != nil {
			return err
		}
		n, err = res.RowsAffected()
		return err
	}
	var err error
	if s.Retry != nil {
		err = s.Retry(ctx, run)
	} else {
		err = run(ctx)
	}
	if err != nil {
		return 0, fmt.Errorf("prune inbox entries: %w", err)
	}
	return n, nil
}

// InboxStats implements [storage.InboxStore].
func (s *Store) InboxStats(ctx context.Context) (storage.InboxStats, error) {
	var st storage.InboxStats
	var oldest sql.NullInt64
	if err := s.DB.QueryRowContext(ctx, s.Stats).Scan(&st.Entries, &oldest); err != nil {
		return st, fmt.Errorf("read inbox stats: %w", err)
	}
	if oldest.Valid {
		st.Oldest = time.UnixMicro(oldest.Int64).UTC()
	}
	return st, nil
}

type sqlTx struct{ tx *sql.Tx }

func (t sqlTx) Tx() any                        { return t.tx }
func (t sqlTx) Commit(context.Context) error   { return t.tx.Commit() }
func (t sqlTx) Rollback(context.Context) error { return ignoreDone(t.tx.Rollback()) }

func ignoreDone(err error) error {
	if errors.Is(err, sql.ErrTxDone) {
		return nil
	}
	return err
}
