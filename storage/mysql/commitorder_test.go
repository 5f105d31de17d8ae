package mysql

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// producer is a transaction inserting records on a connection of its own.
type producer struct {
	tx     *sql.Tx
	connID int64
}

func begin(t *testing.T, s *Storage) producer {
	t.Helper()
	tx, err := s.db.BeginTx(t.Context(), nil)
	must(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	var p producer
	p.tx = tx
	must(t, tx.QueryRowContext(t.Context(), "SELECT CONNECTION_ID()").Scan(&p.connID))
	return p
}

// insertTx inserts records in tx and returns the first id.
func insertTx(ctx context.Context, s *Storage, tx *sql.Tx, records ...storage.Record) (int64, error) {
	if err := s.Insert(ctx, tx, records); err != nil {
		return 0, err
	}
	var id int64
	err := tx.QueryRowContext(ctx, "SELECT LAST_INSERT_ID()").Scan(&id)
	return id, err
}

// lockWaitTimeout makes the session's lock waits time out after one
// second (on), or resets it (off), before the pool gets the connection back.
func lockWaitTimeout(t *testing.T, p producer, on bool) {
	t.Helper()
	q := "SET SESSION innodb_lock_wait_timeout = DEFAULT"
	if on {
		q = "SET SESSION innodb_lock_wait_timeout = 1"
	}
	_, err := p.tx.ExecContext(t.Context(), q)
	must(t, err)
}

// TestKeyLocksKeepCommitOrder: two real transactions on one key, the one
// with the smaller id open while the other inserts. With the key locks (the
// default) the second producer's Insert waits for the first (here until its
// one-second lock wait timeout), so it can neither take a larger id nor
// commit first; producers of another key do not wait. Without them, the
// second commits first and its record is claimed before the first's.
func TestKeyLocksKeepCommitOrder(t *testing.T) {
	t.Parallel()
	t.Run("default", func(t *testing.T) {
		t.Parallel()
		s := newStore(t, Config{})
		ctx := t.Context()
		first := begin(t, s)
		id1, err := insertTx(ctx, s, first.tx, rec("k"))
		must(t, err)

		// Another key does not wait.
		other := begin(t, s)
		lockWaitTimeout(t, other, true)
		_, err = insertTx(ctx, s, other.tx, rec("other"))
		must(t, err)
		lockWaitTimeout(t, other, false)
		must(t, other.tx.Commit())

		// The same key waits for the first producer.
		second := begin(t, s)
		lockWaitTimeout(t, second, true)
		_, err = insertTx(ctx, s, second.tx, rec("k"))
		lockWaitTimeout(t, second, false)
		if mysqlErrNumber(err) != errLockWaitTimeout {
			t.Fatalf("Insert of key k while another producer of it is open = %v, want a lock wait timeout", err)
		}
		must(t, second.tx.Rollback())
		got := claim(t, s, "w", 10, time.Minute)
		if len(got) != 1 || got[0].Key != "other" {
			t.Fatalf("claim while the first producer is open = %+v, want only the other key's record", got)
		}
		must(t, first.tx.Commit())
		third := begin(t, s)
		id3, err := insertTx(ctx, s, third.tx, rec("k"))
		must(t, err)
		must(t, third.tx.Commit())
		if got := claim(t, s, "w", 10, time.Minute); !slices.Equal(idsOf(got), []int64{id1, id3}) {
			t.Fatalf("claim = %v, want [%d %d]", idsOf(got), id1, id3)
		}
	})
	t.Run("without key locks", func(t *testing.T) {
		t.Parallel()
		s := newStore(t, Config{DisableKeyLocks: true})
		ctx := t.Context()
		first := begin(t, s)
		id1, err := insertTx(ctx, s, first.tx, rec("k"))
		must(t, err)
		second := begin(t, s)
		id2, err := insertTx(ctx, s, second.tx, rec("k"))
		must(t, err)
		must(t, second.tx.Commit())
		if got := claim(t, s, "w", 10, time.Minute); !slices.Equal(idsOf(got), []int64{id2}) {
			t.Fatalf("claim = %v, want [%d]: without key locks the later id is claimed before %d commits", idsOf(got), id2, id1)
		}
		must(t, first.tx.Commit())
	})
}

// TestKeyLocksManyProducers: many producers on few keys, each committing a
// transaction of one or two records while a forwarder claims and acks: every
// key's records are claimed in id order, none twice. (With DisableKeyLocks
// the same run claimed records of every key out of id order.)
func TestKeyLocksManyProducers(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	ctx := t.Context()
	const producers, txs, keys = 12, 15, 3
	var wg sync.WaitGroup
	errs := make(chan error, producers)
	var total int64
	var mu sync.Mutex
	for p := range producers {
		wg.Go(func() {
			for i := range txs {
				key := fmt.Sprint("k", (p+i)%keys)
				n := 1 + i%2
				err := func() error {
					tx, err := s.db.BeginTx(ctx, nil)
					if err != nil {
						return err
					}
					defer tx.Rollback() //nolint:errcheck // no-op after commit
					records := make([]storage.Record, n)
					for j := range records {
						records[j] = rec(key)
					}
					if err := s.Insert(ctx, tx, records); err != nil {
						return err
					}
					// Some work in the producer's transaction after its insert,
					// 0 to 9 ms, so that transactions commit out of id order.
					if _, err := tx.ExecContext(ctx, fmt.Sprintf("DO SLEEP(0.00%d)", (p*7+i*3)%10)); err != nil {
						return err
					}
					return tx.Commit()
				}()
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				total += int64(n)
				mu.Unlock()
			}
		})
	}
	produced := make(chan struct{})
	go func() { wg.Wait(); close(produced) }()
	seen := map[string][]int64{}
	count := int64(0)
	deadline := time.Now().Add(2 * time.Minute)
	for finished := false; ; {
		select {
		case <-produced:
			finished = true
		default:
		}
		got := claim(t, s, "w", 50, time.Minute)
		for _, r := range got {
			seen[r.Key] = append(seen[r.Key], r.ID)
		}
		count += int64(len(got))
		if len(got) > 0 {
			refs := make([]storage.ClaimRef, len(got))
			for i, r := range got {
				refs[i] = r.Ref()
			}
			must(t, s.Ack(ctx, storage.AckParams{Records: refs, WorkerID: "w"}))
		}
		mu.Lock()
		all := total
		mu.Unlock()
		if finished && count == all {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("claimed %d of %d records in 2 minutes", count, all)
		}
	}
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for k, ids := range seen {
		if !slices.IsSorted(ids) || len(slices.Compact(slices.Clone(ids))) != len(ids) {
			t.Errorf("key %s claimed in the order %v, want id order, each once", k, ids)
		}
	}
}

// TestPurgeKeys: Purge deletes the key lock rows no producer holds, and
// leaves the one an open producer holds; producers go on either way.
func TestPurgeKeys(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	ctx := t.Context()
	insert(t, s, recs("a", "b", "c😀")...)
	open := begin(t, s)
	_, err := insertTx(ctx, s, open.tx, rec("a"))
	must(t, err)
	if _, err := s.Purge(ctx, 0); err != nil {
		t.Fatal(err)
	}
	var left []string
	rows, err := s.db.QueryContext(ctx, "SELECT CAST(`key` AS BINARY) FROM "+s.KeyTable()+" ORDER BY `key`")
	must(t, err)
	defer rows.Close()
	for rows.Next() {
		var k string
		must(t, rows.Scan(&k))
		left = append(left, k)
	}
	must(t, rows.Err())
	if !slices.Equal(left, []string{"a"}) {
		t.Fatalf("key rows after Purge = %q, want only the held %q", left, "a")
	}
	must(t, open.tx.Commit())
	insert(t, s, recs("a", "b")...)
	if st := mustStats(t, s); st.Pending != 6 {
		t.Fatalf("Stats = %+v, want 6 pending", st)
	}
}
