package postgres

import (
	"testing"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/storagetest"
)

func harness(strict bool) storagetest.Harness {
	return storagetest.Harness{
		New: func(t *testing.T) storage.Storage {
			return newStore(t, Config{DisableStrictOrdering: !strict})
		},
		Insert: func(t *testing.T, s storage.Storage, records ...storage.Record) []int64 {
			return insert(t, s.(*Storage), records...)
		},
		Inspect: func(t *testing.T, s storage.Storage, id int64) storagetest.State {
			return storagetest.State(inspect(t, s.(*Storage), id))
		},
		StrictOrdering: strict,
		Parallel:       true,
	}
}

func TestContractStrict(t *testing.T) {
	t.Parallel()
	storagetest.Run(t, harness(true))
}

func TestContractNotStrict(t *testing.T) {
	t.Parallel()
	storagetest.Run(t, harness(false))
}
