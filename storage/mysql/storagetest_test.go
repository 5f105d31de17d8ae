package mysql

import (
	"testing"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/storagetest"
)

func harness(config Config) storagetest.Harness {
	return storagetest.Harness{
		New: func(t *testing.T) storage.Storage {
			return newStore(t, config)
		},
		DelayedDelivery: true,
		Insert: func(t *testing.T, s storage.Storage, records ...storage.Record) []int64 {
			return insert(t, s.(*Storage), records...)
		},
		Inspect: func(t *testing.T, s storage.Storage, id int64) storagetest.State {
			return storagetest.State(inspect(t, s.(*Storage), id))
		},
		StrictOrdering: !config.DisableStrictOrdering,
		NewHoldOnDeadLetter: func(t *testing.T) storage.Storage {
			config := config
			config.HoldOnDeadLetter = true
			return newStore(t, config)
		},
		Parallel: true,
	}
}

func TestContractStrict(t *testing.T) {
	t.Parallel()
	storagetest.Run(t, harness(Config{}))
}

func TestContractNotStrict(t *testing.T) {
	t.Parallel()
	storagetest.Run(t, harness(Config{DisableStrictOrdering: true}))
}
