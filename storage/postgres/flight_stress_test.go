package postgres

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/txoutbox/txoutbox/storage"
)

// TestParkingInFlightUnderStress: three workers claim with parking behind
// records in flight at every claim (one row is enough), and settle what
// they hold in random parts and orders: acks, nacks due soon, dead-letters,
// releases, extensions, while a producer writes into four hot keys and
// keyless rows. No record goes out while an earlier one of its key is
// unsettled (other than earlier in the same batch), no statement deadlocks,
// and, with the sweep off, everything drains: no row is left parked with
// nothing to set it free. (A review's stress test; it found the two
// stranded rows that TestNoParkingBetweenRecordsInFlight and
// TestNoParkingOfRowsWhoseLeaseRanOut keep out.)
func TestParkingInFlightUnderStress(t *testing.T) {
	t.Parallel()
	for _, cfg := range []Config{{}, {DeleteOnAck: true}} {
		t.Run(fmt.Sprintf("deleteOnAck=%v", cfg.DeleteOnAck), func(t *testing.T) {
			t.Parallel()
			stressParkingInFlight(t, cfg)
		})
	}
}

func stressParkingInFlight(t *testing.T, cfg Config) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	s := newStore(t, cfg)
	s.parkFlightMin = 1
	s.nextSweep.Store(time.Now().Add(time.Hour).UnixNano())
	keys := []string{"a", "b", "c", "d", ""}

	var mu sync.Mutex
	keyOf := map[int64]string{} // every record produced
	settled := map[int64]bool{} // acked or dead-lettered
	var problems []string
	fail := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(problems) < 20 {
			problems = append(problems, fmt.Sprintf(format, args...))
		}
	}
	check := func(op string, err error) {
		var pe *pgconn.PgError
		switch {
		case err == nil || ctx.Err() != nil:
		case errors.As(err, &pe) && pe.Code == "40P01":
			fail("deadlock in %s: %v", op, err)
		default:
			fail("%s: %v", op, err)
		}
	}

	produced := make(chan struct{})
	go func() {
		defer close(produced)
		for range 120 {
			rs := make([]storage.Record, 1+rand.IntN(6))
			for j := range rs {
				rs[j] = rec(keys[rand.IntN(len(keys))])
			}
			ids := insert(t, s, rs...)
			mu.Lock()
			for j, id := range ids {
				keyOf[id] = rs[j].Key
			}
			mu.Unlock()
			time.Sleep(time.Duration(rand.IntN(15)) * time.Millisecond)
		}
	}()

	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 3 {
		wg.Go(func() {
			worker := fmt.Sprintf("w%d", w)
			var held []storage.ClaimRef
			for {
				select {
				case <-stop:
					return
				default:
				}
				s.walkedFar.Store(true)
				got, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 1 + rand.IntN(6), Lease: time.Minute, WorkerID: worker})
				check("claim", err)
				mu.Lock()
				inBatch := map[int64]bool{}
				for _, r := range got {
					for id, k := range keyOf {
						if k != "" && k == r.Key && id < r.ID && !settled[id] && !inBatch[id] {
							problems = append(problems, fmt.Sprintf("%s claimed %d of key %q while %d is not settled", worker, r.ID, r.Key, id))
						}
					}
					inBatch[r.ID] = true
					held = append(held, r.Ref())
				}
				mu.Unlock()
				rand.Shuffle(len(held), func(i, j int) { held[i], held[j] = held[j], held[i] })
				if len(held) > 0 && rand.IntN(3) == 0 {
					_, err := s.Extend(ctx, storage.ExtendParams{Records: held, WorkerID: worker, Lease: time.Minute})
					check("extend", err)
				}
				// Settle a random part of what is held, in random steps.
				n := rand.IntN(len(held) + 1)
				part := held[:n]
				held = append([]storage.ClaimRef(nil), held[n:]...)
				for len(part) > 0 {
					switch x := rand.IntN(10); {
					case x < 6:
						m := 1 + rand.IntN(len(part))
						refs := append([]storage.ClaimRef(nil), part[:m]...)
						part = part[m:]
						mu.Lock()
						for _, r := range refs {
							settled[r.ID] = true
						}
						mu.Unlock()
						check("ack", s.Ack(ctx, storage.AckParams{Records: refs, WorkerID: worker}))
					case x < 8:
						retry := time.Now().Add(time.Duration(rand.IntN(80)) * time.Millisecond)
						check("nack", s.Nack(ctx, storage.NackParams{Record: part[0], WorkerID: worker, Error: "x", RetryAt: retry}))
						part = part[1:]
					case x < 9:
						mu.Lock()
						settled[part[0].ID] = true
						mu.Unlock()
						check("dead-letter", s.DeadLetter(ctx, storage.DeadLetterParams{Record: part[0], WorkerID: worker, Error: "x"}))
						part = part[1:]
					default:
						check("release", s.Release(ctx, storage.ReleaseParams{Records: part, WorkerID: worker, RetryAt: time.Now()}))
						part = nil
					}
				}
				time.Sleep(time.Duration(rand.IntN(5)) * time.Millisecond)
			}
		})
	}
	<-produced
	// Everything drains: the workers settle what they hold sooner or later.
	pending := func() int {
		var n int
		must(t, s.pool.QueryRow(ctx, "SELECT count(*) FROM "+s.table+" WHERE status = 'pending'").Scan(&n))
		return n
	}
	last, since := -1, time.Now()
	for n := pending(); n > 0; n = pending() {
		if n != last {
			last, since = n, time.Now()
		}
		if time.Since(since) > 20*time.Second {
			fail("%d rows pending, none settled for 20 s (the sweep is off): parked with nothing to set them free?", n)
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	for _, p := range problems {
		t.Error(p)
	}
}
