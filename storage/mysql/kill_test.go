package mysql

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// TestKilledConnectionLosesNothing kills (KILL <id>, from another
// connection) the connections running this table's claims and acks while
// two workers drain it. A killed claim rolls back: its rows were never
// leased. A killed ack rolls back: its rows are redelivered after their
// lease. At the end every record is delivered, and per key the first
// publishes follow id order.
func TestKilledConnectionLosesNothing(t *testing.T) {
	t.Parallel()
	// A pool of its own: a connection picked for killing may meanwhile
	// have gone back to its pool and to another test.
	openDB(t)
	db, err := sql.Open("mysql", testDSN())
	must(t, err)
	t.Cleanup(func() { db.Close() })
	s, err := New(db, Config{Table: newTable(t, db)})
	must(t, err)
	must(t, s.CreateSchema(t.Context()))
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	const records = 2000
	keys := make([]string, records)
	for i := range keys {
		if i%5 != 0 {
			keys[i] = fmt.Sprint("k", i%13)
		}
	}
	for start := 0; start < records; start += 500 {
		insert(t, s, recs(keys[start:start+500]...)...)
	}

	// The killer: a connection of its own that looks for statements on the
	// table and kills their connections.
	var killed atomic.Int64
	killerDone := make(chan struct{})
	kctx, stopKiller := context.WithCancel(ctx)
	go func() {
		defer close(killerDone)
		conn, err := s.db.Conn(kctx)
		if err != nil {
			return
		}
		defer conn.Close()
		name := s.table[1 : len(s.table)-1]
		for kctx.Err() == nil {
			var id int64
			err := conn.QueryRowContext(kctx, "SELECT ID FROM information_schema.PROCESSLIST WHERE ID <> CONNECTION_ID() AND INFO LIKE ? AND (INFO LIKE '%SKIP LOCKED%' OR INFO LIKE '%FOR UPDATE%') LIMIT 1", "%"+name+"%").Scan(&id)
			if err == nil {
				if _, err := conn.ExecContext(kctx, fmt.Sprintf("KILL %d", id)); err == nil {
					killed.Add(1)
				}
			}
			time.Sleep(time.Duration(1+killed.Load()%5) * time.Millisecond)
		}
	}()

	var mu sync.Mutex
	first := map[int64]int{}
	keyOf := map[int64]string{}
	seq := 0
	var failures atomic.Int64
	var wg sync.WaitGroup
	for w := range 2 {
		worker := fmt.Sprint("w", w)
		wg.Go(func() {
			for ctx.Err() == nil {
				got, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 50, Lease: 300 * time.Millisecond, WorkerID: worker})
				if err != nil {
					failures.Add(1) // a killed claim: try again
					continue
				}
				if len(got) == 0 {
					st, err := s.Stats(ctx)
					if err == nil && st.Pending == 0 {
						return
					}
					time.Sleep(5 * time.Millisecond)
					continue
				}
				mu.Lock()
				for _, r := range got {
					if _, ok := first[r.ID]; !ok {
						seq++
						first[r.ID] = seq
						keyOf[r.ID] = r.Key
					}
				}
				mu.Unlock()
				if err := s.Ack(ctx, storage.AckParams{Records: storage.Refs(got), WorkerID: worker}); err != nil {
					failures.Add(1) // a killed ack: the lease runs out, the rows come back
				}
			}
		})
	}
	wg.Wait()
	stopKiller()
	<-killerDone
	if ctx.Err() != nil {
		dumpPending(t, s)
		t.Fatalf("not drained within the deadline: %+v", mustStats(t, s))
	}
	st := mustStats(t, s)
	if st.Pending != 0 || st.Delivered != records {
		t.Fatalf("Stats = %+v, want all %d delivered", st, records)
	}
	if len(first) != records {
		t.Fatalf("%d records published, want %d", len(first), records)
	}
	byKey := map[string][]int64{}
	for id, k := range keyOf {
		if k != "" {
			byKey[k] = append(byKey[k], id)
		}
	}
	for k, ids := range byKey {
		slices.Sort(ids)
		for i := 1; i < len(ids); i++ {
			if first[ids[i]] < first[ids[i-1]] {
				t.Fatalf("key %s: record %d first published before record %d", k, ids[i], ids[i-1])
			}
		}
	}
	if killed.Load() == 0 {
		t.Fatal("no connection was killed: the test proved nothing")
	}
	t.Logf("killed %d connections, %d claims or acks failed, all %d records delivered", killed.Load(), failures.Load(), records)
}
