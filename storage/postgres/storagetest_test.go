package postgres

import (
	"fmt"
	"testing"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/storagetest"
)

func harness(config Config) storagetest.Harness {
	return storagetest.Harness{
		New: func(t *testing.T) storage.Storage {
			return newStore(t, config)
		},
		Insert: func(t *testing.T, s storage.Storage, records ...storage.Record) []int64 {
			return insert(t, s.(*Storage), records...)
		},
		Inspect: func(t *testing.T, s storage.Storage, id int64) storagetest.State {
			ps := s.(*Storage)
			if config.DeleteOnAck {
				// An acked row is gone: report it as delivered.
				var n int
				if err := ps.pool.QueryRow(t.Context(), fmt.Sprintf("SELECT count(*) FROM %s WHERE id = $1", ps.table), id).Scan(&n); err != nil {
					t.Fatalf("inspect record %d: %v", id, err)
				}
				if n == 0 {
					return storagetest.State{Status: storage.StatusDelivered}
				}
			}
			return storagetest.State(inspect(t, ps, id))
		},
		StrictOrdering: !config.DisableStrictOrdering,
		Parallel:       true,
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

func TestContractDeleteOnAck(t *testing.T) {
	t.Parallel()
	storagetest.Run(t, harness(Config{DeleteOnAck: true}))
}
