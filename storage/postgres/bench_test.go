package postgres

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// fill adds n pending rows over keys distinct keys with 256-byte payloads in
// one statement.
func fill(tb testing.TB, s *Storage, n, keys int) {
	tb.Helper()
	_, err := s.pool.Exec(tb.Context(), fmt.Sprintf(`INSERT INTO %s (uuid, topic, key, payload, metadata)
SELECT md5(g::text), 'bench', 'k' || (g %% $2), convert_to(repeat('x', 256), 'UTF8'), '{"a":"b"}'
FROM generate_series(1, $1) g`, s.table), n, keys)
	must(tb, err)
	_, err = s.pool.Exec(tb.Context(), "ANALYZE "+s.table)
	must(tb, err)
}

// BenchmarkClaimAck measures one worker claiming and acking batches with a
// no-op publish; msgs/s is the figure to read, claim-ms and ack-ms split one
// round between its two statements, allocs/msg counts the client side.
func BenchmarkClaimAck(b *testing.B) {
	for _, mode := range []struct {
		name string
		cfg  Config
	}{
		{"strict", Config{}}, {"strict+delete", Config{DeleteOnAck: true}}, {"nostrict", Config{DisableStrictOrdering: true}},
	} {
		for _, batch := range []int{100, 1000} {
			b.Run(fmt.Sprintf("%s/batch=%d", mode.name, batch), func(b *testing.B) {
				s := newStore(b, mode.cfg)
				const backlog = 50_000
				fill(b, s, backlog, 1000)
				left := backlog
				ctx := b.Context()
				msgs := 0
				var claimT, ackT time.Duration
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					if left < batch {
						b.StopTimer()
						fill(b, s, backlog, 1000)
						left += backlog
						b.StartTimer()
					}
					t0 := time.Now()
					got, err := s.Claim(ctx, storage.ClaimParams{BatchSize: batch, Lease: time.Minute, WorkerID: "bench"})
					if err != nil {
						b.Fatal(err)
					}
					if len(got) != batch {
						b.Fatalf("claimed %d, want %d", len(got), batch)
					}
					t1 := time.Now()
					if err := s.Ack(ctx, storage.AckParams{Records: storage.Refs(got), WorkerID: "bench"}); err != nil {
						b.Fatal(err)
					}
					claimT += t1.Sub(t0)
					ackT += time.Since(t1)
					left -= len(got)
					msgs += len(got)
				}
				rounds := float64(msgs / batch)
				b.ReportMetric(float64(msgs)/b.Elapsed().Seconds(), "msgs/s")
				b.ReportMetric(claimT.Seconds()*1000/rounds, "claim-ms")
				b.ReportMetric(ackT.Seconds()*1000/rounds, "ack-ms")
			})
		}
	}
}

// BenchmarkClaimLargeBacklog claims and acks from the head of a backlog of
// 1M pending rows: the claim must cost the same as over 50k.
func BenchmarkClaimLargeBacklog(b *testing.B) {
	s := newStore(b, Config{})
	fill(b, s, 1_000_000, 1000)
	ctx := b.Context()
	const batch = 1000
	msgs := 0
	for b.Loop() {
		got, err := s.Claim(ctx, storage.ClaimParams{BatchSize: batch, Lease: time.Minute, WorkerID: "bench"})
		if err != nil {
			b.Fatal(err)
		}
		if err := s.Ack(ctx, storage.AckParams{Records: storage.Refs(got), WorkerID: "bench"}); err != nil {
			b.Fatal(err)
		}
		msgs += len(got)
	}
	b.ReportMetric(float64(msgs)/b.Elapsed().Seconds(), "msgs/s")
}

// BenchmarkDrainWorkers drains a 20k backlog with one and four workers under
// strict ordering, over many keys and over a few hot ones: the case where a
// naive ordering check collapses.
func BenchmarkDrainWorkers(b *testing.B) {
	for _, workers := range []int{1, 4} {
		for _, keys := range []int{1000, 10} {
			for _, batch := range []int{100, 1000} {
				b.Run(fmt.Sprintf("workers=%d/keys=%d/batch=%d", workers, keys, batch), func(b *testing.B) {
					const backlog = 20_000
					total := 0
					var elapsed time.Duration
					for b.Loop() {
						b.StopTimer()
						s := newStore(b, Config{})
						fill(b, s, backlog, keys)
						b.StartTimer()
						start := time.Now()
						var wg sync.WaitGroup
						var delivered atomic.Int64
						for w := range workers {
							wg.Go(func() {
								worker := fmt.Sprintf("w%d", w)
								for delivered.Load() < backlog {
									got, err := s.Claim(b.Context(), storage.ClaimParams{BatchSize: batch, Lease: time.Minute, WorkerID: worker})
									if err != nil {
										b.Error(err)
										return
									}
									if len(got) == 0 {
										time.Sleep(time.Millisecond) // an idle worker polls, as the forwarder would
										continue
									}
									if err := s.Ack(b.Context(), storage.AckParams{Records: storage.Refs(got), WorkerID: worker}); err != nil {
										b.Error(err)
										return
									}
									delivered.Add(int64(len(got)))
								}
							})
						}
						wg.Wait()
						elapsed += time.Since(start)
						total += backlog
					}
					b.ReportMetric(float64(total)/elapsed.Seconds(), "msgs/s")
				})
			}
		}
	}
}

// BenchmarkSteadyCycle is one caught-up worker in a steady stream with
// strict ordering: per cycle the producers have committed 80 new rows over
// 1000 keys, the worker claims them while the records of the cycle before
// are still in flight, then acks those. It reports the client-side time of
// each step per message (ins, claim, ack): the round trip, the statements
// and, for the insert and the ack, the commit's wait for its flush to disk
// (the claim does not wait for one). On a quiet machine that is what a
// message costs in the steady scenario without the bench's noise, where one
// relay and four producers share two cores and a run's p99 lag is its
// longest stall. Unlike the forwarder, which acks on another connection
// while its next claim runs, the worker runs claim and ack one after the
// other, so the two never contend here.
func BenchmarkSteadyCycle(b *testing.B) {
	s := newStore(b, Config{})
	ctx := b.Context()
	const perCycle, keys = 80, 1000
	insertSQL := fmt.Sprintf(`INSERT INTO %s (uuid, topic, key, payload, metadata)
SELECT md5((g + $2)::text), 'bench', 'k' || ((g + $2) %% $3), convert_to(repeat('x', 256), 'UTF8'), '{"a":"b"}'
FROM generate_series(1, $1) g`, s.table)
	written := 0
	var inFlight []storage.ClaimRef
	var insT, claimT, ackT time.Duration
	msgs := 0
	for b.Loop() {
		t0 := time.Now()
		_, err := s.pool.Exec(ctx, insertSQL, perCycle, written, keys)
		must(b, err)
		written += perCycle
		t1 := time.Now()
		got, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 1000, Lease: time.Minute, WorkerID: "bench"})
		must(b, err)
		t2 := time.Now()
		if len(inFlight) > 0 {
			must(b, s.Ack(ctx, storage.AckParams{Records: inFlight, WorkerID: "bench"}))
		}
		t3 := time.Now()
		inFlight = inFlight[:0]
		for i := range got {
			inFlight = append(inFlight, got[i].Ref())
		}
		msgs += len(got)
		insT += t1.Sub(t0)
		claimT += t2.Sub(t1)
		ackT += t3.Sub(t2)
	}
	if msgs == 0 {
		b.Fatal("claimed nothing")
	}
	perMsg := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1000 / float64(msgs) }
	b.ReportMetric(perMsg(insT), "ins-µs/msg")
	b.ReportMetric(perMsg(claimT), "claim-µs/msg")
	b.ReportMetric(perMsg(ackT), "ack-µs/msg")
	b.ReportMetric(float64(msgs)/float64(b.N), "msgs/claim")
}
