package postgres

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox/storage"
)

// claimTracer records which claim statement each batch sent: "lean", "full"
// or nothing for other statements.
type claimTracer struct {
	mu         sync.Mutex
	lean, full string
	sent       []string
}

func (c *claimTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (c *claimTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *claimTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (c *claimTracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch data.SQL {
	case c.lean:
		c.sent = append(c.sent, "lean")
	case c.full:
		c.sent = append(c.sent, "full")
	}
}

func (c *claimTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// last returns the claim statement the last claim sent.
func (c *claimTracer) last(t *testing.T) string {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.sent) == 0 {
		t.Fatal("no claim statement traced")
	}
	return c.sent[len(c.sent)-1]
}

// tracedStore returns a storage on the table of s, through a pool whose
// connections trace the claim statements they send.
func tracedStore(t *testing.T, s *Storage) (*Storage, *claimTracer) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testDatabaseURL())
	must(t, err)
	tr := &claimTracer{lean: s.q.leanClaim, full: s.q.claim}
	cfg.ConnConfig.Tracer = tr
	cfg.MaxConns = 2
	p, err := pgxpoolWithConfig(t, cfg)
	must(t, err)
	traced, err := New(p, s.config)
	must(t, err)
	return traced, tr
}

// claimedWith claims up to batch records as worker "w" and fails the test
// unless the claim handed out wantIDs, in order, with the claim statement
// want ("lean" or "full").
func claimedWith(t *testing.T, s *Storage, tr *claimTracer, batch int, want string, wantIDs ...int64) {
	t.Helper()
	got := idsOf(claim(t, s, "w", batch, time.Minute))
	if c := tr.last(t); !slices.Equal(got, wantIDs) || c != want {
		t.Fatalf("claimed %v with the %s claim, want %v with the %s one", got, c, wantIDs, want)
	}
}

// TestClaimIsLeanWhileNothingIsHeld: a strict claim is the lean one (no
// followers, no parking) when the wake of the claim before found no row
// held, and the full one after this storage's nack or release, and while
// some row is held.
func TestClaimIsLeanWhileNothingIsHeld(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	base := newStore(t, Config{})
	s, tr := tracedStore(t, base)
	ids := insert(t, s, recs("a", "b", "c", "d")...)
	claimedWith(t, s, tr, 1, "full", ids[0]) // nothing known yet
	claimedWith(t, s, tr, 1, "lean", ids[1])
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[:2]...), WorkerID: "w"}))
	claimedWith(t, s, tr, 1, "lean", ids[2])
	must(t, s.Release(ctx, storage.ReleaseParams{Records: liveRefs(t, s, ids[2:3]...), WorkerID: "w", RetryAt: time.Now().Add(time.Hour)}))
	claimedWith(t, s, tr, 1, "full", ids[3]) // after this storage's release
	claimedWith(t, s, tr, 1, "full")         // ids[2] waits for its retry
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[3:]...), WorkerID: "w"}))
	_, err := s.pool.Exec(ctx, "UPDATE "+s.table+" SET due_at = now(), hold = NULL WHERE id = $1", ids[2])
	must(t, err)
	claimedWith(t, s, tr, 1, "full", ids[2]) // the wake before saw the retry
	claimedWith(t, s, tr, 1, "lean")
}

// TestStaleLeanClaimKeepsOrder: another storage's nack holds a key back
// between two claims of this one, which therefore runs the lean claim with
// a row held: it hands out nothing behind it, and parks nothing. Its own
// wake saw the row held, so the claim after it is the full one: it parks
// what the lean one left, and takes the parked rows along with their head
// once it is due.
func TestStaleLeanClaimKeepsOrder(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	base := newStore(t, Config{})
	s, tr := tracedStore(t, base)
	ids := insert(t, s, recs("k", "k", "k", "k")...)
	claimedWith(t, s, tr, 1, "full", ids[0])
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[:1]...), WorkerID: "w"}))
	claimedWith(t, s, tr, 1, "lean", ids[1])
	// Another storage on the table nacks it: its hint, not this one's,
	// learns that rows are held now. Its parking leaves out ids[3], as if
	// another transaction had held it (see TestNackParkingSkipsLockedRows).
	must(t, base.Nack(ctx, storage.NackParams{Record: liveRef(t, base, ids[1]), WorkerID: "w", Error: "down", RetryAt: time.Now().Add(time.Hour)}))
	_, err := s.pool.Exec(ctx, "UPDATE "+s.table+" SET hold = NULL WHERE id = $1", ids[3])
	must(t, err)
	claimedWith(t, s, tr, 10, "lean") // the key's head waits for its retry
	if h := holdOf(t, s, ids[3]); h != "" {
		t.Fatalf("record %d has hold %q after the lean claim, want none: it parks nothing", ids[3], h)
	}
	claimedWith(t, s, tr, 10, "full")
	if h := holdOf(t, s, ids[3]); h != "behind" {
		t.Fatalf("record %d has hold %q after the full claim met it, want behind", ids[3], h)
	}
	_, err = s.pool.Exec(ctx, "UPDATE "+s.table+" SET due_at = now() WHERE id = $1", ids[1])
	must(t, err)                                  // the retry is due
	claimedWith(t, s, tr, 10, "full", ids[1:]...) // the rows parked behind the head along
}

// TestWakeCountsTheRowsItAdopts: a row that a process of schema version 3
// failed for later (no hold) is given its hold by the next claim's wake,
// whose snapshot does not show it held: the wake's answer counts it all the
// same, so the claim after it is the full one, which parks the rows behind
// it. (Found by review: two lean claims in a row.)
func TestWakeCountsTheRowsItAdopts(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	base := newStore(t, Config{})
	s, tr := tracedStore(t, base)
	ids := insert(t, s, recs("k", "k", "k")...)
	claimedWith(t, s, tr, 1, "full", ids[0])
	_, err := s.pool.Exec(ctx, "DELETE FROM "+s.leases+" WHERE id = $1", ids[0])
	must(t, err)
	_, err = s.pool.Exec(ctx, "UPDATE "+s.table+" SET due_at = now() + interval '1 hour', last_error = 'x' WHERE id = $1", ids[0])
	must(t, err)
	claimedWith(t, s, tr, 10, "lean")
	if h := holdOf(t, s, ids[0]); h != "retry" {
		t.Fatalf("record %d has hold %q after the wake, want retry", ids[0], h)
	}
	claimedWith(t, s, tr, 10, "full") // the wake before adopted a row
	if h := holdOf(t, s, ids[1]); h != "behind" {
		t.Fatalf("record %d has hold %q after the full claim, want behind", ids[1], h)
	}
}
