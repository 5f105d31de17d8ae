package main

import (
	"context"
	"fmt"
	"time"
)

// outageWait is how long the outage scenario's records wait for their retry
// (plus up to a second of jitter per key) before the forwarders start.
const outageWait = 2 * time.Second

// outage drains -outage-rows records twice with the same settings: once as
// a plain backlog, once after an outage, every record waiting for its retry
// (a head nacked, the rest of its key released with the same retry time, as
// the forwarder does, each key at its own time) until all are due. The
// figure is the outage drain rate against the plain one.
func (b *bench) outage(ctx context.Context) error {
	n := b.o.outageRows
	for _, batch := range b.o.batches {
		for _, fw := range b.o.forwarders {
			conc := b.concurrenciesFor(0)[0]
			cfg := relayConfig{batch: batch, concurrency: conc, strict: true, poll: b.o.poll, forwarders: fw}
			var plain, after []outcome
			for rep := range b.o.repeat {
				b.progress("outage: plain drain batch=%d forwarders=%d messages=%d (run %d of %d)", batch, fw, n, rep+1, b.o.repeat)
				p, err := b.drainRun(ctx, "txo", cfg, n, 0)
				if err != nil {
					return err
				}
				plain = append(plain, p)
				b.progress("outage: drain after an outage batch=%d forwarders=%d messages=%d (run %d of %d)", batch, fw, n, rep+1, b.o.repeat)
				o, err := b.drainRun(ctx, "txo", cfg, n, 0, postpone)
				if err != nil {
					return err
				}
				after = append(after, o)
			}
			p, o := medianRun(plain), medianRun(after)
			b.rows = append(b.rows, row{
				scenario: "outage",
				settings: fmt.Sprintf("batch=%d fwd=%d strict=on conc=%d, %d msgs: after the outage (txoutbox column) / plain drain (%s)", batch, fw, conc, n, rate(p.rate)),
				txo:      rate(o.rate), wm: "-", ratio: ratio(o.rate, p.rate),
				txoDL: o.dl(), wmDL: "-", txoCPU: o.cpu,
			})
		}
	}
	return nil
}

// postpone puts every record of the table back to waiting for a retry, a
// key's records all at the same time, keys spread over a second.
func postpone(ctx context.Context, r relay) error {
	t, ok := r.(*txoRelay)
	if !ok {
		return fmt.Errorf("outage: not a txoutbox relay")
	}
	_, err := t.fwdPool.Exec(ctx, fmt.Sprintf(`UPDATE %s SET attempts = 1, last_error = 'broker down',
    due_at = now() + $1::bigint * interval '1 microsecond' + (abs(hashtext(key)) %% 1000) * interval '1 millisecond'`, t.store.Table()),
		outageWait.Microseconds())
	if err != nil {
		return fmt.Errorf("outage: postpone: %w", err)
	}
	// Not timed: the drain starts once every record is due.
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(outageWait + time.Second):
	}
	return nil
}
