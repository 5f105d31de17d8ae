package storagetest_test

import (
	"testing"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/memory"
	"github.com/txoutbox/txoutbox/storage/storagetest"
)

// contract runs the suite against the memory storage. In your own package it
// is a test function, func TestContract(t *testing.T), and New and Insert
// make a fresh table and commit records through your storage.
func contract(t *testing.T) {
	storagetest.Run(t, storagetest.Harness{
		New: func(t *testing.T) storage.Storage {
			return memory.New(memory.Config{})
		},
		Insert: func(t *testing.T, s storage.Storage, records ...storage.Record) []int64 {
			return s.(*memory.Storage).Add(records...)
		},
		Inspect: func(t *testing.T, s storage.Storage, id int64) storagetest.State {
			st, ok := s.(*memory.Storage).Get(id)
			if !ok {
				t.Fatalf("record %d not found", id)
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
		StrictOrdering: true,
		Parallel:       true,
	})
}

// Run the contract suite from your storage package's tests.
func ExampleRun() {
	// go test runs it as: func TestContract(t *testing.T) { contract(t) }
	_ = contract
}
