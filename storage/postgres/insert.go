package postgres

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox/storage"
)

// Insert implements [storage.Inserter]: it writes records through tx, a pgx.Tx
// or a *sql.Tx opened on the pgx stdlib driver, in one statement whatever their
// number. Every record is checked first; one invalid record fails the call with
// an error wrapping [storage.ErrInvalidRecord] and nothing is written.
func (s *Storage) Insert(ctx context.Context, tx any, records []storage.Record) error {
	_, err := s.insert(ctx, tx, records, false)
	return err
}

// insert is Insert, returning the new ids in record order when returning is
// set (the tests need them; Insert does not pay for them).
func (s *Storage) insert(ctx context.Context, tx any, records []storage.Record, returning bool) ([]int64, error) {
	switch tx.(type) {
	case pgx.Tx, *sql.Tx:
	default:
		return nil, fmt.Errorf("insert outbox rows: %w: %T (want pgx.Tx or *sql.Tx)", storage.ErrUnsupportedTx, tx)
	}
	if len(records) == 0 {
		return nil, nil
	}
	n := len(records)
	uuids := make([]string, n)
	topics := make([]string, n)
	keys := make([]string, n)
	payloads := make([][]byte, n)
	metas := make([]*string, n) // nil = SQL NULL, kept apart from an empty map
	var dues []*time.Time       // nil = due at once; allocated for the first delayed record
	now := time.Now()
	for i, r := range records {
		if err := checkRecord(r); err != nil {
			return nil, fmt.Errorf("insert outbox rows: record %d (uuid %q): %w", i, r.UUID, err)
		}
		uuids[i], topics[i], keys[i], payloads[i] = r.UUID, r.Topic, r.Key, r.Payload
		if r.Metadata != nil {
			b, err := json.Marshal(r.Metadata)
			if err != nil {
				return nil, fmt.Errorf("insert outbox rows: record %d (uuid %q): %w: metadata: %w", i, r.UUID, storage.ErrInvalidRecord, err)
			}
			m := string(b)
			metas[i] = &m
		}
		if r.DueAt.After(now) {
			if dues == nil {
				dues = make([]*time.Time, n)
			}
			dues[i] = &records[i].DueAt
		}
	}
	// ORDER BY ord: ids follow the order of records.
	q := fmt.Sprintf(`INSERT INTO %s (uuid, topic, key, payload, metadata)
SELECT u, t, k, p, m FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::jsonb[])
    WITH ORDINALITY AS r(u, t, k, p, m, ord)
ORDER BY ord`, s.table)
	args := []any{uuids, topics, keys, payloads, metas}
	if dues != nil {
		// A delayed record is due at its time (or at once, should the
		// time have passed by now) and waits in the retry index
		// (hold 'retry') until a claim's wake finds it due: it never
		// enters the claim's walk before, and with strict ordering it
		// holds back the later records of its key (see the claim).
		q = fmt.Sprintf(`INSERT INTO %s (uuid, topic, key, payload, metadata, due_at, hold)
SELECT u, t, k, p, m, GREATEST(d, now()), CASE WHEN d > clock_timestamp() THEN 'retry' END
FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::jsonb[], $6::timestamptz[])
    WITH ORDINALITY AS r(u, t, k, p, m, d, ord)
ORDER BY ord`, s.table)
		args = append(args, dues)
	}
	if returning {
		q += "\nRETURNING id"
	}
	var ids []int64
	var err error
	switch tx := tx.(type) {
	case pgx.Tx:
		if !returning {
			_, err = tx.Exec(ctx, q, args...)
			break
		}
		var rows pgx.Rows
		if rows, err = tx.Query(ctx, q, args...); err == nil {
			ids, err = pgx.CollectRows(rows, pgx.RowTo[int64])
		}
	case *sql.Tx:
		if !returning {
			_, err = tx.ExecContext(ctx, q, args...)
			break
		}
		var rows *sql.Rows
		if rows, err = tx.QueryContext(ctx, q, args...); err == nil {
			for rows.Next() {
				var id int64
				if err = rows.Scan(&id); err != nil {
					break
				}
				ids = append(ids, id)
			}
			err = errors.Join(err, rows.Err(), rows.Close())
		}
	}
	if err != nil {
		return nil, fmt.Errorf("insert %d outbox rows into %s: %w", n, s.table, err)
	}
	slices.Sort(ids) // RETURNING order is not promised; ids follow record order
	return ids, nil
}

// checkRecord refuses what PostgreSQL would refuse half-way (NUL in text,
// invalid UTF-8) or what could never be published (empty topic).
func checkRecord(r storage.Record) error {
	if r.Topic == "" {
		return fmt.Errorf("%w: empty topic", storage.ErrInvalidRecord)
	}
	for _, f := range [...]struct{ name, v string }{{"uuid", r.UUID}, {"topic", r.Topic}, {"key", r.Key}} {
		if err := checkText(f.v); err != nil {
			return fmt.Errorf("%w: %s: %w", storage.ErrInvalidRecord, f.name, err)
		}
	}
	for k, v := range r.Metadata {
		if err := checkText(k); err != nil {
			return fmt.Errorf("%w: metadata key %q: %w", storage.ErrInvalidRecord, k, err)
		}
		if err := checkText(v); err != nil {
			return fmt.Errorf("%w: metadata %q value: %w", storage.ErrInvalidRecord, k, err)
		}
	}
	return nil
}

func checkText(s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("invalid UTF-8")
	}
	if strings.IndexByte(s, 0) >= 0 {
		return fmt.Errorf("contains a NUL byte, which PostgreSQL text cannot store")
	}
	return nil
}
