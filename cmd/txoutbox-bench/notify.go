package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"
)

// notifyProducers is the number of producer connections of the notify
// scenario: enough transactions in flight for its highest rate.
const notifyProducers = 16

// notifyPoint is what one offered rate measured, with and without the
// NOTIFY trigger (medians of the runs).
type notifyPoint struct {
	rate          int
	with, without notifyRun
}

// notifyRun is one run of the notify scenario.
type notifyRun struct {
	achieved      float64       // commits/s
	p50, p99      time.Duration // BEGIN to the return of COMMIT
	dbCPU, selfUS float64       // CPU per commit, microseconds (0: not measured)
	failed        string
}

// notify measures what the NOTIFY trigger costs the producers: at each
// -notify-rates offered rate, producers commit one message per transaction
// into txoutbox's table with the trigger (Config.NotifyChannel, a LISTEN
// connection attached, as a woken relay has) and without it, and the
// transaction's time (BEGIN to the return of COMMIT) and the CPU per
// commit of PostgreSQL and of the bench are compared. No forwarder runs:
// the figures are the producers' alone.
func (b *bench) notify(ctx context.Context) error {
	for _, rt := range b.o.notifyRates {
		var with, without []notifyRun
		for rep := range b.o.repeat {
			for _, trig := range []bool{true, false} {
				b.progress("notify rate=%d/s trigger=%s for %s after %s warm-up (run %d of %d)", rt, onOff(trig), b.o.duration, b.o.warmup, rep+1, b.o.repeat)
				r, err := b.notifyRun(ctx, rt, trig)
				if err != nil {
					return err
				}
				if trig {
					with = append(with, r)
				} else {
					without = append(without, r)
				}
			}
		}
		p := notifyPoint{rate: rt, with: medianNotify(with), without: medianNotify(without)}
		b.notifyPts = append(b.notifyPts, p)
		settings := fmt.Sprintf("achieved %.0f/s with, %.0f/s without", p.with.achieved, p.without.achieved)
		show := func(r notifyRun, v string) string {
			if r.failed != "" {
				return r.failed
			}
			return v
		}
		b.add(
			row{table: tableNotify, scenario: fmt.Sprintf("%d/s commit p50", rt), settings: settings,
				txo: show(p.with, ms(p.with.p50)), wm: show(p.without, ms(p.without.p50)), ratio: costMS(p.with.p50, p.without.p50)},
			row{table: tableNotify, scenario: fmt.Sprintf("%d/s commit p99", rt), settings: settings,
				txo: show(p.with, ms(p.with.p99)), wm: show(p.without, ms(p.without.p99)), ratio: costMS(p.with.p99, p.without.p99)},
			row{table: tableNotify, scenario: fmt.Sprintf("%d/s CPU per commit", rt), settings: settings,
				txo: show(p.with, cpuUS(p.with)), wm: show(p.without, cpuUS(p.without)), ratio: costUS(p.with, p.without)},
		)
	}
	return nil
}

func cpuUS(r notifyRun) string {
	if r.dbCPU <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f+%.0f us", r.dbCPU, r.selfUS)
}

// costMS is what the trigger adds to a latency, in ms and as a factor.
func costMS(with, without time.Duration) string {
	if with <= 0 || without <= 0 {
		return "-"
	}
	return fmt.Sprintf("%+.2fms (%.2fx)", float64(with-without)/float64(time.Millisecond), float64(with)/float64(without))
}

// costUS is what the trigger adds to the CPU of a commit.
func costUS(with, without notifyRun) string {
	if with.dbCPU <= 0 || without.dbCPU <= 0 {
		return "-"
	}
	a, b := with.dbCPU+with.selfUS, without.dbCPU+without.selfUS
	return fmt.Sprintf("%+.0f us (%.2fx)", a-b, a/b)
}

// medianNotify takes the median of each figure on its own.
func medianNotify(runs []notifyRun) notifyRun {
	var m notifyRun
	var ach, db, self []float64
	var p50s, p99s []time.Duration
	for _, r := range runs {
		if r.failed != "" {
			m.failed = r.failed
			continue
		}
		ach, db, self = append(ach, r.achieved), append(db, r.dbCPU), append(self, r.selfUS)
		p50s, p99s = append(p50s, r.p50), append(p99s, r.p99)
	}
	if len(ach) == 0 {
		return m
	}
	slices.Sort(p50s)
	slices.Sort(p99s)
	m.achieved, m.dbCPU, m.selfUS = median(ach), median(db), median(self)
	m.p50, m.p99 = p50s[len(p50s)/2], p99s[len(p99s)/2]
	return m
}

// notifyRun offers rate commits/s for -warmup plus -duration and measures
// the commits after the warm-up.
func (b *bench) notifyRun(ctx context.Context, rate int, trigger bool) (res notifyRun, err error) {
	cfg := relayConfig{name: b.name("notify"), url: b.o.url, producers: notifyProducers, forwarders: 1, notify: trigger, batch: 100, poll: time.Second}
	r := newTxoRelay(cfg)
	defer b.teardown(ctx, r)
	runCtx, cancel := context.WithTimeout(ctx, b.o.runTimeout)
	defer cancel()
	if err := r.Setup(runCtx); err != nil {
		res.failed = "failed: " + err.Error()
		return res, ctx.Err()
	}
	if trigger {
		// A relay woken by NOTIFY listens on the channel; the listener
		// reads every notification, as the forwarders' would.
		lctx, stopListen := context.WithCancel(runCtx)
		var wg sync.WaitGroup
		wg.Go(func() { _ = r.store.Listen(lctx, func() {}) })
		defer func() { stopListen(); wg.Wait() }()
	}
	// The load is offered for -warmup plus -duration, however many
	// commits that is: producers that cannot keep up are the figure
	// (achieved commits/s), not a reason to run longer.
	interval := time.Second / time.Duration(rate)
	jobs := make(chan int, notifyProducers)
	var mu sync.Mutex
	var lats []time.Duration
	var firstErr error
	start := time.Now()
	measureFrom := start.Add(b.o.warmup)
	var wg sync.WaitGroup
	for range notifyProducers {
		wg.Go(func() {
			for i := range jobs {
				t0 := time.Now()
				err := r.PublishTx(runCtx, b.messagesOf([]int{i}, false))
				d := time.Since(t0)
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				if err == nil && !t0.Before(measureFrom) {
					lats = append(lats, d)
				}
				mu.Unlock()
			}
		})
	}
	var cpu0 cpuSample
	var measuredAt time.Time
	end := start.Add(b.o.warmup + b.o.duration)
	for i := 0; runCtx.Err() == nil; i++ {
		at := start.Add(time.Duration(i) * interval)
		if !at.Before(end) || time.Now().After(end) {
			break
		}
		if d := time.Until(at); d > 0 {
			time.Sleep(d) // pacing the offered load
		}
		if measuredAt.IsZero() && !at.Before(measureFrom) {
			measuredAt, cpu0 = time.Now(), b.cpu.sample()
		}
		select {
		case jobs <- i:
		case <-runCtx.Done():
		}
	}
	close(jobs)
	wg.Wait()
	cpu1 := b.cpu.sample()
	if firstErr != nil {
		res.failed = "failed: " + firstErr.Error()
		return res, ctx.Err()
	}
	if measuredAt.IsZero() || len(lats) == 0 {
		res.failed = "failed: nothing measured"
		return res, ctx.Err()
	}
	// The commits started in the measured window, over its length: a
	// transaction still queued when the offer ended counts for nothing.
	res.achieved = float64(len(lats)) / time.Since(measuredAt).Seconds()
	slices.Sort(lats)
	res.p50, res.p99 = percentiles(lats)
	if db, self, ok := perMessage(cpu0, cpu1, len(lats)); ok {
		res.dbCPU, res.selfUS = db, self
	}
	return res, ctx.Err()
}
