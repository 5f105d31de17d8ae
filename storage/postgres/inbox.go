package postgres

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox/internal/sqlinbox"
	"github.com/txoutbox/txoutbox/storage"
)

// InboxTable returns the inbox table of the inbox package, as quoted in SQL:
// the outbox table's name with the suffix "_inbox", in the same schema.
// Migrate creates it (schema step 5).
func (s *Storage) InboxTable() string { return siblingName(s.ident, "inbox") }

func (s *Storage) inboxSQL() (insert, prune, stats string) {
	t := s.InboxTable()
	insert = "INSERT INTO " + t + " (consumer, uuid, received_at) VALUES ($1, $2, $3) ON CONFLICT (consumer, uuid) DO NOTHING"
	prune = "DELETE FROM " + t + " WHERE consumer = $1 AND uuid IN (SELECT uuid FROM " + t +
		" WHERE consumer = $1 AND received_at < $2 ORDER BY received_at LIMIT $3)"
	stats = "SELECT count(*), (extract(epoch FROM min(received_at)) * 1000000)::bigint FROM " + t
	return insert, prune, stats
}

// Inbox returns the inbox table on the storage's pgx pool, for the inbox
// package: handlers get a pgx.Tx.
func (s *Storage) Inbox() storage.InboxStore { return pgxInbox{s} }

// InboxDB returns the inbox table on db, a database/sql handle opened on the
// pgx stdlib driver ("pgx"), for the inbox package: handlers get a *sql.Tx.
func (s *Storage) InboxDB(db *sql.DB) storage.InboxStore {
	insert, prune, stats := s.inboxSQL()
	return &sqlinbox.Store{DB: db, Insert: insert, Prune: prune, Stats: stats,
		Time: func(t time.Time) any { return t }}
}

type pgxInbox struct{ s *Storage }

func (i pgxInbox) BeginInbox(ctx context.Context, p storage.InboxParams) (storage.InboxTx, bool, error) {
	insert, _, _ := i.s.inboxSQL()
	tx, err := i.s.pool.Begin(ctx)
	if err != nil {
		return nil, false, fmt.Errorf("insert inbox entry: %w", err)
	}
	tag, err := tx.Exec(ctx, insert, p.Consumer, p.UUID, p.ReceivedAt)
	if err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return nil, false, fmt.Errorf("insert inbox entry: %w", err)
	}
	if tag.RowsAffected() == 0 {
		if err := tx.Rollback(ctx); err != nil {
			return nil, true, fmt.Errorf("roll back after a duplicate inbox entry: %w", err)
		}
		return nil, true, nil
	}
	return pgxInboxTx{tx}, false, nil
}

func (i pgxInbox) PruneInbox(ctx context.Context, p storage.InboxPruneParams) (int64, error) {
	_, prune, _ := i.s.inboxSQL()
	tag, err := i.s.pool.Exec(ctx, prune, p.Consumer, p.Before, p.Limit)
	if err != nil {
		return 0, fmt.Errorf("prune inbox entries: %w", err)
	}
	return tag.RowsAffected(), nil
}

func (i pgxInbox) InboxStats(ctx context.Context) (storage.InboxStats, error) {
	_, _, stats := i.s.inboxSQL()
	var st storage.InboxStats
	var oldest *int64
	if err := i.s.pool.QueryRow(ctx, stats).Scan(&st.Entries, &oldest); err != nil {
		return st, fmt.Errorf("read inbox stats: %w", err)
	}
	if oldest != nil {
		st.Oldest = time.UnixMicro(*oldest).UTC()
	}
	return st, nil
}

type pgxInboxTx struct{ tx pgx.Tx }

func (t pgxInboxTx) Tx() any                          { return t.tx }
func (t pgxInboxTx) Commit(ctx context.Context) error { return t.tx.Commit(ctx) }
func (t pgxInboxTx) Rollback(ctx context.Context) error {
	if err := t.tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return err
	}
	return nil
}
