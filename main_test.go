package txoutbox_test

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/txoutbox/txoutbox/storage"
)

// TestMain fails the run if a goroutine outlives the tests: Run must return
// with nothing left behind. The shared test pool (backends_test.go) lives
// for the whole run and is closed first: its connections end, and with them
// what pgx keeps running for them (health checks, and the background reader
// it starts on a connection whose write took over 15 ms, which stays parked
// in a read until that connection's next use: on a loaded machine goleak
// found one left after a run whose tests all passed).
func TestMain(m *testing.M) {
	code := m.Run()
	if pool != nil {
		pool.Close()
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goroutines left running after the tests:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// refIDs returns the ids refs name, in the same order: what a fake storage's
// Extend returns when every lease it is asked about is live.
func refIDs(refs []storage.ClaimRef) []int64 {
	ids := make([]int64, len(refs))
	for i, r := range refs {
		ids[i] = r.ID
	}
	return ids
}
