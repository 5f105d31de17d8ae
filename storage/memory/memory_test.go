package memory_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/memory"
	"github.com/txoutbox/txoutbox/storage/storagetest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// harness runs the contract suite against memory storages made with config.
func harness(config memory.Config) storagetest.Harness {
	return storagetest.Harness{
		New:             func(t *testing.T) storage.Storage { return memory.New(config) },
		DelayedDelivery: true,
		Insert: func(t *testing.T, s storage.Storage, records ...storage.Record) []int64 {
			return s.(*memory.Storage).Add(records...)
		},
		Inspect: func(t *testing.T, s storage.Storage, id int64) storagetest.State {
			t.Helper()
			st, ok := s.(*memory.Storage).Get(id)
			if !ok {
				t.Fatalf("record %d is not in the storage", id)
			}
			return storagetest.State{
				Status:      st.Status,
				Attempts:    st.Record.Attempts,
				LastError:   st.LastError,
				LeasedBy:    st.LeasedBy,
				LeasedUntil: st.LeasedUntil,
				DueAt:       st.DueAt,
			}
		},
		StrictOrdering: !config.DisableStrictOrdering,
		NewHoldOnDeadLetter: func(t *testing.T) storage.Storage {
			c := config
			c.HoldOnDeadLetter = true
			return memory.New(c)
		},
		Parallel: true,
	}
}

func TestContract(t *testing.T) {
	t.Run("StrictOrdering", func(t *testing.T) {
		t.Parallel()
		storagetest.Run(t, harness(memory.Config{}))
	})
	t.Run("NoStrictOrdering", func(t *testing.T) {
		t.Parallel()
		storagetest.Run(t, harness(memory.Config{DisableStrictOrdering: true}))
	})
}

// fakeClock is a clock tests move by hand.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func newClock() *fakeClock {
	return &fakeClock{now: time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)}
}

func TestLeaseFollowsConfiguredClock(t *testing.T) {
	clock := newClock()
	s := memory.New(memory.Config{Now: clock.Now})
	ctx := t.Context()
	id := s.Add(storage.Record{Topic: "t"})[0]

	claim := func(worker string) []storage.Record {
		t.Helper()
		got, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 1, Lease: time.Second, WorkerID: worker})
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	if got := claim("w1"); len(got) != 1 || got[0].ID != id {
		t.Fatalf("first claim returned %v, want record %d", got, id)
	}
	st, _ := s.Get(id)
	if want := clock.Now().Add(time.Second); !st.LeasedUntil.Equal(want) || st.LeasedBy != "w1" {
		t.Fatalf("lease is %q until %v, want w1 until %v", st.LeasedBy, st.LeasedUntil, want)
	}
	clock.Advance(999 * time.Millisecond)
	if got := claim("w2"); len(got) != 0 {
		t.Fatalf("claim 1ms before the lease ends returned %v, want nothing", got)
	}
	clock.Advance(time.Millisecond)
	if got := claim("w2"); len(got) != 1 || got[0].Attempts != 2 {
		t.Fatalf("claim when the lease ends returned %v, want record %d with attempts 2", got, id)
	}
}

func TestStatsAndPurgeFollowConfiguredClock(t *testing.T) {
	clock := newClock()
	s := memory.New(memory.Config{Now: clock.Now})
	ctx := t.Context()
	ids := s.Add(storage.Record{Topic: "t"}, storage.Record{Topic: "t"})
	clock.Advance(time.Minute)
	got, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 1, Lease: time.Hour, WorkerID: "w"})
	if err != nil || len(got) != 1 || got[0].ID != ids[0] {
		t.Fatalf("Claim returned %v, %v; want record %d", got, err, ids[0])
	}
	if err := s.Ack(ctx, storage.AckParams{Records: storage.Refs(got), WorkerID: "w"}); err != nil {
		t.Fatal(err)
	}
	clock.Advance(time.Minute)

	st, err := s.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := storage.Stats{Pending: 1, Delivered: 1, OldestPendingAge: 2 * time.Minute, OldestDeliveredAge: time.Minute}
	if st != want {
		t.Fatalf("Stats = %+v, want %+v", st, want)
	}

	// Delivered one minute ago: kept by Purge(1m), deleted by Purge(59s).
	if n, err := s.Purge(ctx, time.Minute); err != nil || n != 0 {
		t.Fatalf("Purge(1m) = %d, %v, want 0, nil", n, err)
	}
	if n, err := s.Purge(ctx, 59*time.Second); err != nil || n != 1 {
		t.Fatalf("Purge(59s) = %d, %v, want 1, nil", n, err)
	}
	if _, ok := s.Get(ids[0]); ok {
		t.Fatalf("record %d is still there after Purge", ids[0])
	}
	if _, err := s.Purge(ctx, -time.Second); err == nil {
		t.Fatal("Purge(-1s) returned no error")
	}
}

func TestAddCopiesInput(t *testing.T) {
	s := memory.New(memory.Config{})
	payload := []byte("abc")
	meta := map[string]string{"k": "v"}
	id := s.Add(storage.Record{Topic: "t", Payload: payload, Metadata: meta})[0]
	payload[0] = 'X'
	meta["k"] = "changed"

	st, ok := s.Get(id)
	if !ok {
		t.Fatalf("Get(%d) found nothing", id)
	}
	if string(st.Record.Payload) != "abc" || st.Record.Metadata["k"] != "v" {
		t.Fatalf("stored record changed with the caller's slices: payload %q, metadata %v", st.Record.Payload, st.Record.Metadata)
	}
	if _, ok := s.Get(id + 1); ok {
		t.Fatalf("Get(%d) found a record that was never added", id+1)
	}
}

func TestInvalidCalls(t *testing.T) {
	s := memory.New(memory.Config{})
	ctx := t.Context()
	for _, p := range []storage.ClaimParams{
		{BatchSize: 0, Lease: time.Second, WorkerID: "w"},
		{BatchSize: 1, Lease: 0, WorkerID: "w"},
		{BatchSize: 1, Lease: time.Second},
	} {
		if _, err := s.Claim(ctx, p); err == nil {
			t.Errorf("Claim(%+v) returned no error", p)
		}
	}
	if _, err := s.Redrive(ctx, storage.RedriveParams{}); !errors.Is(err, memory.ErrInvalidRedrive) {
		t.Errorf("Redrive with no IDs nor Topic returned %v, want ErrInvalidRedrive", err)
	}

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.Claim(cancelled, storage.ClaimParams{BatchSize: 1, Lease: time.Second, WorkerID: "w"}); !errors.Is(err, context.Canceled) {
		t.Errorf("Claim with a cancelled context returned %v, want context.Canceled", err)
	}
	if err := s.Ack(cancelled, storage.AckParams{Records: []storage.ClaimRef{{ID: 1, Attempt: 1}}, WorkerID: "w"}); !errors.Is(err, context.Canceled) {
		t.Errorf("Ack with a cancelled context returned %v, want context.Canceled", err)
	}
}

func TestEmptyWorkerIDNeverMatches(t *testing.T) {
	s := memory.New(memory.Config{})
	id := s.Add(storage.Record{Topic: "t"})[0]
	// The record is not leased: a write-back with an empty worker id must not
	// match its empty lease holder.
	if err := s.DeadLetter(t.Context(), storage.DeadLetterParams{Record: storage.ClaimRef{ID: id}, Error: "x"}); err != nil {
		t.Fatal(err)
	}
	if st, _ := s.Get(id); st.Status != storage.StatusPending {
		t.Fatalf("an unleased record was dead-lettered by an empty worker id: status %s", st.Status)
	}
}
