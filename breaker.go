package txoutbox

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// How the forwarder tells an outage from a poison record.
//
// Each topic has a circuit, and so has the target as a whole. A failed
// publish counts toward both; any successful publish to a topic clears the
// topic's count and the target's. A topic is down after OutageThreshold
// failures in a row, with no success to it in between, of more than one
// record (one record failing again and again is that record's problem), or
// of any records if the errors say the target is unavailable (ErrUnavailable
// and the errors classify recognises). The target is down after
// OutageThreshold failures in a row, with no success to any topic in
// between, spread over more than one topic.
//
// While a topic is down its records are released untried (no attempt
// charged) with their retry time at its next probe; while the target is
// down the forwarder claims nothing but a probe. One record at a time
// probes: a success ends the outage at once, a failure doubles the wait to
// the next probe, from ProbeInterval up to ProbeIntervalMax. A probe's
// failure is not charged to its record either.

// Outage is a target, or one topic of it, that the forwarder treats as down.
type Outage struct {
	// Topic is the topic that is down; empty when the whole target is.
	Topic string
	// Since is when the forwarder found it down.
	Since time.Time
	// Waiting counts the records given back untried because of it so far
	// (each once, however often it was claimed).
	Waiting int
	// NextProbe is when one record will be published to test it again.
	NextProbe time.Time
}

// ErrOutage is returned by Forwarder.Healthy while the target or a topic of
// it is down.
var ErrOutage = errors.New("publish target down")

// waitedCap bounds the ids an outage remembers to count its waiting records.
const waitedCap = 1 << 20

type circuit struct {
	topic string // empty for the target

	fails      int    // failures in a row with no success in between
	firstID    int64  // the record of the first of them
	firstTopic string // its topic
	spread     bool   // they came from more than one record (topic) or topic (target)

	down       bool
	since      time.Time
	delay      time.Duration // wait from a failed probe to the next
	probeAt    time.Time
	probing    bool      // a probe's publish is under way
	probeID    int64     // its record
	probeStart time.Time // when it was admitted
	probeClaim time.Time // target only: a claim for a probe started then
	waited     map[int64]struct{}
}

func (c *circuit) clear() bool {
	return c.fails == 0 && !c.down
}

// breaker keeps the circuits of a forwarder. It outlives sessions, so that
// RunOnce called from cron keeps what the previous call found.
type breaker struct {
	threshold          int
	probeMin, probeMax time.Duration
	// staleProbe: a probe admitted this long ago and never reported is
	// forgotten (a safety net: every admitted publish reports).
	staleProbe time.Duration
	// probeWait bounds a probe's publish: PublishTimeout.
	probeWait time.Duration
	logger    watermill.LoggerAdapter
	wake      func()

	// quiet: every circuit is clear, so publishes need not take mu.
	quiet atomic.Bool

	mu     sync.Mutex
	target circuit
	topics map[string]*circuit
}

func newBreaker(cfg *ForwarderConfig, logger watermill.LoggerAdapter, wake func()) *breaker {
	b := &breaker{
		threshold:  cfg.OutageThreshold,
		probeMin:   cfg.ProbeInterval,
		probeMax:   cfg.ProbeIntervalMax,
		staleProbe: cfg.Lease,
		probeWait:  max(cfg.PublishTimeout, 0),
		logger:     logger,
		wake:       wake,
		topics:     make(map[string]*circuit),
	}
	b.quiet.Store(true)
	return b
}

// admit tells a lane whether to publish record id of topic now. When it
// may not, retryAt is when to make the record due again. A probe is
// admitted once its time comes; every admitted publish reports its outcome
// with published or failed.
func (b *breaker) admit(topic string, id int64, now time.Time) (ok bool, retryAt time.Time) {
	if b.quiet.Load() {
		return true, time.Time{}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if t := &b.target; t.down {
		if b.mayProbe(t, now) || !t.probeClaim.IsZero() && !t.probing {
			t.probing, t.probeID, t.probeStart, t.probeClaim = true, id, now, time.Time{}
			return true, time.Time{}
		}
		t.wait(id)
		// No claim runs but a probe's while the target is down: the
		// record may be due at once.
		return false, now
	}
	c := b.topics[topic]
	if c == nil || !c.down {
		return true, time.Time{}
	}
	if b.mayProbe(c, now) {
		c.probing, c.probeID, c.probeStart = true, id, now
		return true, time.Time{}
	}
	c.wait(id)
	return false, b.retryAt(c, now)
}

// mayProbe reports whether c's next probe may start now.
func (b *breaker) mayProbe(c *circuit, now time.Time) bool {
	if c.probing && now.Sub(c.probeStart) >= b.staleProbe {
		c.probing = false
	}
	return !c.probing && !now.Before(c.probeAt)
}

// retryAt is when a record given back for c's outage is due again: at the
// next probe, or while a probe is under way, when it will have ended
// (PublishTimeout after its start): when it succeeds, the records behind it
// follow it within PublishTimeout; when it fails, they are given back again
// until the next probe.
func (b *breaker) retryAt(c *circuit, now time.Time) time.Time {
	switch {
	case c.topic == "":
		return now // no claim runs but a probe's while the target is down
	case c.probing:
		next := now.Add(c.delay)
		if at := c.probeStart.Add(b.probeWait); at.After(now) && at.Before(next) {
			return at
		}
		return next
	case c.probeAt.After(now):
		return c.probeAt
	}
	return now.Add(c.delay)
}

func (c *circuit) wait(id int64) {
	if c.waited == nil {
		c.waited = make(map[int64]struct{})
	}
	if len(c.waited) < waitedCap {
		c.waited[id] = struct{}{}
	}
}

// published reports a successful publish of record id of topic: the topic
// and the target are up.
func (b *breaker) published(topic string, now time.Time) {
	if b.quiet.Load() {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	t := &b.target
	wasDown := t.down
	if c := b.topics[topic]; c != nil {
		b.up(c, now)
	}
	b.up(t, now)
	b.settle()
	if wasDown {
		b.wake() // claims were paused
	}
}

// failed reports a failed publish of record id of topic. It returns whether
// the topic (or the target) is down now, and then when the record is due
// again: its failure is not the record's, which is given back untried.
func (b *breaker) failed(topic string, id int64, class errorClass, now time.Time) (down bool, retryAt time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	c := b.topics[topic]
	if c == nil {
		c = &circuit{topic: topic}
		b.topics[topic] = c
	}
	t := &b.target
	probe := t.probing && t.probeID == id
	if class == classPermanent {
		// The message is bad; nothing is said about the target. A probe
		// that found it hands over to the next record at once.
		if c.probing && c.probeID == id {
			c.probing = false
		}
		if probe {
			t.probing = false
		}
	} else {
		if c.probing && c.probeID == id {
			b.probeFailed(c, now)
		}
		if probe {
			b.probeFailed(t, now)
		}
		if !t.down { // the target's outage explains the topic's failures
			b.fail(c, topic, id, class, now)
			b.fail(t, topic, id, class, now)
		}
	}
	b.settle()
	if probe {
		b.wake() // claims wait for the probe's end: the dispatcher looks again
	}
	switch {
	case t.down:
		return true, b.retryAt(t, now)
	case c.down:
		return true, b.retryAt(c, now)
	}
	return false, time.Time{}
}

// settle drops the clear topic circuits, and lets publishes skip the lock
// when every circuit is clear.
func (b *breaker) settle() {
	for k, c := range b.topics {
		if c.clear() {
			delete(b.topics, k)
		}
	}
	if b.target.clear() && len(b.topics) == 0 {
		b.quiet.Store(true)
	}
}

func (b *breaker) probeFailed(c *circuit, now time.Time) {
	if !c.probing {
		return
	}
	c.probing = false
	c.delay = min(2*c.delay, b.probeMax)
	c.probeAt = now.Add(c.delay)
}

// fail counts a failure of record id of topic toward c, and trips it.
func (b *breaker) fail(c *circuit, topic string, id int64, class errorClass, now time.Time) {
	b.quiet.Store(false)
	if c.down {
		return
	}
	c.fails++
	if c.fails == 1 {
		c.firstID, c.firstTopic, c.spread = id, topic, false
	} else if c.topic == "" && topic != c.firstTopic || c.topic != "" && id != c.firstID {
		c.spread = true
	}
	if c.fails < b.threshold {
		return
	}
	if !c.spread && (c.topic == "" || class != classUnavailable) {
		return
	}
	c.down, c.since, c.delay = true, now, b.probeMin
	c.probeAt = now.Add(c.delay)
	c.probing, c.probeClaim, c.waited = false, time.Time{}, nil
	c.wait(id)
	b.logger.Error("Publish target down: records are given back untried and one record probes it", ErrOutage, watermill.LogFields{
		"topic": c.label(), "failures_in_a_row": c.fails, "probe_interval": c.delay,
	})
}

// up clears c after a successful publish, and logs the end of its outage.
func (b *breaker) up(c *circuit, now time.Time) {
	if c.down {
		b.logger.Info("Publish target up again", watermill.LogFields{
			"topic": c.label(), "outage": now.Sub(c.since), "records_waited": len(c.waited),
		})
	}
	topic := c.topic
	*c = circuit{topic: topic}
}

func (c *circuit) label() string {
	if c.topic == "" {
		return "(all topics)"
	}
	return c.topic
}

// claimHold tells the dispatcher when it may claim while the target is down,
// and how many records: zero time and 0 when the target is not down (claim
// as usual); else the earliest next claim, and 1 (a probe) when that is now.
func (b *breaker) claimHold(now time.Time) (until time.Time, probe bool) {
	if b.quiet.Load() {
		return time.Time{}, false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	t := &b.target
	switch {
	case !t.down:
		return time.Time{}, false
	case t.probing && now.Sub(t.probeStart) < b.staleProbe:
		// The probe's result wakes the dispatcher; this is a fallback.
		return now.Add(t.delay), false
	case !t.probeClaim.IsZero() && now.Before(t.probeClaim.Add(t.delay)):
		// The probe claim found nothing to probe with, or its record is
		// still on the way to a lane.
		return t.probeClaim.Add(t.delay), false
	case now.Before(t.probeAt):
		return t.probeAt, false
	}
	t.probeClaim = now
	return time.Time{}, true
}

// outages returns what is down now, the whole target first. A circuit
// whose probe is overdue by four ProbeIntervalMax (and a Lease) had no
// record to probe with (other forwarders took them, or the table ran dry):
// it is not reported, since nothing says it is still down.
func (b *breaker) outages() []Outage {
	if b.quiet.Load() {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	stale := max(4*b.probeMax, b.staleProbe)
	reported := func(c *circuit) bool {
		return c.down && (c.probing || now.Before(c.probeAt.Add(stale)))
	}
	var out []Outage
	for _, c := range b.topics {
		if reported(c) {
			out = append(out, c.outage())
		}
	}
	slices.SortFunc(out, func(a, b Outage) int { return strings.Compare(a.Topic, b.Topic) })
	if reported(&b.target) {
		out = slices.Insert(out, 0, b.target.outage())
	}
	return out
}

func (c *circuit) outage() Outage {
	return Outage{Topic: c.topic, Since: c.since, Waiting: len(c.waited), NextProbe: c.probeAt}
}

// Outages returns the target, and the topics of it, that the forwarder
// treats as down right now (see the README, "Outages"); nil when none is.
// The whole target, if down, comes first with an empty Topic.
func (f *Forwarder) Outages() []Outage { return f.brk.outages() }

// Healthy returns nil unless the target or a topic of it is down, for a
// readiness or health endpoint; the error wraps ErrOutage and names what is
// down and since when.
func (f *Forwarder) Healthy() error {
	out := f.Outages()
	if len(out) == 0 {
		return nil
	}
	parts := make([]string, len(out))
	for i, o := range out {
		what := "the whole target"
		if o.Topic != "" {
			what = fmt.Sprintf("topic %q", o.Topic)
		}
		parts[i] = fmt.Sprintf("%s since %s (%d records waiting)", what, o.Since.UTC().Format(time.RFC3339), o.Waiting)
	}
	return fmt.Errorf("%w: %s", ErrOutage, strings.Join(parts, "; "))
}

// outageHold is the dispatcher's hook before a claim that is due: 0 to claim
// now (one record only if it is the target's probe, see probeClaim), else
// how long to wait while the whole target is down. RunOnce then claims
// nothing.
func (s *session) outageHold() time.Duration {
	now := time.Now()
	until, probe := s.f.brk.claimHold(now)
	if probe {
		s.probeClaim = true
		return 0
	}
	if until.IsZero() {
		return 0
	}
	if s.once {
		s.claims++ // this call's claim is skipped: the target is down
	}
	return max(until.Sub(now), time.Millisecond)
}

// heldByOutage is why records are given back untried while their topic or
// the target is down.
const heldByOutage = "publish target down"

// outage is fail's hook: it reports the failed publish of g.records[i] to
// the breaker and, when the failure is not the record's (its topic or the
// target is down, or the error says the target is unavailable), gives the
// record and the rest of its group back untried, charged nothing, and
// reports true. A permanent error is the record's: false.
func (s *session) outage(g *group, i int, err error) bool {
	rec := &g.records[i]
	now := time.Now()
	class := classify(err)
	down, retryAt := s.f.brk.failed(rec.Topic, rec.ID, class, now)
	switch {
	case class == classPermanent:
		return false
	case down:
	case class == classUnavailable:
		retryAt = now.Add(s.cfg.Backoff.Delay(rec.Attempts))
	default:
		return false
	}
	s.releaseRest(g, i, retryAt, heldByOutage)
	return true
}
