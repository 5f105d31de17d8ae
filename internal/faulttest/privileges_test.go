package faulttest

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// TestLeastPrivileges backs the privilege table of docs/reliability.md: a
// producer role with INSERT on the table and USAGE on its sequence can
// publish, a forwarder role with SELECT, UPDATE and DELETE on it (an ack moves
// the row to the delivered table) can claim, ack, nack, release, dead-letter,
// re-drive, read stats and listen, and it needs DELETE on the delivered table
// only for Purge. Neither runs DDL.
func TestLeastPrivileges(t *testing.T) {
	admin := openPool(t, ApplicationNamePrefix+"-privileges", 4)
	ctx := context.Background()
	tag := strings.ToLower(watermill.NewShortUUID())[:10]
	schema, producer, forwarder := "txo_priv_"+tag, "txo_producer_"+tag, "txo_forwarder_"+tag
	for _, role := range []string{producer, forwarder} {
		if _, err := admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if _, err := admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+role); err != nil {
				t.Errorf("drop role %s: %v", role, err)
			}
		})
	}
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	table := schema + ".outbox"
	cfg := postgres.Config{Table: table, NotifyChannel: "txo_priv_" + tag}
	owner, err := postgres.New(admin, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := owner.CreateSchema(ctx); err != nil {
		t.Fatal(err)
	}
	for _, grant := range []string{
		"GRANT USAGE ON SCHEMA " + schema + " TO " + producer + ", " + forwarder,
		"GRANT INSERT ON " + table + " TO " + producer,
		"GRANT USAGE ON SEQUENCE " + table + "_id_seq TO " + producer,
		"GRANT SELECT, UPDATE, DELETE ON " + table + " TO " + forwarder,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON " + owner.LeaseTable() + ", " + owner.WorkerTable() + " TO " + forwarder,
		"GRANT SELECT, INSERT ON " + owner.DeliveredTable() + " TO " + forwarder,
		"GRANT SELECT ON " + owner.SkippedTable() + " TO " + forwarder, // Stats counts the skipped records
	} {
		if _, err := admin.Exec(ctx, grant); err != nil {
			t.Fatalf("%s: %v", grant, err)
		}
	}
	connect := func(role string) *pgxpool.Pool {
		pc, err := pgxpool.ParseConfig(databaseURL())
		if err != nil {
			t.Fatal(err)
		}
		pc.ConnConfig.User = role
		pc.ConnConfig.RuntimeParams["application_name"] = ApplicationNamePrefix + "-" + role
		p, err := pgxpool.NewWithConfig(ctx, pc)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		if err := p.Ping(ctx); err != nil {
			t.Fatalf("connect as %s (the test needs trust or password-less auth for new roles): %v", role, err)
		}
		return p
	}

	// The producer publishes two records inside its own transaction.
	prodPool := connect(producer)
	prodStore, err := postgres.New(prodPool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := prodPool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := txoutbox.NewTxPublisher(prodStore, tx, txoutbox.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		msg := message.NewMessage(watermill.NewUUID(), []byte("p"))
		msg.Metadata.Set(txoutbox.MetadataKey, "k"+string(rune('a'+i)))
		if err := pub.Publish("t", msg); err != nil {
			t.Fatalf("publish as the producer role: %v", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit as the producer role: %v", err)
	}
	if err := prodStore.CreateSchema(ctx); !isPermissionDenied(err) {
		t.Errorf("producer role ran DDL (CreateSchema: %v); want permission denied", err)
	}

	// The forwarder does everything but Purge.
	fwdPool := connect(forwarder)
	fwd, err := postgres.New(fwdPool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	woken := make(chan struct{}, 1)
	lctx, stopListen := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		_ = fwd.Listen(lctx, func() {
			select {
			case woken <- struct{}{}:
			default:
			}
		})
	})
	defer func() { stopListen(); wg.Wait() }()
	select {
	case <-woken: // Listen wakes once after it connected
	case <-time.After(10 * time.Second):
		t.Fatal("listener as the forwarder role never connected")
	}

	recs, err := fwd.Claim(ctx, storage.ClaimParams{BatchSize: 10, Lease: time.Minute, WorkerID: "w"})
	if err != nil || len(recs) != 4 {
		t.Fatalf("claim as the forwarder role: %d records, %v", len(recs), err)
	}
	steps := []struct {
		name string
		err  error
	}{
		{"ack", fwd.Ack(ctx, storage.AckParams{Records: []storage.ClaimRef{recs[0].Ref()}, WorkerID: "w"})},
		{"nack", fwd.Nack(ctx, storage.NackParams{Record: recs[1].Ref(), WorkerID: "w", Error: "e", RetryAt: time.Now()})},
		{"release", fwd.Release(ctx, storage.ReleaseParams{Records: []storage.ClaimRef{recs[2].Ref()}, WorkerID: "w", RetryAt: time.Now()})},
		{"dead-letter", fwd.DeadLetter(ctx, storage.DeadLetterParams{Record: recs[3].Ref(), WorkerID: "w", Error: "e"})},
	}
	_, err = fwd.Redrive(ctx, storage.RedriveParams{IDs: []int64{recs[3].ID}})
	steps = append(steps, struct {
		name string
		err  error
	}{"redrive", err})
	_, err = fwd.Stats(ctx)
	steps = append(steps, struct {
		name string
		err  error
	}{"stats", err})
	for _, s := range steps {
		if s.err != nil {
			t.Errorf("%s as the forwarder role: %v", s.name, s.err)
		}
	}
	if err := fwd.CreateSchema(ctx); !isPermissionDenied(err) {
		t.Errorf("forwarder role ran DDL (CreateSchema: %v); want permission denied", err)
	}
	if _, err := fwd.Purge(ctx, 0); !isPermissionDenied(err) {
		t.Errorf("Purge without DELETE on the delivered table: %v, want permission denied", err)
	}
	if _, err := admin.Exec(ctx, "GRANT DELETE ON "+owner.DeliveredTable()+" TO "+forwarder); err != nil {
		t.Fatal(err)
	}
	if n, err := fwd.Purge(ctx, 0); err != nil || n != 1 {
		t.Errorf("Purge with DELETE: purged %d, %v; want the 1 delivered record", n, err)
	}
}

// isPermissionDenied reports SQLSTATE 42501 (insufficient_privilege).
func isPermissionDenied(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42501"
}
