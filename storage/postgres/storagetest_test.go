package postgres

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/storagetest"
)

func harness(config Config) storagetest.Harness {
	return harnessOf(config, func(s *Storage) storage.Storage { return s })
}

// harnessOf is the harness of the storages wrap makes of config's.
func harnessOf(config Config, wrap func(*Storage) storage.Storage) storagetest.Harness {
	unwrap := func(s storage.Storage) *Storage {
		switch w := s.(type) {
		case leanOnly:
			return w.Storage
		case parkingInFlight:
			return w.Storage
		}
		return s.(*Storage)
	}
	h := storagetest.Harness{
		New: func(t *testing.T) storage.Storage {
			return wrap(newStore(t, config))
		},
		DelayedDelivery: true,
		Insert: func(t *testing.T, s storage.Storage, records ...storage.Record) []int64 {
			return insert(t, unwrap(s), records...)
		},
		Inspect: func(t *testing.T, s storage.Storage, id int64) storagetest.State {
			return storagetest.State(inspect(t, unwrap(s), id))
		},
		StrictOrdering: !config.DisableStrictOrdering,
		Parallel:       true,
	}
	if !config.DisableStrictOrdering {
		hold := config
		hold.HoldOnDeadLetter = true
		h.NewHoldOnDeadLetter = func(t *testing.T) storage.Storage { return wrap(newStore(t, hold)) }
	}
	return h
}

func TestContractStrict(t *testing.T) {
	t.Parallel()
	storagetest.Run(t, harness(Config{}))
}

// leanOnly is a strict storage whose every claim is the lean one, whatever
// is held: the claim a stale answer of the wake before chooses (see Claim).
type leanOnly struct{ *Storage }

func (l leanOnly) Claim(ctx context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	l.nothingHeld.Store(true)
	return l.Storage.Claim(ctx, p)
}

// TestContractStrictLeanClaims: the lean claim alone keeps the contract,
// strict order included, with rows held, parked and in flight.
func TestContractStrictLeanClaims(t *testing.T) {
	t.Parallel()
	storagetest.Run(t, harnessOf(Config{}, func(s *Storage) storage.Storage { return leanOnly{s} }))
}

// parkingInFlight is a strict storage whose every claim is a full one that
// parks every row it passes behind a record in flight: what a claim after a
// walk over a hot key's backlog does (see flight in buildQueries).
type parkingInFlight struct{ *Storage }

func (p parkingInFlight) Claim(ctx context.Context, c storage.ClaimParams) ([]storage.Record, error) {
	p.walkedFar.Store(true)
	return p.Storage.Claim(ctx, c)
}

// inFlightParker makes s a parkingInFlight.
func inFlightParker(s *Storage) storage.Storage {
	s.parkFlightMin = 1
	return parkingInFlight{s}
}

// TestContractStrictParkingInFlight: the contract, strict order included,
// holds with rows parked behind records in flight at every claim, set free
// by the acks and dead-letters of those records.
func TestContractStrictParkingInFlight(t *testing.T) {
	t.Parallel()
	storagetest.Run(t, harnessOf(Config{}, inFlightParker))
}

func TestContractNotStrict(t *testing.T) {
	t.Parallel()
	storagetest.Run(t, harness(Config{DisableStrictOrdering: true}))
}

// TestDeleteOnAck checks what DeleteOnAck changes: an ack deletes the row
// (still fenced on the worker), Stats counts no delivered rows and Purge finds
// none, while nack and dead-letter keep theirs. Claims are the same code as
// without it, which the contract suite covers.
func TestDeleteOnAck(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{DeleteOnAck: true})
	ctx := t.Context()
	ids := insert(t, s, recs("a", "b", "", "")...)
	got := claim(t, s, "w", 10, time.Minute)
	if len(got) != 4 {
		t.Fatalf("claimed %v, want all 4", idsOf(got))
	}
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[:2]...), WorkerID: "other"}))
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[:2]...), WorkerID: "w"}))
	must(t, s.DeadLetter(ctx, storage.DeadLetterParams{Record: liveRef(t, s, ids[2]), WorkerID: "w", Error: "boom"}))
	count := func(id int64) int {
		var n int
		must(t, s.pool.QueryRow(ctx, fmt.Sprintf("SELECT count(*) FROM %s WHERE id = $1", s.table), id).Scan(&n))
		return n
	}
	if count(ids[0]) != 0 || count(ids[1]) != 0 {
		t.Errorf("acked rows still there")
	}
	if st := inspect(t, s, ids[2]); st.Status != storage.StatusDead {
		t.Errorf("dead-lettered row: status %q, want dead", st.Status)
	}
	if st := inspect(t, s, ids[3]); st.Status != storage.StatusPending || st.LeasedBy != "w" {
		t.Errorf("unacked row: %+v, want pending and leased by w", st)
	}
	// A stale worker's ack is fenced out: the row stays.
	must(t, s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[3:]...), WorkerID: "other"}))
	if count(ids[3]) != 1 {
		t.Error("ack by another worker deleted the row")
	}
	st, err := s.Stats(ctx)
	must(t, err)
	if st.Delivered != 0 || st.Pending != 1 || st.Dead != 1 {
		t.Errorf("Stats = %+v, want 1 pending, 1 dead, 0 delivered", st)
	}
	n, err := s.Purge(ctx, 0)
	must(t, err)
	if n != 0 {
		t.Errorf("Purge deleted %d rows, want 0", n)
	}
}
