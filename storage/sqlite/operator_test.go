package sqlite

import (
	"context"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

func TestHeldKeysWithoutStrictOrdering(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{DisableStrictOrdering: true})
	insert(t, s, rec("t", "a"), rec("t", "a"))
	claim(t, s, 1, time.Minute, "w")
	held, err := s.HeldKeys(context.Background(), storage.HeldKeysParams{})
	if err != nil || len(held) != 0 {
		t.Fatalf("HeldKeys without strict ordering = %+v, %v; want none", held, err)
	}
	st, err := s.Stats(context.Background())
	if err != nil || st.HeldKeys != 0 || st.Forwarders != 1 {
		t.Fatalf("Stats = %+v, %v", st, err)
	}
}

// TestDeadAtAndRecordStates: a dead record's dead time is kept, and Record
// reads every state.
func TestDeadAtAndRecordStates(t *testing.T) {
	t.Parallel()
	s := newTestStorage(t, Config{})
	clock := useFakeClock(s)
	ctx := context.Background()
	ids := insert(t, s, rec("t", "a"), rec("t", "b"), rec("t", "c"))
	claim(t, s, 3, time.Minute, "w")
	clock.Add(time.Second)
	if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: liveRef(t, s, ids[0]), WorkerID: "w", Error: "x"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Ack(ctx, storage.AckParams{Records: liveRefs(t, s, ids[1:2]...), WorkerID: "w"}); err != nil {
		t.Fatal(err)
	}
	dead, err := s.Record(ctx, ids[0])
	if err != nil || dead.Status != storage.StatusDead || !dead.DeadAt.Equal(clock.Now()) || !dead.DueAt.IsZero() {
		t.Fatalf("dead record = %+v, %v; want DeadAt %v", dead, err, clock.Now())
	}
	done, err := s.Record(ctx, ids[1])
	if err != nil || done.Status != storage.StatusDelivered || done.DeliveredAt.IsZero() {
		t.Fatalf("delivered record = %+v, %v", done, err)
	}
	leased, err := s.Record(ctx, ids[2])
	if err != nil || leased.Status != storage.StatusPending || leased.LeasedBy != "w" || leased.LeasedUntil.IsZero() {
		t.Fatalf("leased record = %+v, %v", leased, err)
	}
	if err := s.Skip(ctx, storage.SkipParams{ID: ids[0], Reason: "r"}); err != nil {
		t.Fatal(err)
	}
	skipped, err := s.Record(ctx, ids[0])
	if err != nil || skipped.Status != storage.StatusSkipped || !skipped.DeadAt.Equal(dead.DeadAt) || skipped.SkippedAt.IsZero() {
		t.Fatalf("skipped record = %+v, %v", skipped, err)
	}
	if dead, err := s.ListDead(ctx, storage.ListDeadParams{}); err != nil || len(dead) != 0 {
		t.Fatalf("ListDead after skip = %+v, %v", dead, err)
	}
}
