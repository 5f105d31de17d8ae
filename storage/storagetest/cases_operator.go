package storagetest

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

func operatorCases() []testCase {
	return []testCase{
		{name: "RedriveByKeyInIDOrder", run: testRedriveByKey},
		{name: "RedriveAllIdempotent", run: testRedriveAll},
		{name: "RedriveRejectsAmbiguousParams", run: testRedriveRejectsTwoWays},
		{name: "RecordInFull", run: testRecordInFull},
		{name: "ListDeadFiltersAndPages", run: testListDead},
		{name: "SkipDeadRecord", run: testSkip},
		{name: "HeldKeys", strict: true, run: testHeldKeys},
	}
}

func holdCases() []testCase {
	return []testCase{
		{name: "DeadHoldsKeyUntilRedriven", hold: true, run: testHoldUntilRedriven},
		{name: "DeadHoldsKeyUntilSkipped", hold: true, run: testHoldUntilSkipped},
		{name: "FailedRecordClaimedWithoutItsKeysRest", hold: true, run: testFailedClaimedAlone},
	}
}

// operator returns the storage's Operator, or skips the case.
func operator(t *testing.T, e *env) storage.Operator {
	t.Helper()
	var op storage.Operator
	if e.h.Operator != nil {
		op = e.h.Operator(t, e.s)
	} else {
		op, _ = e.s.(storage.Operator)
	}
	if op == nil {
		t.Skip("skipped: the storage does not implement storage.Operator")
	}
	return op
}

// kill claims the records (they must be claimable now) and dead-letters
// them with reason.
func (e *env) kill(reason string, dead ...int64) {
	e.t.Helper()
	got := e.claim("killer", 1000, longLease)
	for _, id := range dead {
		if !hasID(got, id) {
			e.t.Fatalf("Claim returned %v, without record %d the case needs to dead-letter", ids(got), id)
		}
		e.deadLetter("killer", id, reason)
	}
	var rest []int64
	for _, r := range got {
		if !slices.Contains(dead, r.ID) {
			rest = append(rest, r.ID)
		}
	}
	e.release("killer", time.Now(), rest...)
}

func testRedriveByKey(t *testing.T, e *env) {
	op := operator(t, e)
	all := e.insert("a", "a", "b", "a")
	e.kill("poison message", all...)

	n, err := op.Redrive(e.ctx, storage.RedriveParams{Key: "a"})
	if err != nil || n != 3 {
		t.Fatalf("Redrive(Key a) returned %d, %v, want 3, nil: it re-drives every dead record of the key", n, err)
	}
	got := e.claim("worker-2", 10, longLease)
	want := []int64{all[0], all[1], all[3]}
	if !slices.Equal(ids(got), want) {
		t.Fatalf("Claim returned %v after re-driving key a, want %v: re-driven records keep their ids and come back in id order; key b stays dead", ids(got), want)
	}
	if n, err := op.Redrive(e.ctx, storage.RedriveParams{Key: "a"}); err != nil || n != 0 {
		t.Fatalf("Redrive(Key a) again returned %d, %v, want 0, nil: re-driving is idempotent", n, err)
	}
}

func testRedriveAll(t *testing.T, e *env) {
	op := operator(t, e)
	all := e.insert("a", "", "b")
	e.kill("poison message", all[0], all[1])
	n, err := op.Redrive(e.ctx, storage.RedriveParams{All: true})
	if err != nil || n != 2 {
		t.Fatalf("Redrive(All) returned %d, %v, want 2, nil", n, err)
	}
	if n, err := op.Redrive(e.ctx, storage.RedriveParams{All: true}); err != nil || n != 0 {
		t.Fatalf("Redrive(All) again returned %d, %v, want 0, nil: re-driving is idempotent", n, err)
	}
	got := e.claim("worker-2", 10, longLease)
	if !slices.Equal(ids(got), all) {
		t.Fatalf("Claim returned %v after Redrive(All), want %v", ids(got), all)
	}
}

func testRedriveRejectsTwoWays(t *testing.T, e *env) {
	op := operator(t, e)
	for _, p := range []storage.RedriveParams{{Key: "a", Topic: topic}, {All: true, IDs: []int64{1}}, {Key: "a", All: true}} {
		if _, err := op.Redrive(e.ctx, p); !errors.Is(err, storage.ErrInvalidRedrive) {
			t.Errorf("Redrive(%+v) returned %v, want an error wrapping storage.ErrInvalidRedrive", p, err)
		}
	}
}

func testRecordInFull(t *testing.T, e *env) {
	op := operator(t, e)
	r := newRecord("a", 7)
	id := e.insertRecords(r)[0]
	e.kill("broker said no", id)
	got, err := op.Record(e.ctx, id)
	if err != nil {
		t.Fatalf("Record(%d) returned error %v", id, err)
	}
	if got.Status != storage.StatusDead || got.LastError != "broker said no" || got.Record.Attempts != 1 ||
		string(got.Record.Payload) != string(r.Payload) || got.Record.Metadata["storagetest_n"] != "7" ||
		got.Record.UUID != r.UUID || got.Record.Key != "a" || got.Record.Topic != topic {
		t.Fatalf("Record(%d) returned %+v, want the record in full: dead, error %q, 1 attempt, payload %s, metadata %v",
			id, got, "broker said no", r.Payload, r.Metadata)
	}
	if _, err := op.Record(e.ctx, id+1000); !errors.Is(err, storage.ErrRecordNotFound) {
		t.Fatalf("Record of an unknown id returned %v, want an error wrapping storage.ErrRecordNotFound", err)
	}
}

func testListDead(t *testing.T, e *env) {
	op := operator(t, e)
	recs := []storage.Record{newRecord("a", 0), newRecord("b", 1), newRecord("a", 2), newRecord("", 3), newRecord("a", 4)}
	recs[1].Topic = "storagetest.other"
	all := e.insertRecords(recs...)
	got := e.claim("killer", 10, longLease)
	for i, id := range all[:4] {
		reason := "timeout"
		if i%2 == 1 {
			reason = "broker said no"
		}
		e.deadLetter("killer", id, reason)
	}
	e.ack("killer", ids(got)[4:]...)

	list := func(p storage.ListDeadParams) []int64 {
		t.Helper()
		out, err := op.ListDead(e.ctx, p)
		if err != nil {
			t.Fatalf("ListDead(%+v) returned error %v", p, err)
		}
		var got []int64
		for _, r := range out {
			if r.Status != storage.StatusDead || len(r.Record.Payload) != 0 {
				t.Fatalf("ListDead returned record %d with status %s and %d payload bytes, want dead records without payload", r.Record.ID, r.Status, len(r.Record.Payload))
			}
			if r.DeadAt.IsZero() || r.DeadAt.Before(r.Record.CreatedAt.Add(-time.Second)) {
				t.Fatalf("ListDead returned record %d dead at %v (created %v): want the time it was dead-lettered", r.Record.ID, r.DeadAt, r.Record.CreatedAt)
			}
			got = append(got, r.Record.ID)
		}
		return got
	}
	for _, c := range []struct {
		p    storage.ListDeadParams
		want []int64
	}{
		{storage.ListDeadParams{}, all[:4]},
		{storage.ListDeadParams{Topic: "storagetest.other"}, all[1:2]},
		{storage.ListDeadParams{Key: "a"}, []int64{all[0], all[2]}},
		{storage.ListDeadParams{ErrorContains: "said"}, []int64{all[1], all[3]}},
		{storage.ListDeadParams{Key: "a", ErrorContains: "time"}, []int64{all[0], all[2]}},
		{storage.ListDeadParams{Limit: 2}, all[:2]},
		{storage.ListDeadParams{AfterID: all[1], Limit: 1}, all[2:3]},
		{storage.ListDeadParams{OlderThan: time.Hour}, nil},
	} {
		if got := list(c.p); !slices.Equal(got, c.want) {
			t.Errorf("ListDead(%+v) returned %v, want %v", c.p, got, c.want)
		}
	}
}

func testSkip(t *testing.T, e *env) {
	op := operator(t, e)
	all := e.insert("a", "a")
	e.kill("poison message", all[0])
	if err := op.Skip(e.ctx, storage.SkipParams{ID: all[0]}); err == nil {
		t.Fatal("Skip without a Reason succeeded: the reason is the audit record, it is required")
	}
	if err := op.Skip(e.ctx, storage.SkipParams{ID: all[1], Reason: "x"}); !errors.Is(err, storage.ErrNotDead) {
		t.Fatalf("Skip of a pending record returned %v, want an error wrapping storage.ErrNotDead", err)
	}
	if err := op.Skip(e.ctx, storage.SkipParams{ID: all[1] + 1000, Reason: "x"}); !errors.Is(err, storage.ErrRecordNotFound) {
		t.Fatalf("Skip of an unknown id returned %v, want an error wrapping storage.ErrRecordNotFound", err)
	}
	for range 2 {
		if err := op.Skip(e.ctx, storage.SkipParams{ID: all[0], Reason: "ticket OPS-1"}); err != nil {
			t.Fatalf("Skip of a dead record returned %v (twice: the second changes nothing and succeeds)", err)
		}
	}
	got, err := op.Record(e.ctx, all[0])
	if err != nil || got.Status != storage.StatusSkipped || got.SkipReason != "ticket OPS-1" || got.SkippedAt.IsZero() ||
		got.LastError != "poison message" {
		t.Fatalf("Record of a skipped record returned %+v, %v: want status skipped with the reason, the time and the last error kept", got, err)
	}
	if n, err := op.Redrive(e.ctx, storage.RedriveParams{IDs: all[:1]}); err != nil || n != 0 {
		t.Fatalf("Redrive of a skipped record returned %d, %v, want 0, nil: only dead records are re-driven", n, err)
	}
	st, err := op.Stats(e.ctx)
	if err != nil || st.Dead != 0 || st.Skipped != 1 {
		t.Fatalf("Stats after a skip returned %+v, %v: want Dead 0, Skipped 1", st, err)
	}
}

func testHeldKeys(t *testing.T, e *env) {
	op := operator(t, e)
	first := e.insert("a", "b", "c", "", "d")
	a1, b1, c1, d1 := first[0], first[1], first[2], first[4]
	e.claim("worker-1", 10, longLease)
	e.insert("a", "b") // behind a1 and b1
	retryAt := time.Now().Add(time.Hour)
	e.nack("worker-1", b1, "broker said no", retryAt)
	e.nack("worker-1", c1, "broker said no", retryAt) // nothing behind c1
	e.ack("worker-1", first[3], d1)

	held, err := op.HeldKeys(e.ctx, storage.HeldKeysParams{})
	if err != nil {
		t.Fatalf("HeldKeys returned error %v", err)
	}
	if len(held) != 2 || held[0].Key != "a" || held[1].Key != "b" {
		t.Fatalf("HeldKeys returned %+v, want keys a (head leased) and b (head waiting for its retry): c has nothing behind its head, d is done", held)
	}
	a, b := held[0], held[1]
	if a.HeadID != a1 || a.Reason != storage.HoldLeased || a.LeasedBy != "worker-1" || a.Behind != 1 || a.Until.IsZero() {
		t.Errorf("HeldKeys reported key a as %+v, want head %d leased by worker-1 with an end, 1 behind", a, a1)
	}
	if b.HeadID != b1 || b.Reason != storage.HoldRetry || !near(b.Until, retryAt, time.Second) || b.LastError != "broker said no" || b.Behind != 1 {
		t.Errorf("HeldKeys reported key b as %+v, want head %d waiting for its retry at %v with its error, 1 behind", b, b1, retryAt)
	}
	if page, err := op.HeldKeys(e.ctx, storage.HeldKeysParams{AfterKey: "a", Limit: 1}); err != nil || len(page) != 1 || page[0].Key != "b" {
		t.Errorf("HeldKeys(AfterKey a, Limit 1) returned %+v, %v, want key b alone", page, err)
	}
	if st, err := op.Stats(e.ctx); err != nil || (st.HeldKeys != 2 && st.HeldKeys != 0) {
		t.Errorf("Stats returned HeldKeys %d, %v, want 2 (or 0 when not reported)", st.HeldKeys, err)
	}
}

func testHoldUntilRedriven(t *testing.T, e *env) {
	if h, ok := e.s.(storage.DeadLetterHolder); ok && !h.HoldOnDeadLetter() {
		t.Fatal("the storage from Harness.NewHoldOnDeadLetter reports HoldOnDeadLetter() false")
	}
	all := e.insert("a", "a", "b")
	a1, a2, b3 := all[0], all[1], all[2]
	e.claim("worker-1", 1, longLease)
	e.deadLetter("worker-1", a1, "poison message")
	if got := e.claim("worker-2", 10, longLease); !slices.Equal(ids(got), []int64{b3}) {
		t.Fatalf("Claim returned %v after record %d of key a was dead-lettered, want [%d]: with hold-on-dead-letter a dead record holds back the later records of its key; other keys go on",
			ids(got), a1, b3)
	}
	e.claimNothingFor(2*e.lease, "worker-2", []int64{a2}, "a dead record holds back its key until re-driven or skipped")
	if op := operatorOrNil(e); op != nil {
		held, err := op.HeldKeys(e.ctx, storage.HeldKeysParams{})
		if err != nil || len(held) != 1 || held[0].Key != "a" || held[0].Reason != storage.HoldDead || held[0].HeadID != a1 {
			t.Fatalf("HeldKeys returned %+v, %v, want key a held by dead record %d", held, err, a1)
		}
	}
	m := maintainer(t, e)
	if n, err := m.Redrive(e.ctx, storage.RedriveParams{IDs: []int64{a1}}); err != nil || n != 1 {
		t.Fatalf("Redrive returned %d, %v", n, err)
	}
	got := e.claim("worker-3", 10, longLease)
	if !slices.Equal(ids(got), []int64{a1, a2}) {
		t.Fatalf("Claim returned %v after record %d was re-driven, want [%d %d]: the re-driven record first, then the rest of its key", ids(got), a1, a1, a2)
	}
}

func testHoldUntilSkipped(t *testing.T, e *env) {
	op := operator(t, e)
	all := e.insert("a", "a")
	e.claim("worker-1", 1, longLease)
	e.deadLetter("worker-1", all[0], "poison message")
	if got := e.claim("worker-2", 10, longLease); len(got) != 0 {
		t.Fatalf("Claim returned %v while record %d of key a was dead, want none", ids(got), all[0])
	}
	if err := op.Skip(e.ctx, storage.SkipParams{ID: all[0], Reason: "poison, see OPS-2"}); err != nil {
		t.Fatalf("Skip returned %v", err)
	}
	if got := e.claim("worker-2", 10, longLease); !slices.Equal(ids(got), all[1:]) {
		t.Fatalf("Claim returned %v after the dead head was skipped, want %v: a skipped record no longer holds back its key", ids(got), all[1:])
	}
}

func testFailedClaimedAlone(t *testing.T, e *env) {
	all := e.insert("a", "a", "b")
	e.claim("worker-1", 1, longLease)
	e.nack("worker-1", all[0], "broker said no", time.Now())
	got, _ := e.claimUntil("worker-2", 10, longLease, all[0], "a nacked record is claimable once due")
	if hasID(got, all[1]) {
		t.Fatalf("Claim returned %v: record %d of key a came with record %d, which failed before: with hold-on-dead-letter a failed record is claimed without the rest of its key, which must not be published if this attempt dead-letters it",
			ids(got), all[1], all[0])
	}
	e.ack("worker-2", all[0])
	e.claimUntil("worker-3", 10, longLease, all[1], "once the failed record is delivered, the rest of its key follows")
}

func operatorOrNil(e *env) storage.Operator {
	if e.h.Operator != nil {
		return e.h.Operator(e.t, e.s)
	}
	op, _ := e.s.(storage.Operator)
	return op
}
