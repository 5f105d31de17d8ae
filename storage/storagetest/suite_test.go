package storagetest_test

import (
	"context"
	"os"
	"os/exec"
	"slices"
	"strings"
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

// mutantEnv names the broken storage TestMutant runs the suite against.
const mutantEnv = "STORAGETEST_MUTANT"

// mutant is the memory storage with one rule of the contract broken.
type mutant struct {
	*memory.Storage
	name string
}

// mutants maps each broken rule to a message the suite must fail with.
var mutants = map[string]string{
	"claim-out-of-order":      "claims must be in id order",
	"claim-over-batch-size":   "a claim must not exceed its batch size",
	"lease-ignored":           "a leased record is not claimable until its lease expires",
	"no-fencing":              "(fencing)",
	"no-claim-fencing":        "(fencing on the claim)",
	"extend-ignores-fencing":  "Extend only extends live leases held by the calling worker",
	"nack-ignores-retry-at":   "a record is not claimable before it is due",
	"release-keeps-attempt":   "Release gives the attempt back",
	"dead-letter-retries":     "a dead-lettered record is never claimed again",
	"ack-ignored":             "an acked record is delivered and never claimed again",
	"no-strict-ordering":      "strict ordering holds a record back",
	"strict-ordering-keyless": "records with an empty key are independent",
}

func (m *mutant) Claim(ctx context.Context, p storage.ClaimParams) ([]storage.Record, error) {
	switch m.name {
	case "claim-over-batch-size":
		p.BatchSize++
	case "lease-ignored":
		p.Lease = time.Nanosecond
	}
	got, err := m.Storage.Claim(ctx, p)
	if m.name == "claim-out-of-order" {
		slices.Reverse(got)
	}
	return got, err
}

// holder returns ref and worker as the mutant sends them on: with fencing
// broken, as whoever holds the lease by its current claim; with fencing on
// the claim broken, as worker's current claim.
func (m *mutant) holder(ref storage.ClaimRef, worker string) (storage.ClaimRef, string) {
	st, _ := m.Get(ref.ID)
	switch m.name {
	case "no-fencing":
		return storage.ClaimRef{ID: ref.ID, Attempt: st.Record.Attempts}, st.LeasedBy
	case "no-claim-fencing":
		return storage.ClaimRef{ID: ref.ID, Attempt: st.Record.Attempts}, worker
	}
	return ref, worker
}

func (m *mutant) Ack(ctx context.Context, p storage.AckParams) error {
	if m.name == "ack-ignored" {
		return nil
	}
	for _, ref := range p.Records {
		ref, worker := m.holder(ref, p.WorkerID)
		if err := m.Storage.Ack(ctx, storage.AckParams{Records: []storage.ClaimRef{ref}, WorkerID: worker}); err != nil {
			return err
		}
	}
	return nil
}

func (m *mutant) Nack(ctx context.Context, p storage.NackParams) error {
	if m.name == "nack-ignores-retry-at" {
		p.RetryAt = time.Now()
	}
	p.Record, p.WorkerID = m.holder(p.Record, p.WorkerID)
	return m.Storage.Nack(ctx, p)
}

func (m *mutant) Release(ctx context.Context, p storage.ReleaseParams) error {
	for _, ref := range p.Records {
		ref, worker := m.holder(ref, p.WorkerID)
		var err error
		if m.name == "release-keeps-attempt" {
			err = m.Storage.Nack(ctx, storage.NackParams{Record: ref, WorkerID: worker, RetryAt: p.RetryAt})
		} else {
			err = m.Storage.Release(ctx, storage.ReleaseParams{Records: []storage.ClaimRef{ref}, WorkerID: worker, RetryAt: p.RetryAt})
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func (m *mutant) DeadLetter(ctx context.Context, p storage.DeadLetterParams) error {
	p.Record, p.WorkerID = m.holder(p.Record, p.WorkerID)
	if m.name == "dead-letter-retries" {
		return m.Storage.Nack(ctx, storage.NackParams{Record: p.Record, WorkerID: p.WorkerID, Error: p.Error, RetryAt: time.Now()})
	}
	return m.Storage.DeadLetter(ctx, p)
}

// Extend, with "extend-ignores-fencing", extends every leased record for
// whoever holds it, as if the caller did; with "no-claim-fencing", the
// caller's current claims.
func (m *mutant) Extend(ctx context.Context, p storage.ExtendParams) ([]int64, error) {
	if m.name != "extend-ignores-fencing" && m.name != "no-claim-fencing" {
		return m.Storage.Extend(ctx, p)
	}
	var extended []int64
	for _, ref := range p.Records {
		st, _ := m.Get(ref.ID)
		if st.LeasedBy == "" {
			continue
		}
		worker := st.LeasedBy
		if m.name == "no-claim-fencing" {
			worker = p.WorkerID
		}
		ref.Attempt = st.Record.Attempts
		got, err := m.Storage.Extend(ctx, storage.ExtendParams{Records: []storage.ClaimRef{ref}, WorkerID: worker, Lease: p.Lease})
		if err != nil {
			return nil, err
		}
		extended = append(extended, got...)
	}
	return extended, nil
}

// keylessAsKey stores keyless records under one key, so strict ordering holds
// them back.
const keylessAsKey = "storagetest-mutant-keyless"

// TestMutant runs the suite against the mutant named in $STORAGETEST_MUTANT;
// TestSuiteCatchesMutants starts it in a child process and expects it to fail.
func TestMutant(t *testing.T) {
	name := os.Getenv(mutantEnv)
	if name == "" {
		t.Skip("skipped: run by TestSuiteCatchesMutants")
	}
	config := memory.Config{DisableStrictOrdering: name == "no-strict-ordering"}
	storagetest.Run(t, storagetest.Harness{
		New: func(t *testing.T) storage.Storage { return &mutant{Storage: memory.New(config), name: name} },
		Insert: func(t *testing.T, s storage.Storage, records ...storage.Record) []int64 {
			if name == "strict-ordering-keyless" {
				for i := range records {
					if records[i].Key == "" {
						records[i].Key = keylessAsKey
					}
				}
			}
			return s.(*mutant).Add(records...)
		},
		StrictOrdering: true,
		Parallel:       true,
	})
}

// TestSuiteCatchesMutants checks that the suite fails, with the message that
// names the broken rule, against storages that each break one rule.
func TestSuiteCatchesMutants(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: runs the suite once per mutant")
	}
	for name, want := range mutants {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestMutant$", "-test.v")
			cmd.Env = append(os.Environ(), mutantEnv+"="+name)
			out, err := cmd.CombinedOutput()
			if err == nil {
				t.Fatalf("the suite passed against a storage with %s:\n%s", name, out)
			}
			if !strings.Contains(string(out), want) {
				t.Fatalf("the suite failed against a storage with %s, but no failure says %q:\n%s", name, want, out)
			}
			var failed []string
			for line := range strings.Lines(string(out)) {
				if f, ok := strings.CutPrefix(strings.TrimSpace(line), "--- FAIL: TestMutant/"); ok {
					if leaf := strings.Fields(f)[0]; strings.Contains(leaf, "/") {
						failed = append(failed, leaf)
					}
				}
			}
			t.Logf("%s: %d cases failed: %s", name, len(failed), strings.Join(failed, ", "))
		})
	}
}
