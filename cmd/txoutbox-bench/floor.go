package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox"
)

// The floor relay is the storage contract's minimum in bare SQL, on the
// same row shape as txoutbox's table with a primary key only: a claim that
// counts the attempt and writes a lease on up to a batch of pending, due,
// unleased rows in id order (FOR UPDATE SKIP LOCKED), committed; one
// Publish call of the batch; an ack that deletes the batch, committed. No
// strict ordering, no retries, no index beside the primary key: what the
// database allows a relay on this machine, so that every drain figure
// also reads as a fraction of it.

// floorLease is the lease the floor's claim writes (never relied on: the
// floor's loops never fail).
const floorLease = 30 * time.Second

// floorMessage builds the message of a claimed row.
func floorMessage(uuid string, payload, metadata []byte) (*message.Message, error) {
	m := message.NewMessage(uuid, payload)
	if len(metadata) > 0 {
		if err := json.Unmarshal(metadata, &m.Metadata); err != nil {
			return nil, fmt.Errorf("floor: metadata of %s: %w", uuid, err)
		}
	}
	return m, nil
}

// floorLoops runs n claim-publish-ack loops until ctx is done; an error
// stops its loop (the run then stalls, and the bench reports it).
func floorLoops(ctx context.Context, n int, poll time.Duration, once func(ctx context.Context, worker string) (int, error), progress func(string, ...any)) func() {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for i := range max(n, 1) {
		worker := fmt.Sprintf("floor-%d", i)
		wg.Go(func() {
			for ctx.Err() == nil {
				got, err := once(ctx, worker)
				if err != nil {
					if ctx.Err() == nil {
						progress("floor %s: %v", worker, err)
					}
					return
				}
				if got == 0 {
					select {
					case <-ctx.Done():
					case <-time.After(poll):
					}
				}
			}
		})
	}
	return func() { cancel(); wg.Wait() }
}

// ---- PostgreSQL ----

type floorRelay struct {
	cfg      relayConfig
	prodPool *pgxpool.Pool
	fwdPool  *pgxpool.Pool
	table    string
	claim    string
	ack      string
}

func newFloorRelay(cfg relayConfig, _ []byte) *floorRelay {
	t := pgx.Identifier{cfg.name}.Sanitize()
	return &floorRelay{cfg: cfg, table: t,
		claim: `UPDATE ` + t + ` SET attempts = attempts + 1, leased_by = $1, leased_until = now() + $2::interval
WHERE id = ANY(ARRAY(
    SELECT id FROM ` + t + `
    WHERE due_at <= now() AND (leased_until IS NULL OR leased_until < now())
    ORDER BY id LIMIT $3
    FOR UPDATE SKIP LOCKED))
RETURNING id, uuid, topic, payload, metadata`,
		ack: `DELETE FROM ` + t + ` WHERE id = ANY($1)`,
	}
}

func (r *floorRelay) Setup(ctx context.Context) error {
	var err error
	if r.prodPool, err = newPool(ctx, r.cfg.url, max(r.cfg.producers, 1)+1); err != nil {
		return err
	}
	if r.fwdPool, err = newPool(ctx, r.cfg.url, max(r.cfg.forwarders, 1)+1); err != nil {
		return err
	}
	_, err = r.fwdPool.Exec(ctx, `CREATE TABLE `+r.table+` (
    id           BIGSERIAL   PRIMARY KEY,
    uuid         TEXT        NOT NULL,
    topic        TEXT        NOT NULL,
    key          TEXT        NOT NULL DEFAULT '',
    payload      BYTEA,
    metadata     JSONB,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    due_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    attempts     INTEGER     NOT NULL DEFAULT 0,
    leased_by    TEXT,
    leased_until TIMESTAMPTZ
)`)
	if err != nil {
		return fmt.Errorf("floor: create table: %w", err)
	}
	return nil
}

// PublishTx inserts the messages in one statement, as txoutbox's storage
// does (unnest of arrays), and commits.
func (r *floorRelay) PublishTx(ctx context.Context, msgs []*message.Message) error {
	uuids, topics, keys := make([]string, len(msgs)), make([]string, len(msgs)), make([]string, len(msgs))
	payloads, metas := make([][]byte, len(msgs)), make([]string, len(msgs))
	for i, m := range msgs {
		md, err := json.Marshal(m.Metadata)
		if err != nil {
			return err
		}
		uuids[i], topics[i], keys[i], payloads[i], metas[i] = m.UUID, destTopic, m.Metadata.Get(txoutbox.MetadataKey), m.Payload, string(md)
	}
	tx, err := r.prodPool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	if _, err := tx.Exec(ctx, `INSERT INTO `+r.table+` (uuid, topic, key, payload, metadata)
SELECT u, t, k, p, m FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::jsonb[]) AS x(u, t, k, p, m)`,
		uuids, topics, keys, payloads, metas); err != nil {
		return fmt.Errorf("floor: insert: %w", err)
	}
	return tx.Commit(ctx)
}

func (r *floorRelay) Start(ctx context.Context, target message.Publisher) (func(), error) {
	once := func(ctx context.Context, worker string) (int, error) {
		rows, err := r.fwdPool.Query(ctx, r.claim, worker, floorLease, r.cfg.batch)
		if err != nil {
			return 0, fmt.Errorf("claim: %w", err)
		}
		var ids []int64
		var msgs []*message.Message
		var topic string
		for rows.Next() {
			var id int64
			var uuid string
			var payload, metadata []byte
			if err := rows.Scan(&id, &uuid, &topic, &payload, &metadata); err != nil {
				rows.Close()
				return 0, err
			}
			m, err := floorMessage(uuid, payload, metadata)
			if err != nil {
				rows.Close()
				return 0, err
			}
			ids, msgs = append(ids, id), append(msgs, m)
		}
		if err := rows.Err(); err != nil {
			return 0, fmt.Errorf("claim: %w", err)
		}
		if len(ids) == 0 {
			return 0, nil
		}
		if err := target.Publish(topic, msgs...); err != nil {
			return 0, fmt.Errorf("publish: %w", err)
		}
		if _, err := r.fwdPool.Exec(ctx, r.ack, ids); err != nil {
			return 0, fmt.Errorf("ack: %w", err)
		}
		return len(ids), nil
	}
	return floorLoops(ctx, r.cfg.forwarders, r.cfg.poll, once, progressf), nil
}

func (r *floorRelay) Teardown(ctx context.Context) error {
	var err error
	if r.fwdPool != nil {
		_, err = r.fwdPool.Exec(ctx, "DROP TABLE IF EXISTS "+r.table)
		r.fwdPool.Close()
	}
	if r.prodPool != nil {
		r.prodPool.Close()
	}
	return err
}

// ---- MySQL/MariaDB ----

// floorMyRelay is the floor on MySQL/MariaDB: there is no UPDATE ...
// RETURNING, so the claim is the locking SELECT of the rows and the UPDATE
// of their lease in one transaction.
type floorMyRelay struct {
	cfg    relayConfig
	prodDB *sql.DB
	fwdDB  *sql.DB
	table  string
}

func newFloorMyRelay(cfg relayConfig) *floorMyRelay {
	return &floorMyRelay{cfg: cfg, table: "`" + cfg.name + "`"}
}

func (r *floorMyRelay) Setup(ctx context.Context) error {
	var err error
	if r.prodDB, err = openMySQL(r.cfg.url, max(r.cfg.producers, 1)+1); err != nil {
		return err
	}
	if r.fwdDB, err = openMySQL(r.cfg.url, max(r.cfg.forwarders, 1)+1); err != nil {
		return err
	}
	_, err = r.fwdDB.ExecContext(ctx, `CREATE TABLE `+r.table+` (
    id           BIGINT       NOT NULL AUTO_INCREMENT,
    uuid         VARCHAR(255) NOT NULL,
    topic        VARCHAR(255) NOT NULL,
    `+"`key`"+`        VARCHAR(255) NOT NULL DEFAULT '',
    payload      LONGBLOB,
    metadata     JSON,
    created_at   DATETIME(6)  NOT NULL,
    due_at       DATETIME(6)  NOT NULL,
    attempts     INT          NOT NULL DEFAULT 0,
    leased_by    VARCHAR(255),
    leased_until DATETIME(6),
    PRIMARY KEY (id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin`)
	if err != nil {
		return fmt.Errorf("floor: create table: %w", err)
	}
	return nil
}

func (r *floorMyRelay) PublishTx(ctx context.Context, msgs []*message.Message) error {
	args := make([]any, 0, 5*len(msgs))
	for _, m := range msgs {
		md, err := json.Marshal(m.Metadata)
		if err != nil {
			return err
		}
		args = append(args, m.UUID, destTopic, m.Metadata.Get(txoutbox.MetadataKey), m.Payload, string(md))
	}
	tx, err := r.prodDB.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback()                                                                                      //nolint:errcheck // no-op after commit
	q := "INSERT INTO " + r.table + " (uuid, topic, `key`, payload, metadata, created_at, due_at) VALUES " + //nolint:gosec // the bench's own table; values are bound
		strings.TrimSuffix(strings.Repeat("(?, ?, ?, ?, ?, NOW(6), NOW(6)),", len(msgs)), ",")
	if _, err := tx.ExecContext(ctx, q, args...); err != nil {
		return fmt.Errorf("floor: insert: %w", err)
	}
	return tx.Commit()
}

func (r *floorMyRelay) Start(ctx context.Context, target message.Publisher) (func(), error) {
	sel := "SELECT id, uuid, topic, payload, metadata FROM " + r.table + //nolint:gosec // the bench's own table; values are bound
		" WHERE due_at <= NOW(6) AND (leased_until IS NULL OR leased_until < NOW(6)) ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED"
	once := func(ctx context.Context, worker string) (int, error) {
		tx, err := r.fwdDB.BeginTx(ctx, nil)
		if err != nil {
			return 0, err
		}
		defer tx.Rollback() //nolint:errcheck // no-op after commit
		ids, msgs, topic, err := floorMySQLRows(ctx, tx, sel, r.cfg.batch)
		if err != nil {
			return 0, fmt.Errorf("claim: %w", err)
		}
		if len(ids) == 0 {
			return 0, tx.Commit()
		}
		in := strings.TrimSuffix(strings.Repeat("?,", len(ids)), ",")
		lease := "UPDATE " + r.table + " SET attempts = attempts + 1, leased_by = ?, leased_until = NOW(6) + INTERVAL ? SECOND WHERE id IN (" + in + ")" //nolint:gosec // the bench's own table and placeholders; values are bound
		if _, err := tx.ExecContext(ctx, lease,
			append([]any{worker, int(floorLease / time.Second)}, ids...)...); err != nil {
			return 0, fmt.Errorf("claim: lease: %w", err)
		}
		if err := tx.Commit(); err != nil {
			return 0, fmt.Errorf("claim: commit: %w", err)
		}
		if err := target.Publish(topic, msgs...); err != nil {
			return 0, fmt.Errorf("publish: %w", err)
		}
		ack := "DELETE FROM " + r.table + " WHERE id IN (" + in + ")" //nolint:gosec // the bench's own table and placeholders; values are bound
		if _, err := r.fwdDB.ExecContext(ctx, ack, ids...); err != nil {
			return 0, fmt.Errorf("ack: %w", err)
		}
		return len(ids), nil
	}
	return floorLoops(ctx, r.cfg.forwarders, r.cfg.poll, once, progressf), nil
}

func (r *floorMyRelay) Teardown(ctx context.Context) error {
	var err error
	if r.fwdDB != nil {
		_, err = r.fwdDB.ExecContext(ctx, "DROP TABLE IF EXISTS "+r.table)
		_ = r.fwdDB.Close()
	}
	if r.prodDB != nil {
		_ = r.prodDB.Close()
	}
	return err
}

// floorMySQLRows runs the floor's locking SELECT on MySQL and returns the
// ids and messages of the rows it locked.
func floorMySQLRows(ctx context.Context, tx *sql.Tx, sel string, batch int) (ids []any, msgs []*message.Message, topic string, err error) {
	rows, err := tx.QueryContext(ctx, sel, batch)
	if err != nil {
		return nil, nil, "", err
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		var uuid string
		var payload, metadata []byte
		if err := rows.Scan(&id, &uuid, &topic, &payload, &metadata); err != nil {
			return nil, nil, "", err
		}
		m, err := floorMessage(uuid, payload, metadata)
		if err != nil {
			return nil, nil, "", err
		}
		ids, msgs = append(ids, id), append(msgs, m)
	}
	return ids, msgs, topic, rows.Err()
}
