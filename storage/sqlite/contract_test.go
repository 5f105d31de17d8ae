package sqlite

import (
	"fmt"
	"testing"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/storagetest"
)

// TestContract runs the storage contract suite, each case on its own
// database file, with strict ordering on (the default) and off.
func TestContract(t *testing.T) {
	for _, strict := range []bool{true, false} {
		t.Run(fmt.Sprintf("strict=%v", strict), func(t *testing.T) {
			storagetest.Run(t, storagetest.Harness{
				New: func(t *testing.T) storage.Storage {
					return newTestStorage(t, Config{DisableStrictOrdering: !strict})
				},
				DelayedDelivery: true,
				Insert: func(t *testing.T, s storage.Storage, records ...storage.Record) []int64 {
					return insert(t, s.(*Storage), records...)
				},
				Inspect: func(t *testing.T, s storage.Storage, id int64) storagetest.State {
					return storagetest.State(inspect(t, s.(*Storage), id))
				},
				StrictOrdering: strict,
				NewHoldOnDeadLetter: func(t *testing.T) storage.Storage {
					return newTestStorage(t, Config{HoldOnDeadLetter: true})
				},
				Parallel: true,
			})
		})
	}
}
