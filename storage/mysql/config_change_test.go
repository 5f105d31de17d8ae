package mysql

import (
	"slices"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// sameTable returns a storage on s's table with config (a process
// restarted with a changed configuration).
func sameTable(t *testing.T, s *Storage, config Config) *Storage {
	t.Helper()
	config.Table = s.config.Table
	o, err := New(s.db, config)
	must(t, err)
	return o
}

// parkBehindLeasedHead inserts three records of one key, claims the first
// and parks the other two behind it; it returns their ids.
func parkBehindLeasedHead(t *testing.T, s *Storage) []int64 {
	t.Helper()
	ids := insert(t, s, recs("k", "k", "k")...)
	if got := claim(t, s, "w1", 1, time.Minute); !slices.Equal(idsOf(got), ids[:1]) {
		t.Fatalf("first claim = %v, want %v", idsOf(got), ids[:1])
	}
	if got := claim(t, s, "w2", 10, time.Minute); len(got) != 0 {
		t.Fatalf("claim behind a leased head = %v", idsOf(got))
	}
	if p := parkedIDs(t, s); !slices.Equal(p, ids[1:]) {
		t.Fatalf("parked %v, want %v", p, ids[1:])
	}
	return ids
}

// TestStrictOrderingTurnedOffStrandsNothing: rows parked under strict
// ordering are claimable once a process without it (which parks nothing
// and sets nothing free on ack) takes over, and after strict ordering is
// turned on again.
func TestStrictOrderingTurnedOffStrandsNothing(t *testing.T) {
	t.Parallel()
	t.Run("off", func(t *testing.T) {
		t.Parallel()
		s := newStore(t, Config{})
		ids := parkBehindLeasedHead(t, s)
		off := sameTable(t, s, Config{DisableStrictOrdering: true})
		must(t, off.Ack(t.Context(), storage.AckParams{Records: liveRefs(t, s, ids[0]), WorkerID: "w1"}))
		if got := claim(t, off, "w3", 10, time.Minute); !slices.Equal(idsOf(got), ids[1:]) {
			t.Fatalf("claim without strict ordering = %v, want %v", idsOf(got), ids[1:])
		}
	})
	t.Run("on again", func(t *testing.T) {
		t.Parallel()
		s := newStore(t, Config{})
		ids := parkBehindLeasedHead(t, s)
		off := sameTable(t, s, Config{DisableStrictOrdering: true})
		must(t, off.Ack(t.Context(), storage.AckParams{Records: liveRefs(t, s, ids[0]), WorkerID: "w1"}))
		on := sameTable(t, s, Config{})
		if got := claim(t, on, "w3", 10, time.Minute); !slices.Equal(idsOf(got), ids[1:]) {
			t.Fatalf("claim with strict ordering on again = %v, want %v", idsOf(got), ids[1:])
		}
	})
}

// TestHoldOnDeadLetterTurnedOffStrandsNothing: rows parked behind a dead
// row with HoldOnDeadLetter are claimable once a process without it takes
// over, and the key keeps its order.
func TestHoldOnDeadLetterTurnedOffStrandsNothing(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{HoldOnDeadLetter: true})
	ids := insert(t, s, recs("k", "k", "k")...)
	if got := claim(t, s, "w1", 1, time.Minute); !slices.Equal(idsOf(got), ids[:1]) {
		t.Fatalf("first claim = %v, want %v", idsOf(got), ids[:1])
	}
	must(t, s.DeadLetter(t.Context(), storage.DeadLetterParams{Record: liveRef(t, s, ids[0]), WorkerID: "w1", Error: "poison"}))
	if got := claim(t, s, "w2", 10, time.Minute); len(got) != 0 {
		t.Fatalf("claim behind a dead head = %v", idsOf(got))
	}
	if p := parkedIDs(t, s); !slices.Equal(p, ids[1:]) {
		t.Fatalf("parked %v, want %v", p, ids[1:])
	}
	off := sameTable(t, s, Config{})
	if got := claim(t, off, "w3", 1, time.Minute); !slices.Equal(idsOf(got), ids[1:2]) {
		t.Fatalf("claim without HoldOnDeadLetter = %v, want %v", idsOf(got), ids[1:2])
	}
	// The row behind it waits for it as usual.
	if got := claim(t, off, "w3", 10, time.Minute); len(got) != 0 {
		t.Fatalf("claim behind a leased head = %v", idsOf(got))
	}
}
