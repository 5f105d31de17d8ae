package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
)

// outageMaxAttempts is the forwarders' MaxAttempts in the outage scenario:
// far above the one failed attempt each head makes, so that nothing is
// dead-lettered (a dead-letter would be counted and fail the command).
const outageMaxAttempts = 100

// errBrokerDown is what the target returns while the broker is down.
var errBrokerDown = errors.New("bench: broker down (outage scenario)")

// outageTarget fails every publish while down is set, like a broker that is
// unreachable; then it hands the publishes to the counting sink.
type outageTarget struct {
	down    atomic.Bool
	latency time.Duration
	failed  atomic.Int64 // messages refused while down
	first   atomic.Int64 // unix nanos of the first publish let through
	next    message.Publisher
}

// Publish implements message.Publisher.
func (t *outageTarget) Publish(topic string, msgs ...*message.Message) error {
	if t.down.Load() {
		if t.latency > 0 {
			time.Sleep(t.latency) // the round trip that failed
		}
		t.failed.Add(int64(len(msgs)))
		return errBrokerDown
	}
	t.first.CompareAndSwap(0, time.Now().UnixNano())
	return t.next.Publish(topic, msgs...)
}

// Close implements message.Publisher.
func (t *outageTarget) Close() error { return nil }

// outageStats is what the forwarders reported (OnOutcome) during an outage
// run.
type outageStats struct {
	keys              int   // keys of the backlog: one nacked head each is expected
	nacked, released  int64 // while the broker was down
	dead              int64 // dead-lettered, at any time: must be none
	renacked          int64 // nacks of a record that had failed before
	storageErrs       int64 // write-backs that failed
	headsNacked       int   // distinct keys with a nacked head
	dueFirst, dueLast time.Time
	outage            time.Duration // forwarders' start to the last key's head nacked
	firstAfterDue     time.Duration // first delivery after the timing began
	failedPublishes   int64         // messages the down broker refused
	byLastDue         int64         // delivered when the last retry came due; -1: not reached
}

// outage measures how fast txoutbox drains a backlog that an outage of the
// broker left behind, against a normal drain of the same backlog. Strict
// ordering is on: -outage-rows rows over -keys keys; while the broker is down
// the forwarders claim, every key's head fails, is nacked by the forwarder
// through the storage with the retry delay -outage-backoff, and the rest of
// its key waits behind it. Once every key's head is nacked the broker is back
// and the forwarders stop; fresh ones start when the last retry is due, and
// the drain is timed from then to the last delivery: the drain rate of the
// backlog the outage left, every key due at once, from the same start as the
// normal drain. The retry times are spread over about the outage phase's
// length (16 s with 10,000 keys here), so a drain timed from the first retry
// due with the forwarders kept running (-outage-keep-running) is paced by the
// retries coming due as much as by the relay. It runs at the first -latency,
// -batch and -forwarders value, the normal drain first.
func (b *bench) outage(ctx context.Context) error {
	lat, batch, fw := b.o.latencies[0], b.o.batches[0], b.o.forwarders[0]
	conc := b.concurrencyFor(lat)
	n := b.o.outageRows
	cfg := relayConfig{batch: batch, concurrency: conc, strict: true, poll: b.o.poll, forwarders: fw,
		maxAttempts: outageMaxAttempts,
		// The scenario measures the drain of a backlog parked behind a nacked
		// head per key: the forwarder's outage detection, which would give
		// the heads back untried instead, is kept out of the way.
		outageThreshold: math.MaxInt32,
		backoff:         txoutbox.Backoff{Base: b.o.outageRetry, Max: b.o.outageRetry, Jitter: txoutbox.NoJitter}}
	// With -repeat the two runs alternate, so that a slow moment of the
	// machine hits both; the medians are reported.
	var normals, outages []outcome
	var stats []outageStats
	for rep := range b.o.repeat {
		b.progress("outage: normal drain txoutbox rows=%d keys=%d latency=%s batch=%d forwarders=%d concurrency=%d (run %d of %d)", n, b.o.keys, lat, batch, fw, conc, rep+1, b.o.repeat)
		normal, err := b.drainRun(ctx, "txo", cfg, n, lat)
		if err != nil {
			return err
		}
		b.progress("outage: the same backlog, every key's head failing first (retry after %s) (run %d of %d)", b.o.outageRetry, rep+1, b.o.repeat)
		oc, st, err := b.outageRun(ctx, cfg, n, lat)
		if err != nil {
			return err
		}
		b.progress("outage: run %d of %d: normal %s, after the outage %s (%s), database+relay CPU us/msg %s vs %s",
			rep+1, b.o.repeat, rate(normal.rate), rate(oc.rate), ratio(oc.rate, normal.rate), cmp.Or(normal.cpu, "-"), cmp.Or(oc.cpu, "-"))
		for _, p := range st.problems(oc, normal) {
			b.lost = true // the figure cannot be trusted: fail the command
			b.progress("FAIL: outage (run %d): %s", rep+1, p)
		}
		normals, outages, stats = append(normals, normal), append(outages, oc), append(stats, st)
	}
	normal, oc := medianRun(normals), medianRun(outages)
	ratioCol := ratio(oc.rate, normal.rate)
	st := stats[slices.IndexFunc(outages, func(o outcome) bool { return o.rate == oc.rate })]
	byLast := "-"
	if st.byLastDue >= 0 {
		byLast = strconv.FormatInt(st.byLastDue, 10)
	}
	timed := "the last retry due, fresh forwarders started then"
	if b.o.outageKeepRunning {
		timed = "the first retry due, forwarders kept running"
	}
	settings := fmt.Sprintf("txoutbox col: drain after the outage, timed from %s; watermill col: normal drain of the same backlog, by txoutbox; "+
		"rows=%d keys=%d latency=%s batch=%d fwd=%d strict=on conc=%d retry=%s; outage %s: %d heads refused and nacked (1 per key, re-published once), %d released, %d dead-lettered; retries due over %s, %s delivered by the last one, first delivery +%s; target outage/normal >= 0.70x",
		timed, n, st.keys, lat, batch, fw, conc, b.o.outageRetry, st.outage.Round(time.Millisecond), st.nacked, st.released, st.dead,
		st.dueLast.Sub(st.dueFirst).Round(time.Millisecond), byLast, st.firstAfterDue.Round(time.Millisecond))
	if b.o.repeat > 1 {
		// The ratio is the median of the pairs' ratios: a pair ran back to
		// back, so a slow spell of the shared machine cancels out in it
		// better than in the ratio of two medians taken minutes apart.
		var pairs []float64
		for i := range outages {
			if outages[i].rate > 0 && normals[i].rate > 0 {
				pairs = append(pairs, outages[i].rate/normals[i].rate)
			}
		}
		spread := ""
		if len(pairs) > 0 {
			ratioCol = fmt.Sprintf("%.2fx", median(pairs))
			spread = fmt.Sprintf(" (%.2fx to %.2fx)", slices.Min(pairs), slices.Max(pairs))
		}
		settings = fmt.Sprintf("rates: medians of %d runs each, outage details of the median run; txo/wm: median of the pairs' outage/normal%s; ",
			b.o.repeat, spread) + settings
	}
	b.rows = append(b.rows, row{
		scenario: "outage", settings: settings,
		txo: rate(oc.rate), wm: rate(normal.rate), ratio: ratioCol,
		txoDL: oc.dl(), wmDL: normal.dl(), txoCPU: oc.cpu, wmCPU: normal.cpu,
	})
	return nil
}

// problems returns why the figures of one outage run and its normal drain
// cannot be trusted, if they cannot.
func (st outageStats) problems(oc, normal outcome) []string {
	var p []string
	if st.dead > 0 {
		p = append(p, fmt.Sprintf("%d records dead-lettered", st.dead))
	}
	if st.nacked != int64(st.keys) || st.headsNacked != st.keys || st.failedPublishes != int64(st.keys) {
		p = append(p, fmt.Sprintf("%d nacks on %d keys and %d refused publishes, want one per key (%d)", st.nacked, st.headsNacked, st.failedPublishes, st.keys))
	}
	if st.renacked > 0 || st.storageErrs > 0 {
		p = append(p, fmt.Sprintf("%d records failed twice, %d write-backs failed", st.renacked, st.storageErrs))
	}
	if oc.dup > 0 || normal.dup > 0 {
		p = append(p, fmt.Sprintf("duplicates delivered: %d after the outage, %d in the normal drain", oc.dup, normal.dup))
	}
	return p
}

// outageRun fills a backlog of n messages, runs the forwarders against a
// broker that is down until every key's head has been nacked, brings the
// broker back and times the drain from the first retry due.
func (b *bench) outageRun(ctx context.Context, cfg relayConfig, n int, latency time.Duration) (oc outcome, st outageStats, err error) {
	// The forwarders write live, under mu; st is set from it once they stopped.
	var mu sync.Mutex
	live := outageStats{keys: min(b.o.keys, n)}
	down := true
	nackedKeys := make(map[string]bool, live.keys)
	allNacked := make(chan struct{})
	cfg.onOutcome = func(o txoutbox.Outcome) {
		mu.Lock()
		defer mu.Unlock()
		if o.StorageErr != nil {
			live.storageErrs++
		}
		switch o.Kind {
		case txoutbox.OutcomeNacked:
			// Counted whenever it comes: a nack after the broker is back
			// (it never refuses then) shows up as one nack too many.
			live.nacked++
			if o.Record.Attempts > 1 {
				live.renacked++
			}
			if live.dueFirst.IsZero() || o.RetryAt.Before(live.dueFirst) {
				live.dueFirst = o.RetryAt
			}
			if o.RetryAt.After(live.dueLast) {
				live.dueLast = o.RetryAt
			}
			if !nackedKeys[o.Record.Key] {
				nackedKeys[o.Record.Key] = true
				live.headsNacked++
				if live.headsNacked == live.keys {
					close(allNacked)
				}
			}
		case txoutbox.OutcomeReleased:
			if down {
				live.released++ // the rest of a failed head's group, untried
			}
		case txoutbox.OutcomeDeadLettered:
			live.dead++
		}
	}
	snapshot := func() outageStats {
		mu.Lock()
		defer mu.Unlock()
		return live
	}

	cfg.name = b.name("txo")
	r := b.newRelay("txo", cfg)
	defer func() { err = errors.Join(err, r.Teardown(context.WithoutCancel(ctx))) }()
	if err := r.Setup(ctx); err != nil {
		return oc, st, err
	}
	if _, err = b.produce(ctx, r, n, false); err != nil {
		return oc, st, err
	}
	if err := b.settle(ctx); err != nil {
		return oc, st, err
	}
	s := b.newSink(n, latency, false)
	target := &outageTarget{latency: latency, next: s}
	target.down.Store(true)
	start := time.Now()
	stop, err := r.Start(ctx, target)
	if err != nil {
		return oc, st, err
	}
	stopped := false
	defer func() {
		if !stopped {
			stop()
		}
	}()

	// The outage: wait until every key's head has failed and been nacked.
	timeout := time.NewTimer(b.o.runTimeout)
	defer timeout.Stop()
	select {
	case <-allNacked:
	case <-timeout.C:
		s := snapshot()
		return oc, s, fmt.Errorf("outage phase: %d of %d keys had their head nacked within -run-timeout %s", s.headsNacked, s.keys, b.o.runTimeout)
	case <-ctx.Done():
		return oc, snapshot(), ctx.Err()
	}
	mu.Lock()
	live.outage = time.Since(start)
	keys, outage, dueFirst, dueLast := live.keys, live.outage, live.dueFirst, live.dueLast
	mu.Unlock()
	if !time.Now().Before(dueFirst) {
		s := snapshot()
		return oc, s, fmt.Errorf("outage phase took %s, longer than -outage-backoff %s: the first retries came due before every key's head had failed (raise -outage-backoff)",
			s.outage.Round(time.Millisecond), b.o.outageRetry)
	}
	from := dueFirst
	if !b.o.outageKeepRunning {
		// Run returns once it has given back what it held; nothing runs
		// until every retry is due.
		stop()
		stopped = true
		from = dueLast
	}
	mu.Lock()
	down = false
	target.down.Store(false)
	mu.Unlock()
	b.progress("outage: %d heads nacked in %s; broker back, retries due in %s to %s", keys, outage.Round(time.Millisecond),
		time.Until(dueFirst).Round(time.Millisecond), time.Until(dueLast).Round(time.Millisecond))

	// The recovery, timed from the last retry due, when fresh forwarders
	// start, or with -outage-keep-running from the first one.
	wait := time.NewTimer(time.Until(from))
	select {
	case <-wait.C:
	case <-ctx.Done():
		wait.Stop()
		return oc, snapshot(), ctx.Err()
	}
	cpu0 := b.cpu.sample()
	// How much the spread of the retry times held back: what was delivered
	// by the time the last retry was due.
	var byLast atomic.Int64
	byLast.Store(-1)
	lastDue := time.AfterFunc(time.Until(dueLast), func() { byLast.Store(s.unique.Load()) })
	defer lastDue.Stop()
	if !b.o.outageKeepRunning {
		if stop, err = r.Start(ctx, target); err != nil {
			return oc, snapshot(), err
		}
		stopped = false
	}
	b.await(ctx, s)
	cpu1 := b.cpu.sample()
	stop()
	stopped = true
	st = snapshot()
	st.failedPublishes = target.failed.Load()
	st.byLastDue = byLast.Load()
	oc.n = n
	if first := target.first.Load(); first > 0 {
		// Delivered before its retry was due: the outage did not hold the
		// backlog, and the figure would be flattered. Timestamps are stored
		// to the microsecond, hence the slack.
		if at := time.Unix(0, first); at.Before(from.Add(-time.Millisecond)) {
			return oc, st, fmt.Errorf("outage: a message was delivered %s before the timing began (the first retry due)", from.Sub(at))
		}
		st.firstAfterDue = time.Unix(0, first).Sub(from)
	}
	if db, self, ok := perMessage(cpu0, cpu1, int(s.unique.Load())); ok {
		oc.cpu = fmt.Sprintf("%.1f+%.1f", db, self)
	}
	if at := s.doneAt.Load(); at > 0 {
		oc.rate = float64(n) / time.Unix(0, at).Sub(from).Seconds()
	}
	b.finish(&oc, s)
	return oc, st, ctx.Err()
}
