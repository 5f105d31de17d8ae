package txoutbox

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Defaults of [ForwarderConfig], applied to zero fields.
const (
	BatchSizeDefault          = 100
	LeaseDefault              = 30 * time.Second
	ConcurrencyDefault        = 16
	MaxAttemptsDefault        = 10
	PublishTimeoutDefault     = 5 * time.Second
	PollMinDefault            = 50 * time.Millisecond
	PollMaxDefault            = 5 * time.Second
	PollFactorDefault         = 2.0
	StorageErrorDelayDefault  = time.Second
	ShutdownTimeoutDefault    = 10 * time.Second
	BookkeepingTimeoutDefault = 10 * time.Second

	OutageThresholdDefault  = 3
	ProbeIntervalDefault    = time.Second
	ProbeIntervalMaxDefault = 30 * time.Second

	RetentionDefault         = 7 * 24 * time.Hour
	RetentionIntervalDefault = time.Minute

	BackoffBaseDefault   = time.Second
	BackoffFactorDefault = 2.0
	BackoffMaxDefault    = 5 * time.Minute
	BackoffJitterDefault = 0.25
)

// NoRetention turns the forwarders' retention off when set as
// [ForwarderConfig.Retention]: delivered records then stay until purged.
const NoRetention time.Duration = -1

// NoPublishTimeout turns the per-publish timeout off when set as
// [ForwarderConfig.PublishTimeout]. Leave the timeout on unless the target
// bounds its own calls: a hung publish otherwise holds its lease forever.
const NoPublishTimeout time.Duration = -1

// Backoff is the retry schedule of a failed publish: the n-th attempt waits
// Base*Factor^(n-1), capped at Max, then spread by ±Jitter (a fraction).
type Backoff struct {
	// Base is the delay after the first failed attempt. Defaults to 1s.
	Base time.Duration
	// Factor multiplies the delay after each further attempt; >= 1. Defaults to 2.
	Factor float64
	// Max caps the delay. Defaults to 5m.
	Max time.Duration
	// Jitter spreads each delay uniformly by ±Jitter*delay, in [0, 1], so
	// retries of many records do not hit a recovering broker at once.
	// Defaults to 0.25; set NoJitter for exact delays.
	Jitter float64
}

// NoJitter turns jitter off when set as [Backoff.Jitter].
const NoJitter = -1.0

func (b *Backoff) setDefaults() {
	b.Base = cmp.Or(b.Base, BackoffBaseDefault)
	b.Factor = cmp.Or(b.Factor, BackoffFactorDefault)
	b.Max = cmp.Or(b.Max, BackoffMaxDefault)
	b.Jitter = cmp.Or(b.Jitter, BackoffJitterDefault)
	if b.Jitter == NoJitter {
		b.Jitter = 0
	}
}

func (b Backoff) validate() error {
	switch {
	case b.Base < 0:
		return fmt.Errorf("Backoff.Base must be > 0, got %s", b.Base)
	case b.Factor < 1 || math.IsInf(b.Factor, 0) || math.IsNaN(b.Factor):
		return fmt.Errorf("Backoff.Factor must be a finite number >= 1, got %v", b.Factor)
	case b.Max < b.Base:
		return fmt.Errorf("Backoff.Max (%s) must be >= Backoff.Base (%s)", b.Max, b.Base)
	case b.Jitter < 0 || b.Jitter > 1 || math.IsNaN(b.Jitter):
		return fmt.Errorf("Backoff.Jitter must be in [0, 1], got %v", b.Jitter)
	}
	return nil
}

// Delay returns the wait before the retry that follows failed attempt number
// attempt (1 for the first attempt).
func (b Backoff) Delay(attempt int) time.Duration {
	d := float64(b.Base) * math.Pow(b.Factor, float64(max(attempt, 1)-1))
	d = min(d, float64(b.Max))
	if b.Jitter > 0 {
		d *= 1 + b.Jitter*(2*rand.Float64()-1)
	}
	return time.Duration(d)
}

// ForwarderConfig configures a [Forwarder]. The zero value is usable: every zero
// field takes its default.
type ForwarderConfig struct {
	// BatchSize is the most records one claim takes. Defaults to 100.
	BatchSize int
	// MaxInFlight bounds the records claimed and not yet written back
	// (published and acked, nacked, released or dead-lettered). The forwarder
	// claims min(BatchSize, MaxInFlight - in flight) records whenever there is
	// room for half a batch, so that work keeps flowing while slow keys
	// finish. Defaults to BatchSize: with twice as many, claims ran while a
	// whole batch was still in flight, and every claim then walked past the
	// held-back records of the keys in flight (a no-op drain at batch 1000
	// did 29k instead of 56k msgs/s, on twice the database CPU per message).
	MaxInFlight int
	// Lease is how long claimed records stay leased to this forwarder; another
	// forwarder may claim them after it expires. The forwarder renews the
	// leases of the records it still holds every Lease/5, so a long key group
	// keeps its records; a record is published only if its publish can end
	// (PublishTimeout) before the lease runs out, else the rest of its group
	// is released. Defaults to 30s.
	Lease time.Duration
	// Concurrency is how many key groups are published in parallel (lanes).
	// Inside a group, records are published one after another in id order; a
	// new group of a key already in a lane waits behind it. Defaults to 16.
	Concurrency int
	// MaxAttempts is the number of attempts after which a failing record is
	// dead-lettered. Defaults to 10.
	MaxAttempts int
	// Backoff is the retry schedule of failed publishes.
	Backoff Backoff
	// OutageThreshold is how many failed publishes in a row, with no
	// success in between, make the forwarder treat a topic (from more than
	// one record, or errors saying the target is unavailable) or the whole
	// target (from more than one topic) as down: it then charges no attempt
	// for it, gives its records back untried and probes it with one record
	// at a time (see ProbeInterval). Two records of different keys failing
	// between two successes is common enough with a few poison records;
	// three in a row across records, with none of the lanes succeeding in
	// between, is an outage far more often than not, and costs at most two
	// attempts before it is seen. Defaults to 3.
	OutageThreshold int
	// ProbeInterval is the wait from the start of an outage to the first
	// probe, doubled after each failed probe up to ProbeIntervalMax. A
	// successful probe ends the outage at once. Defaults to 1s.
	ProbeInterval time.Duration
	// ProbeIntervalMax caps the wait between probes, and so bounds the time
	// from the broker's recovery to the forwarder's. Defaults to 30s.
	ProbeIntervalMax time.Duration
	// PublishTimeout bounds each publish, middleware included. The message's
	// context carries the deadline; targets that ignore it are abandoned at the
	// deadline and the record is retried. It must be at most Lease/2, so that
	// the lease renewal keeps ahead of the publishes. Defaults to 5s;
	// NoPublishTimeout turns it off (a hung publish then holds its lane).
	PublishTimeout time.Duration
	// MaxAbandonedPublishes bounds the publishes abandoned at their timeout
	// whose target ignores the context and keeps running (see
	// Forwarder.AbandonedPublishes): at the bound the forwarder claims nothing
	// (RunOnce returns ErrTooManyAbandoned at once) and its lanes release
	// their groups' rest until some end, so at most
	// MaxAbandonedPublishes+Concurrency goroutines are ever stuck in the
	// target. Defaults to Concurrency.
	MaxAbandonedPublishes int
	// PollMin is the first idle sleep after a claim found nothing. After a
	// claim that the storage reports drained (storage.DrainClaimer: it left
	// nothing claimable out) the next one comes PollMin/2 after it started,
	// unless a wake or a key group of more than one record settling brings
	// it sooner. Defaults to 50ms.
	PollMin time.Duration
	// PollMax caps the idle sleep while the table stays empty. Defaults to 5s.
	PollMax time.Duration
	// PollFactor multiplies the idle sleep after each empty claim once
	// claims have found nothing for four PollMin (until then an empty claim
	// sleeps PollMin: a lull in a stream is not an idle table); >= 1.
	// Defaults to 2.
	PollFactor float64
	// StorageErrorDelay is the wait after a failed claim before the next one.
	// Defaults to 1s.
	StorageErrorDelay time.Duration
	// ShutdownTimeout bounds how long in-flight publishes may run after Run's
	// context is cancelled; then they are abandoned and their records retried.
	// Defaults to 10s.
	ShutdownTimeout time.Duration
	// BookkeepingTimeout bounds each write-back (ack, nack, release,
	// dead-letter), which run even after the context is cancelled so that
	// nothing is left leased. Defaults to 10s.
	BookkeepingTimeout time.Duration
	// WorkerID identifies this forwarder's leases. Defaults to a random id; give
	// each forwarder its own.
	WorkerID string
	// Middlewares wrap each publish, first one outermost: Watermill's
	// middleware (Retry, Timeout, CircuitBreaker, ...) and txoutbox/middleware
	// apply. The message they see carries the outbox metadata
	// (MetadataOutboxID, MetadataAttempt, MetadataKey, MetadataCreatedAt) and
	// its context holds the [Delivery] (see DeliveryFromContext).
	Middlewares []message.HandlerMiddleware
	// Retention is how long delivered records are kept: a running
	// forwarder deletes those delivered longer ago, every RetentionInterval,
	// in statements of at most 1000 records, so that the table does not
	// grow until someone notices. One forwarder at a time prunes (the
	// storage's advisory lock, or SQLite's write lock), and it never touches
	// a pending or dead record. Only storages that implement storage.Pruner
	// (every built-in one) are pruned; RunOnce never prunes. Defaults to 7
	// days, long enough to look into what was delivered last week;
	// NoRetention keeps delivered records until purged.
	Retention time.Duration
	// RetentionInterval is how often a forwarder prunes. Defaults to 1m.
	RetentionInterval time.Duration
	// OnOutcome, if set, is called with the outcome of every claimed record
	// once it is written back, including the records that never reach the
	// middleware (released, undecodable, timed out). It runs on the
	// forwarder's goroutines: keep it fast and safe for concurrent use. The
	// metrics middleware uses it for exact retry and dead-letter counts.
	OnOutcome func(Outcome)
}

func (c *ForwarderConfig) setDefaults() {
	c.BatchSize = cmp.Or(c.BatchSize, BatchSizeDefault)
	if c.BatchSize > 0 {
		c.MaxInFlight = cmp.Or(c.MaxInFlight, c.BatchSize)
	}
	c.Lease = cmp.Or(c.Lease, LeaseDefault)
	c.Concurrency = cmp.Or(c.Concurrency, ConcurrencyDefault)
	c.MaxAbandonedPublishes = cmp.Or(c.MaxAbandonedPublishes, c.Concurrency)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, MaxAttemptsDefault)
	c.Backoff.setDefaults()
	c.OutageThreshold = cmp.Or(c.OutageThreshold, OutageThresholdDefault)
	c.ProbeInterval = cmp.Or(c.ProbeInterval, ProbeIntervalDefault)
	c.ProbeIntervalMax = cmp.Or(c.ProbeIntervalMax, max(ProbeIntervalMaxDefault, c.ProbeInterval))
	c.PublishTimeout = cmp.Or(c.PublishTimeout, PublishTimeoutDefault)
	c.PollMin = cmp.Or(c.PollMin, PollMinDefault)
	c.PollMax = cmp.Or(c.PollMax, PollMaxDefault)
	c.PollFactor = cmp.Or(c.PollFactor, PollFactorDefault)
	c.StorageErrorDelay = cmp.Or(c.StorageErrorDelay, StorageErrorDelayDefault)
	c.ShutdownTimeout = cmp.Or(c.ShutdownTimeout, ShutdownTimeoutDefault)
	c.BookkeepingTimeout = cmp.Or(c.BookkeepingTimeout, BookkeepingTimeoutDefault)
	c.WorkerID = cmp.Or(c.WorkerID, "txoutbox-"+watermill.NewShortUUID())
	c.Retention = cmp.Or(c.Retention, RetentionDefault)
	c.RetentionInterval = cmp.Or(c.RetentionInterval, RetentionIntervalDefault)
}

// Validate checks a configuration after defaults were applied and names the
// field and its bound on error.
func (c ForwarderConfig) Validate() error {
	var errs []error
	positive := func(name string, d time.Duration) {
		if d <= 0 {
			errs = append(errs, fmt.Errorf("%s must be > 0, got %s", name, d))
		}
	}
	if c.BatchSize <= 0 {
		errs = append(errs, fmt.Errorf("BatchSize must be > 0, got %d", c.BatchSize))
	}
	if c.Concurrency <= 0 {
		errs = append(errs, fmt.Errorf("Concurrency must be > 0, got %d", c.Concurrency))
	}
	if c.MaxInFlight <= 0 {
		errs = append(errs, fmt.Errorf("MaxInFlight must be > 0, got %d", c.MaxInFlight))
	}
	if c.MaxAbandonedPublishes <= 0 {
		errs = append(errs, fmt.Errorf("MaxAbandonedPublishes must be > 0, got %d", c.MaxAbandonedPublishes))
	}
	if c.MaxAttempts <= 0 {
		errs = append(errs, fmt.Errorf("MaxAttempts must be > 0, got %d", c.MaxAttempts))
	}
	positive("Lease", c.Lease)
	if c.PublishTimeout != NoPublishTimeout {
		positive("PublishTimeout", c.PublishTimeout)
		if c.Lease > 0 && c.PublishTimeout > c.Lease/2 {
			errs = append(errs, fmt.Errorf("PublishTimeout (%s) must be <= Lease/2 (%s), so that leases are renewed ahead of the publishes (raise Lease or lower PublishTimeout)", c.PublishTimeout, c.Lease/2))
		}
	}
	if c.OutageThreshold < 2 {
		errs = append(errs, fmt.Errorf("OutageThreshold must be >= 2 (one failure cannot tell an outage from a bad record), got %d", c.OutageThreshold))
	}
	positive("ProbeInterval", c.ProbeInterval)
	if c.ProbeIntervalMax < c.ProbeInterval {
		errs = append(errs, fmt.Errorf("ProbeIntervalMax (%s) must be >= ProbeInterval (%s)", c.ProbeIntervalMax, c.ProbeInterval))
	}
	positive("PollMin", c.PollMin)
	positive("StorageErrorDelay", c.StorageErrorDelay)
	positive("ShutdownTimeout", c.ShutdownTimeout)
	positive("BookkeepingTimeout", c.BookkeepingTimeout)
	if c.PollMax < c.PollMin {
		errs = append(errs, fmt.Errorf("PollMax (%s) must be >= PollMin (%s)", c.PollMax, c.PollMin))
	}
	if c.PollFactor < 1 || math.IsInf(c.PollFactor, 0) || math.IsNaN(c.PollFactor) {
		errs = append(errs, fmt.Errorf("PollFactor must be a finite number >= 1, got %v", c.PollFactor))
	}
	if err := c.Backoff.validate(); err != nil {
		errs = append(errs, err)
	}
	if c.Retention <= 0 && c.Retention != NoRetention {
		errs = append(errs, fmt.Errorf("Retention must be > 0 or NoRetention, got %s", c.Retention))
	}
	positive("RetentionInterval", c.RetentionInterval)
	if c.WorkerID == "" {
		errs = append(errs, errors.New("WorkerID must not be empty"))
	}
	for i, m := range c.Middlewares {
		if m == nil {
			errs = append(errs, fmt.Errorf("Middlewares[%d] is nil", i))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("invalid forwarder config: %w", err)
	}
	return nil
}
