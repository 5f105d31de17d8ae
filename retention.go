package txoutbox

import (
	"context"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/txoutbox/txoutbox/storage"
)

// pruneBatch is how many delivered records one prune statement deletes at
// most: a short statement, however large the backlog.
const pruneBatch = 1000

// retain runs the retention of a running forwarder until ctx is done: every
// RetentionInterval it deletes the delivered records older than Retention,
// a batch at a time while batches come back full. Storages without
// storage.Pruner, and NoRetention, run nothing. The returned wait blocks
// until it has stopped.
func (f *Forwarder) retain(ctx context.Context) (wait func()) {
	p, ok := f.store.(storage.Pruner)
	if !ok || f.config.Retention == NoRetention {
		return func() {}
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTimer(f.config.RetentionInterval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			f.pruneOnce(ctx, p)
			t.Reset(f.config.RetentionInterval)
		}
	}()
	return wg.Wait
}

// pruneOnce deletes the expired delivered records, a batch per call, until
// a batch comes back short or ctx is done.
func (f *Forwarder) pruneOnce(ctx context.Context, p storage.Pruner) {
	var total int64
	for ctx.Err() == nil {
		n, err := p.Prune(ctx, storage.PruneParams{OlderThan: f.config.Retention, Limit: pruneBatch})
		if err != nil {
			if ctx.Err() == nil {
				f.logger.Error("Could not prune delivered records; retention tries again later", err, nil)
			}
			break
		}
		total += n
		f.pruned.Add(n)
		if n < pruneBatch {
			break
		}
	}
	if total > 0 {
		f.logger.Debug("Pruned delivered records", watermill.LogFields{"deleted": total, "retention": f.config.Retention})
	}
}

// Pruned returns how many delivered records this forwarder's retention
// deleted since it was made.
func (f *Forwarder) Pruned() int64 { return f.pruned.Load() }
