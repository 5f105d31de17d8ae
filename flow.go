package txoutbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/txoutbox/txoutbox/storage"
)

// How the forwarder's work flows (one session per Run or RunOnce call):
//
//   - The dispatcher (the goroutine that called Run) owns the in-flight state:
//     the claimed batches, the keys a lane is working on with the groups
//     queued behind them, the ready groups, the count of unsettled records.
//     Every other goroutine reports to it through the events channel.
//   - Claims and lease extensions run one at a time on their own goroutine.
//   - Lanes (up to Concurrency) pull ready groups and publish each one's
//     records in order; a group of a key already in a lane waits behind it.
//   - The completer acks published records: from the first that arrives it
//     gathers for up to ackWindow or a batch, or until every claimed record
//     is published or settled, or half of MaxInFlight once ackSplit (and
//     the time the last ack took) has passed while the publishes wait on the
//     target (publishWaits), and acks them all in one call;
//     while an ack is in flight the next ones accumulate.
//   - A ticker every Lease/extendDivisor renews the leases of the records
//     still held; a lane publishes a record only if the publish can finish
//     (PublishTimeout) before the lease it knows of runs out.

// extendDivisor: the lease renewal ticks every Lease/extendDivisor.
const extendDivisor = 5

// batch is the records of one claim.
type batch struct {
	// deadline is when the lease runs out, in unix nanoseconds, counted from
	// the start of the claim or of the last extension that kept it.
	deadline  atomic.Int64
	groups    []*group
	unsettled int // dispatcher-owned
}

// group is the records of one key in one claim (or one keyless record).
type group struct {
	b       *batch
	key     string
	records []storage.Record
	// next: records before it were tried or settled by a lane; the ones from
	// it on are untried, so one missing from an extension was lost.
	next atomic.Int64
	// lost is set when an extension no longer found an untried record leased
	// to this forwarder, or a claim returned one of its records again: the
	// lane stops the group at once.
	lost atomic.Bool
	// gone holds the ids of its records a later claim of this session
	// returned again (their lease here ran out): they belong to the group of
	// that claim, and this one neither publishes nor writes back for them.
	// Set by the dispatcher only (copy on write); nil almost always.
	gone atomic.Pointer[map[int64]bool]
	// local counts the records a lane settled itself (nack, release,
	// dead-letter); read by the dispatcher once the group is finished.
	local atomic.Int64

	acked    int  // dispatcher-owned: records acked by the completer
	finished bool // dispatcher-owned: no lane works on it any more
}

func (g *group) settled() bool {
	return g.finished && g.acked+int(g.local.Load()) == len(g.records)
}

// isGone reports whether a later claim took the record with this id from
// the group (see gone).
func (g *group) isGone(id int64) bool {
	m := g.gone.Load()
	return m != nil && (*m)[id]
}

// own returns the records of recs the group still holds: all of them unless
// a later claim took some (see gone).
func (g *group) own(recs []storage.Record) []storage.Record {
	if g.gone.Load() == nil {
		return recs
	}
	out := make([]storage.Record, 0, len(recs))
	for i := range recs {
		if !g.isGone(recs[i].ID) {
			out = append(out, recs[i])
		}
	}
	return out
}

type eventKind uint8

const (
	evClaimed  eventKind = iota + 1 // a claim returned
	evFinished                      // a lane is done with a group
	evAcked                         // the completer wrote an ack
	evExtended                      // an extension returned
)

type event struct {
	kind    eventKind
	g       *group
	acked   []*group // evAcked: the group of each acked record
	records []storage.Record
	// drained (evClaimed): the storage reported that the claim left nothing
	// claimable out (storage.DrainClaimer).
	drained bool
	started time.Time
	err     error
	ext     *extension
}

// extension is one Extend call: what was asked, and what came back.
type extension struct {
	started  time.Time
	groups   []*group
	batches  []*batch
	refs     []storage.ClaimRef
	extended []int64
	err      error
}

type ackItem struct {
	rec  *storage.Record
	g    *group
	took time.Duration // how long its publish took
}

// session is one Run or RunOnce.
type session struct {
	f          *Forwarder
	cfg        *ForwarderConfig
	once       bool
	stop       context.Context // cancelled: claim nothing, start no publish
	publishCtx context.Context // cancelled: abandon in-flight publishes

	events chan event
	work   chan *group
	acks   chan ackItem

	lanes         sync.WaitGroup
	completerDone chan struct{}

	// extDone is closed, and replaced, each time an extension returns: lanes
	// whose lease runs short wait on it.
	extMu   sync.Mutex
	extDone chan struct{}

	// unreported counts the claimed records neither taken by the completer
	// nor settled by a lane: at zero, no more acks are coming for now.
	unreported atomic.Int64

	mu     sync.Mutex
	result RunOnceResult
	err    error // RunOnce: the claim's or an ack's error

	// Dispatcher-owned.
	// held maps the id of every record claimed and not settled to its
	// group: a claim that returns one again (its lease ran out here and this
	// forwarder claimed it anew) takes it from the older group (see gone).
	held      map[int64]*group
	keys      map[string][]*group // keys in a lane, with the groups queued behind
	ready     []*group
	batches   []*batch // claimed and not yet settled (a settled one is dropped at once)
	inFlight  int      // records claimed and not settled
	running   int      // groups handed to a lane and not finished
	nLanes    int
	claiming  bool
	extending bool
	claims    int
	claimAt   time.Time
	// settleFloor: a settling group brings the next claim forward, but not
	// before settleFloor (PollMin after the last empty claim, unless the
	// claim before it found records).
	settleFloor time.Time
	// emptySince: when the first of the empty claims in a row started;
	// zero after a claim that found records, and before the first claim.
	emptySince time.Time
	poll       time.Duration
	stopping   bool
	throttled  bool // claims paused for abandoned publishes (logged once)
	// probeClaim: the next claim takes one record, to probe a target
	// that is down (see outageHold).
	probeClaim bool
	// wokenDuringClaim: Wake was called while a claim was in flight.
	wokenDuringClaim bool
	// paced: the next claim is paced (see claimed); only a group of more
	// than one record settling brings it forward.
	paced bool
	// busySettledDuringClaim: a group of more than one record settled while
	// a claim was in flight, which may have read the table before the
	// group's ack set its key free: that claim is not paced.
	busySettledDuringClaim bool
}

func (f *Forwarder) newSession(ctx context.Context, once bool) (*session, context.CancelFunc) {
	s := &session{
		f:             f,
		cfg:           &f.config,
		once:          once,
		stop:          ctx,
		events:        make(chan event, 64),
		work:          make(chan *group, f.config.Concurrency),
		acks:          make(chan ackItem, f.config.MaxInFlight),
		completerDone: make(chan struct{}),
		keys:          make(map[string][]*group),
		held:          make(map[int64]*group),
		extDone:       make(chan struct{}),
		poll:          f.config.PollMin,
	}
	// Publishes outlive ctx by ShutdownTimeout so that a graceful stop lets
	// them finish; write-backs outlive it by BookkeepingTimeout.
	var hardCancel context.CancelFunc
	s.publishCtx, hardCancel = context.WithCancel(context.WithoutCancel(ctx))
	stopGrace := context.AfterFunc(ctx, func() {
		t := time.AfterFunc(f.config.ShutdownTimeout, hardCancel)
		context.AfterFunc(s.publishCtx, func() { t.Stop() })
	})
	return s, func() { stopGrace(); hardCancel() }
}

// run is the dispatcher loop; it returns once nothing is in flight and no
// more claims are to be made, with lanes and completer ended.
func (s *session) run() {
	go s.complete()
	defer func() {
		close(s.work)
		s.lanes.Wait()
		close(s.acks)
		<-s.completerDone
	}()

	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	tick := time.NewTicker(s.cfg.Lease / extendDivisor)
	defer tick.Stop()
	stopC := s.stop.Done()
	var wake <-chan struct{}
	if !s.once {
		wake = s.f.wake
	}

	for {
		var timerC <-chan time.Time
		if s.mayClaim() {
			d := time.Until(s.claimAt)
			if d <= 0 {
				d = s.outageHold()
			}
			if d <= 0 {
				s.startClaim()
			} else {
				timer.Reset(d)
				timerC = timer.C
			}
		}
		if s.finished() {
			return
		}
		// Lanes start as work needs them, up to Concurrency.
		for s.nLanes < s.cfg.Concurrency && s.running+len(s.ready) > s.nLanes {
			s.nLanes++
			s.lanes.Go(s.supervise)
		}
		var work chan *group
		var next *group
		if len(s.ready) > 0 {
			work, next = s.work, s.ready[0]
		}
		select {
		case work <- next:
			s.ready[0] = nil
			s.ready = s.ready[1:]
			s.running++
			s.dispatch()
		case ev := <-s.events:
			s.handle(ev)
			// Whatever else is queued is handled in the same turn of the
			// loop: one wake-up for a burst of finished groups and acks.
			for range cap(s.events) {
				select {
				case ev := <-s.events:
					s.handle(ev)
					continue
				default:
				}
				break
			}
			s.dispatch()
		case <-timerC:
		case <-wake:
			s.poll = s.cfg.PollMin
			s.claimAt = time.Time{}
			// A claim in flight may have read the table before what woke us
			// was committed: its empty answer must not put the wake-up off.
			s.wokenDuringClaim = s.claiming
		case <-tick.C:
			s.extend()
		case <-stopC:
			stopC = nil
			s.stopping = true
			s.releaseWaiting()
		}
	}
}

// dispatch hands ready groups to the lanes while the work channel has room.
func (s *session) dispatch() {
	for len(s.ready) > 0 && s.running < s.nLanes+cap(s.work) {
		select {
		case s.work <- s.ready[0]:
			s.ready[0] = nil
			s.ready = s.ready[1:]
			s.running++
		default:
			return
		}
	}
}

// finished reports whether the session is over.
func (s *session) finished() bool {
	over := s.stopping || (s.once && s.claims > 0)
	return over && !s.claiming && !s.extending && s.inFlight == 0 && s.running == 0 && len(s.ready) == 0
}

// mayClaim reports whether a claim may start (now or at claimAt): none in
// flight, room for half a batch (or nothing in flight), and not too many
// abandoned publishes.
func (s *session) mayClaim() bool {
	if s.stopping || s.claiming || (s.once && s.claims > 0) {
		return false
	}
	if n := s.f.abandoned.Load(); n >= int64(s.cfg.MaxAbandonedPublishes) {
		if s.once {
			// RunOnce makes one claim: refused, it is over, rather than
			// waiting as long as the target holds the abandoned publishes.
			err := fmt.Errorf("%w: %d of MaxAbandonedPublishes %d; claimed nothing", ErrTooManyAbandoned, n, s.cfg.MaxAbandonedPublishes)
			s.f.logger.Error("Too many publishes abandoned in the target; RunOnce claims nothing", err, nil)
			s.setErr(err)
			s.stopping = true
			return false
		}
		if !s.throttled {
			s.throttled = true
			s.f.logger.Error("Too many publishes abandoned in the target; claiming nothing until they end", ErrPublishTimeout, watermill.LogFields{
				"abandoned": n, "max_abandoned_publishes": s.cfg.MaxAbandonedPublishes,
			})
		}
		return false
	}
	if s.throttled {
		s.throttled = false
		s.f.logger.Info("Abandoned publishes ended; claiming again", nil)
	}
	room := s.cfg.MaxInFlight - s.inFlight
	return s.inFlight == 0 || room*2 >= min(s.cfg.BatchSize, s.cfg.MaxInFlight)
}

func (s *session) startClaim() {
	s.claiming = true
	s.claims++
	n := min(s.cfg.BatchSize, s.cfg.MaxInFlight-s.inFlight)
	if s.probeClaim {
		n, s.probeClaim = 1, false // the target is down: one record probes it
	}
	go func() {
		started := time.Now()
		// The claim is not cancelled with the stop context: a claim cancelled on
		// the wire may have committed its leases, which nobody would then release.
		ctx, cancel := s.f.bookkeepingCtx(s.stop)
		p := storage.ClaimParams{BatchSize: n, Lease: s.cfg.Lease, WorkerID: s.cfg.WorkerID}
		var recs []storage.Record
		var drained bool
		var err error
		if s.f.drainer != nil {
			recs, drained, err = s.f.drainer.ClaimDrained(ctx, p)
		} else {
			recs, err = s.f.store.Claim(ctx, p)
		}
		cancel()
		s.events <- event{kind: evClaimed, records: recs, drained: drained, err: err, started: started}
	}()
}

func (s *session) handle(ev event) {
	switch ev.kind {
	case evClaimed:
		s.claimed(ev)
	case evFinished:
		g := ev.g
		s.running--
		g.finished = true
		s.settle(g, int(g.local.Load()))
		s.freeKey(g.key)
	case evAcked:
		for _, g := range ev.acked {
			g.acked++
			s.settle(g, 1)
		}
	case evExtended:
		s.extended(ev.ext)
	}
}

// quietPolls: the idle sleep grows by PollFactor only once claims have
// found nothing for this many PollMin (from the start of the first empty
// claim in a row); until then a claim that finds nothing sleeps PollMin.
// Producers that write flat out commit in bunches (they wait for the same
// WAL flush), and the lulls between bunches are a few milliseconds: with
// the sleep doubled from the second empty claim in a row, one forwarder at
// batch 1000 and PollMin 10 ms slept 20 ms now and then in a stream of 16k
// messages a second, and the few hundred records committed meanwhile set its
// p99 lag (docs/benchmarks.md, "A lull in a stream no longer doubles the
// idle sleep"). An idle table costs four or five more claims after its last
// record, and so does a Run that starts on one.
const quietPolls = 4

func (s *session) claimed(ev event) {
	s.claiming = false
	s.paced = false
	busy := s.busySettledDuringClaim
	s.busySettledDuringClaim = false
	now := time.Now()
	if ev.err != nil {
		err := fmt.Errorf("claim outbox records: %w", ev.err)
		s.claimAt = now.Add(s.cfg.StorageErrorDelay)
		// Groups settling meanwhile must not bring the next claim before
		// the delay: with the database down, each would be a failed claim.
		s.settleFloor = s.claimAt
		if s.once {
			s.setErr(err)
		} else {
			s.f.logger.Error("Claim failed; waiting before the next one", err, watermill.LogFields{"delay": s.cfg.StorageErrorDelay})
		}
		return
	}
	woken := s.wokenDuringClaim
	s.wokenDuringClaim = false
	if len(ev.records) == 0 && woken {
		s.poll = s.cfg.PollMin
		s.claimAt = time.Time{}
		return
	}
	if len(ev.records) == 0 {
		s.claimAt = now.Add(s.poll)
		s.settleFloor = now.Add(s.cfg.PollMin)
		if s.emptySince.IsZero() {
			// The first empty claim after one that found records: records
			// are still coming, most likely, and a group settling brings
			// the next claim forward at once rather than PollMin later.
			// Once only: from the next empty claim on, the table is
			// idle and settles wait for PollMin (see settle).
			s.settleFloor = now
			s.emptySince = ev.started
		}
		if now.Sub(s.emptySince) >= quietPolls*s.cfg.PollMin {
			s.poll = min(time.Duration(float64(s.poll)*s.cfg.PollFactor), s.cfg.PollMax)
		}
		return
	}
	s.emptySince = time.Time{}
	s.poll = s.cfg.PollMin
	s.claimAt = time.Time{}
	if ev.drained && !woken && !busy {
		// The claim took all there was (the storage says so): the
		// forwarder has caught up with its stream. The next claim comes
		// PollMin/2 after this one started, not at once; a wake brings it
		// at once (one during this claim too), and so does a group of more
		// than one record settling (see settle), during this claim too.
		// Claimed back to back, a caught-up forwarder took a few records a
		// claim, one claim in ten found none and slept PollMin, and every
		// claim costs the database about what a batch of a hundred rows
		// does, taken from the producers on a shared machine. Paced, each
		// claim takes what came meanwhile and seldom finds nothing: one
		// forwarder at batch 1000 and PollMin 10 ms, four producers writing
		// flat out, made 1,020 claims for 100,000 messages instead of
		// 2,286, and its p99 lag was lower in 8 of 10 alternated runs
		// (docs/benchmarks.md, "Paced claims land"). A claim the storage
		// does not report drained (a full batch; a storage without
		// storage.DrainClaimer; something held back) is followed at once:
		// there may be more.
		s.paced = true
		s.claimAt = ev.started.Add(s.cfg.PollMin / 2)
		s.settleFloor = s.claimAt
	}
	s.mu.Lock()
	s.result.Claimed += len(ev.records)
	s.mu.Unlock()

	b := &batch{unsettled: len(ev.records)}
	b.deadline.Store(ev.started.Add(s.cfg.Lease).UnixNano())
	s.inFlight += len(ev.records)
	s.unreported.Add(int64(len(ev.records)))
	s.batches = append(s.batches, b)
	groups := groupByKey(ev.records)
	if s.cfg.Concurrency > 1 {
		// Longest groups first: a key with many records publishes them one
		// after another, and started last it would finish long after the
		// rest. Groups are different keys, so their order is free; with one
		// lane the batch keeps id order.
		slices.SortStableFunc(groups, func(a, b []storage.Record) int { return len(b) - len(a) })
	}
	b.groups = make([]*group, len(groups))
	for i, recs := range groups {
		g := &group{b: b, records: recs, key: recs[0].Key}
		b.groups[i] = g
		for j := range recs {
			id := recs[j].ID
			if old, ok := s.held[id]; ok {
				s.takeOver(old, id)
			}
			s.held[id] = g
		}
		if g.key != "" {
			if q, busy := s.keys[g.key]; busy {
				// The key is in a lane: the new group waits behind it, never
				// beside it.
				s.keys[g.key] = append(q, g)
				continue
			}
			s.keys[g.key] = nil
		}
		s.ready = append(s.ready, g)
	}
	if s.stopping {
		s.releaseWaiting()
	}
}

// takeOver gives the record id of the older group old to the group of the
// claim that returned it again: its lease ran out here (a renewal failed, or
// a write-back or the group itself came too late) and this forwarder
// claimed it anew. The older group stops, publishes nothing more and writes
// nothing back for it: its write-backs would carry the older claim's
// attempts, which the storage fences out, and the new group holds the
// record now.
func (s *session) takeOver(old *group, id int64) {
	m := map[int64]bool{id: true}
	if prev := old.gone.Load(); prev != nil {
		for k := range *prev {
			m[k] = true
		}
	}
	old.gone.Store(&m)
	if !old.lost.Swap(true) {
		s.f.logger.Info("Record claimed again; the group of its older claim stops and leaves it to the new one", watermill.LogFields{
			"key": old.key, "outbox_id": id,
		})
	}
}

// settle counts n records of g as written back. n is 0 when a lane reports a
// group finished that it settled nothing of itself; the check for a settled
// group still runs, since the completer may have acked all of it first.
func (s *session) settle(g *group, n int) {
	s.inFlight -= n
	g.b.unsettled -= n
	if n > 0 && g.b.unsettled == 0 {
		// Forget the batch at once: its records (payloads included) are
		// garbage from here on, not at the next lease renewal.
		s.batches = slices.DeleteFunc(s.batches, func(b *batch) bool { return b.unsettled == 0 })
	}
	if !g.settled() {
		return
	}
	for i := range g.records {
		if id := g.records[i].ID; s.held[id] == g {
			delete(s.held, id)
		}
	}
	// A key is free again: what was held back behind it may be claimable.
	// From the second empty claim since the last one that found records
	// on, not before PollMin though (nor, after a failed claim, before
	// StorageErrorDelay): a stream of settling groups must not turn into a
	// stream of claims of an idle table. After the first, at once: with
	// producers writing flat out, nine in ten of the records whose lag made
	// the steady p99 had been claimed after such a PollMin wait
	// (docs/benchmarks.md, 2026-12-05 late evening). After a paced claim,
	// not before its time, unless the group had more than one record: its
	// key is busy, and more of its records are likely waiting behind it
	// (a hot key among a trickle of others would otherwise wait up to
	// PollMin/2 between its batches).
	floor := s.settleFloor
	if len(g.records) > 1 {
		if s.paced {
			floor = time.Time{}
		}
		if s.claiming {
			s.busySettledDuringClaim = true
		}
	}
	if s.claimAt.After(floor) {
		s.claimAt = floor
	}
}

// freeKey hands the next group queued behind key to the lanes.
func (s *session) freeKey(key string) {
	if key == "" {
		return
	}
	q := s.keys[key]
	if len(q) == 0 {
		delete(s.keys, key)
		return
	}
	s.ready = append(s.ready, q[0])
	q[0] = nil // the queue's array must not keep the group once it is settled
	s.keys[key] = q[1:]
}

// releaseWaiting gives back, in one call, every group no lane has started.
func (s *session) releaseWaiting() {
	waiting := s.ready
	s.ready = nil
	for key, q := range s.keys {
		waiting = append(waiting, q...)
		s.keys[key] = nil
	}
	if len(waiting) == 0 {
		return
	}
	var recs []storage.Record
	for _, g := range waiting {
		recs = append(recs, g.own(g.records)...)
		// Given back, not lost: an extension in flight will not find them.
		g.next.Store(int64(len(g.records)))
	}
	s.release(recs, time.Now(), "stopping")
	for _, g := range waiting {
		g.finished = true
		s.settleLocal(g, len(g.records))
		s.settle(g, len(g.records))
	}
}

// extend starts the renewal of the leases of records still held whose lease
// was not renewed during the last half tick.
func (s *session) extend() {
	// Extensions go on while stopping: publishes finishing within
	// ShutdownTimeout still need their lease for the ack.
	if s.extending || len(s.batches) == 0 {
		return
	}
	now := time.Now()
	horizon := now.Add(s.cfg.Lease - s.cfg.Lease/extendDivisor/2).UnixNano()
	x := &extension{started: now}
	for _, b := range s.batches {
		if b.deadline.Load() >= horizon {
			continue
		}
		x.batches = append(x.batches, b)
		for _, g := range b.groups {
			if g.settled() {
				continue
			}
			x.groups = append(x.groups, g)
			for i := range g.records {
				if !g.isGone(g.records[i].ID) {
					x.refs = append(x.refs, g.records[i].Ref())
				}
			}
		}
	}
	if len(x.refs) == 0 {
		return
	}
	s.extending = true
	go func() {
		ctx, cancel := s.f.bookkeepingCtx(s.stop)
		x.extended, x.err = s.f.store.Extend(ctx, storage.ExtendParams{Records: x.refs, WorkerID: s.cfg.WorkerID, Lease: s.cfg.Lease})
		cancel()
		s.events <- event{kind: evExtended, ext: x}
	}()
}

func (s *session) extended(x *extension) {
	s.extending = false
	defer func() {
		s.extMu.Lock()
		close(s.extDone)
		s.extDone = make(chan struct{})
		s.extMu.Unlock()
	}()
	if x.err != nil {
		// The lanes stop the groups whose lease runs short.
		s.f.logger.Error("Lease extension failed; groups stop before their lease runs out", x.err, watermill.LogFields{"records": len(x.refs)})
		return
	}
	kept := make(map[int64]struct{}, len(x.extended))
	for _, id := range x.extended {
		kept[id] = struct{}{}
	}
	for _, g := range x.groups {
		// Read next now, not when the extension started: a record published
		// and acked meanwhile is missing from the result without being lost,
		// while one still untried now was untried all along.
		for j := int(g.next.Load()); j < len(g.records); j++ {
			if _, ok := kept[g.records[j].ID]; !ok && !g.isGone(g.records[j].ID) {
				if !g.lost.Swap(true) {
					s.f.logger.Error("Lease lost: the group stops and leaves its records to their new holder", ErrLeaseLost, watermill.LogFields{
						"key": g.key, "outbox_id": g.records[j].ID,
					})
				}
				break
			}
		}
	}
	deadline := x.started.Add(s.cfg.Lease).UnixNano()
	for _, b := range x.batches {
		b.deadline.Store(deadline)
	}
}

// ackWindow is how long the completer gathers published records after the
// first one before it acks them in one statement, unless a batch's worth
// comes sooner or every record claimed has been published or settled (no
// more are coming until the next claim, which may wait for this ack).
// Acking whatever was queued at once made each ack a handful of records and
// each its own commit: with a no-op target, a drain at batch
// 1000 did half the messages per second on twice the database CPU per
// message.
const ackWindow = 10 * time.Millisecond

// ackSplit: a gathering that holds half of MaxInFlight and has lasted
// ackSplit, and longer than the last ack took, acks at once instead of
// waiting for the rest of the batch, when the lanes wait on the target (its
// publishes took publishWaits each or more on average). The records come
// at the speed of publishing then, and that ack brings the records in
// flight down to where the next claim may start (mayClaim), so the next
// claim runs while the rest are published rather than after them. It pays
// when the rest takes longer to come than an ack takes: with a database
// slower than the publishing, the batch is acked in one statement. One
// forwarder, 1 ms broker, Concurrency 128, batch 1000: about 30% more
// messages a second (see docs/benchmarks.md).
const ackSplit = time.Millisecond

// publishWaits: publishes that take less than this on average do not wait
// on a network round trip; they cost the forwarder's CPU, which an earlier
// claim would compete with, and the completer does not split an ack for
// them (see ackSplit). Splitting then only added work to the database: a
// strict claim of half a batch while the other half is in flight walks past
// the rows of the keys in flight and costs about what a whole batch costs.
// A no-op drain at batch 1000 fell into half-batch claims in some runs and
// not in others: 29k-37k messages a second against 39k-46k without the
// split (see docs/benchmarks.md).
const publishWaits = 100 * time.Microsecond

// complete is the completer: it acks published records in batches.
func (s *session) complete() {
	defer close(s.completerDone)
	var items []ackItem
	var ackTook time.Duration // how long the last ack took
	timer := time.NewTimer(ackWindow)
	timer.Stop()
	for it := range s.acks {
		items = append(items[:0], it)
		waited := it.took
		first := time.Now()
		more := s.unreported.Add(-1) > 0
		timer.Reset(ackWindow)
	gather:
		for more && len(items) < s.cfg.BatchSize {
			if s.splitAck(len(items), time.Since(first), ackTook, waited) {
				break
			}
			select {
			case it, ok := <-s.acks:
				if !ok {
					break gather
				}
				items = append(items, it)
				waited += it.took
				more = s.unreported.Add(-1) > 0
			case <-timer.C:
				break gather
			}
		}
		timer.Stop()
		started := time.Now()
		s.ack(items)
		ackTook = time.Since(started)
		clear(items) // keep no record of a settled batch alive
	}
}

// splitAck reports whether a gathering of n records acks at once (see
// ackSplit): it has lasted gathered, the last ack took ackTook, and the n
// publishes took waited in all.
func (s *session) splitAck(n int, gathered, ackTook, waited time.Duration) bool {
	return 2*n >= s.cfg.MaxInFlight && gathered >= max(ackSplit, ackTook) && waited >= time.Duration(n)*publishWaits
}

func (s *session) ack(items []ackItem) {
	f := s.f
	refs := make([]storage.ClaimRef, 0, len(items))
	groups := make([]*group, len(items))
	for i, it := range items {
		groups[i] = it.g
		// A record a later claim took from its group (see gone) is the new
		// group's to ack: the lease this publish had ran out.
		if !it.g.isGone(it.rec.ID) {
			refs = append(refs, it.rec.Ref())
		}
	}
	var err error
	if len(refs) > 0 {
		ctx, cancel := f.bookkeepingCtx(s.stop)
		err = f.store.Ack(ctx, storage.AckParams{Records: refs, WorkerID: s.cfg.WorkerID})
		cancel()
	}
	if err != nil {
		err = fmt.Errorf("ack %d published outbox records (they will be redelivered when their lease expires): %w", len(refs), err)
		if s.once {
			s.setErr(err)
		} else {
			f.logger.Error("Ack failed", err, nil)
		}
	} else {
		s.mu.Lock()
		s.result.Published += len(refs)
		s.mu.Unlock()
	}
	if f.config.OnOutcome != nil {
		for _, it := range items {
			o := Outcome{Kind: OutcomePublished, Record: it.rec, StorageErr: err}
			if it.g.isGone(it.rec.ID) {
				o.StorageErr = errClaimedAgain
			}
			f.config.OnOutcome(o)
		}
	}
	s.events <- event{kind: evAcked, acked: groups}
}

// errClaimedAgain is the StorageErr of a published record whose ack was not
// sent: its lease ran out before the ack, and this forwarder claimed it
// again, so it is published again.
var errClaimedAgain = fmt.Errorf("%w: the record was claimed again before its ack, which was not sent", ErrLeaseLost)

func (s *session) setErr(err error) {
	s.mu.Lock()
	if s.err == nil {
		s.err = err
	}
	s.mu.Unlock()
}

func (s *session) count(update func(*RunOnceResult)) {
	s.mu.Lock()
	update(&s.result)
	s.mu.Unlock()
}

// A lane publishes key groups one after another, pulling them from the
// dispatcher. Without a publish timeout it runs on the supervising goroutine.
// With one, it runs on its own goroutine and the supervisor watches the
// publish in flight: one that outruns PublishTimeout (the target may ignore
// the context: Sarama's sync producer and JetStream do) is abandoned with its
// lane, its outcome recorded as a timeout, and a fresh lane goes on with the
// rest of the group. The watch costs a mutex per publish and no goroutine or
// channel per message.
type lane struct {
	s *session

	mu        sync.Mutex
	busy      bool      // a publish is in flight
	started   time.Time // when it started
	g         *group
	pos       int  // index in g.records of the publish in flight
	abandoned bool // the supervisor gave up on this lane

	done chan struct{} // closed when work returns
	// first, from firstPos, is a group remainder to publish before pulling.
	first    *group
	firstPos int
}

// supervise runs lanes until the work channel closes, replacing abandoned ones.
func (s *session) supervise() { s.superviseFrom(nil, 0) }

// superviseFrom is supervise with a lane that first publishes g from index
// from on (g nil: none).
func (s *session) superviseFrom(g *group, from int) {
	timeout := s.cfg.PublishTimeout
	l := &lane{s: s, done: make(chan struct{}), first: g, firstPos: from}
	if timeout <= 0 {
		l.work()
		return
	}
	go l.work()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	hardC := s.publishCtx.Done()
	for {
		select {
		case <-l.done:
			return
		case <-timer.C:
		case <-hardC:
			hardC = nil
		}
		hard := s.publishCtx.Err() != nil
		l.mu.Lock()
		overdue := l.busy && time.Since(l.started) >= timeout
		if !overdue && !(hard && l.busy) {
			wait := timeout
			if l.busy {
				wait = timeout - time.Since(l.started)
			}
			l.mu.Unlock()
			timer.Reset(wait)
			continue
		}
		l.abandoned = true
		g, pos := l.g, l.pos
		l.mu.Unlock()
		s.f.abandon(l.done)

		err := fmt.Errorf("%w after %s", ErrPublishTimeout, timeout)
		if hard {
			err = ErrPublishAbandoned
		}
		next := &lane{s: s, done: make(chan struct{})}
		if s.fail(g, pos, err) && pos+1 < len(g.records) {
			next.first, next.firstPos = g, pos+1
		} else {
			s.finish(g)
		}
		l = next
		go l.work()
		timer.Reset(timeout)
	}
}

// abandon counts a lane left in a publish that outran its bound until the
// publish returns.
func (f *Forwarder) abandon(done <-chan struct{}) {
	f.abandoned.Add(1)
	f.aside.Add(1)
	go func() {
		<-done
		f.abandoned.Add(-1)
		f.aside.Done()
		f.Wake() // claims may have been paused for it
	}()
}

// work publishes groups until the work channel closes or the lane is abandoned.
func (l *lane) work() {
	defer close(l.done)
	exited := true
	defer func() {
		if exited {
			l.goexited()
		}
	}()
	l.loop()
	exited = false
}

// errGoexit is the recorded error of a publish that called runtime.Goexit.
var errGoexit = errors.New("publish called runtime.Goexit")

// goexited takes over from a lane whose publish called runtime.Goexit (a
// t.FailNow in a test double, say), which ends the goroutine however it is
// recovered: the publish failed, like one that panicked, and a new lane goes
// on with the rest of the group, then with other groups.
func (l *lane) goexited() {
	s := l.s
	l.mu.Lock()
	if l.abandoned {
		l.mu.Unlock()
		return // the supervisor took the publish over and replaced the lane
	}
	l.abandoned = true // the supervisor, seeing done closed, just returns
	busy, g, pos := l.busy, l.g, l.pos
	l.busy, l.g = false, nil
	l.mu.Unlock()
	s.f.logger.Error("Publish called runtime.Goexit; recorded as a failed publish", errGoexit, nil)
	if !busy {
		s.lanes.Go(s.supervise)
		return
	}
	if s.fail(g, pos, errGoexit) && pos+1 < len(g.records) {
		s.lanes.Go(func() { s.superviseFrom(g, pos+1) })
		return
	}
	s.finish(g)
	s.lanes.Go(s.supervise)
}

func (l *lane) loop() {
	if g := l.first; g != nil {
		l.first = nil // this lane goes on with other groups: keep none of this one
		if !l.publishGroup(g, l.firstPos) {
			return
		}
	}
	for g := range l.s.work {
		if !l.publishGroup(g, 0) {
			return
		}
	}
}

// awaitExtension waits for the next extension to return, and reports whether
// it did before deadline (or a stop).
func (s *session) awaitExtension(deadline time.Time) bool {
	s.extMu.Lock()
	ch := s.extDone
	s.extMu.Unlock()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-ch:
		return true
	case <-t.C:
	case <-s.stop.Done():
	}
	return false
}

func (s *session) finish(g *group) {
	s.events <- event{kind: evFinished, g: g}
}

// publishGroup publishes the records of one key in order, from index from on,
// and reports the group finished. It returns false if the lane was abandoned
// meanwhile (the supervisor then takes the group over).
func (l *lane) publishGroup(g *group, from int) bool {
	s, f := l.s, l.s.f
	timeout := s.cfg.PublishTimeout
	for i := from; i < len(g.records); i++ {
		rec := &g.records[i]
		if s.stop.Err() != nil {
			s.releaseRest(g, i, time.Now(), "stopping")
			break
		}
		if g.lost.Load() {
			// Not ours any more; the release is fenced and gives back what
			// still is.
			s.releaseRest(g, i, time.Now(), "lease lost")
			break
		}
		if rec.DecodeError != nil {
			g.next.Store(int64(i + 1))
			s.deadLetter(g, rec, fmt.Sprintf("undecodable record: %v", rec.DecodeError))
			if s.f.holdOnDead {
				s.releaseRest(g, i+1, time.Now(), heldByDead)
				break
			}
			continue
		}
		if rec.Attempts > s.cfg.MaxAttempts {
			// Claimed more often than allowed without an outcome recorded: the
			// process died while publishing it (maybe because of it).
			g.next.Store(int64(i + 1))
			s.deadLetter(g, rec, fmt.Sprintf("claimed %d times without a recorded outcome (MaxAttempts %d)", rec.Attempts, s.cfg.MaxAttempts))
			if s.f.holdOnDead {
				s.releaseRest(g, i+1, time.Now(), heldByDead)
				break
			}
			continue
		}
		now := time.Now()
		if deadline := time.Unix(0, g.b.deadline.Load()); !now.Add(max(timeout, 0)).Before(deadline) {
			// The publish could outlive the lease: another forwarder might
			// claim the record meanwhile. Wait for the next extension while
			// the lease lasts (a slow storage then slows the group down
			// instead of turning every group into a release), else give the
			// rest back untried.
			if now.Before(deadline) && s.awaitExtension(deadline) || s.stop.Err() != nil {
				i-- // check this record again (stopping: release the rest)
				continue
			}
			f.logger.Error("Lease runs out before the next publish could finish; the group's rest is released", ErrLeaseLost, watermill.LogFields{
				"key": g.key, "outbox_id": rec.ID, "lease_left": deadline.Sub(now), "publish_timeout": timeout,
			})
			s.releaseRest(g, i, now, "lease runs out")
			break
		}
		if f.abandoned.Load() >= int64(s.cfg.MaxAbandonedPublishes) {
			s.releaseRest(g, i, now, "too many abandoned publishes")
			break
		}
		if ok, retryAt := f.brk.admit(rec.Topic, rec.ID, now); !ok {
			s.releaseRest(g, i, retryAt, heldByOutage)
			break
		}
		l.mu.Lock()
		if l.abandoned {
			l.mu.Unlock()
			return false
		}
		l.busy, l.started, l.g, l.pos = true, now, g, i
		l.mu.Unlock()
		g.next.Store(int64(i + 1))

		err := f.publishOne(s.publishCtx, rec, now)
		took := time.Since(now)

		l.mu.Lock()
		abandoned := l.abandoned
		l.busy, l.g = false, nil
		l.mu.Unlock()
		if abandoned {
			return false // the supervisor recorded this record's outcome
		}
		if err == nil {
			f.brk.published(rec.Topic, now.Add(took))
			s.acks <- ackItem{rec: rec, g: g, took: took}
			continue
		}
		if !s.fail(g, i, err) {
			break
		}
	}
	s.finish(g)
	return true
}

// heldByDead is why the rest of a group is released after a dead-letter
// when the storage holds a key on dead-letter.
const heldByDead = "behind a dead-lettered record of the same key (the storage holds the key)"

// fail records the failed publish of g.records[i]: dead-letter when out of
// attempts (and report true: the rest of the group may go on, unless the
// storage holds the key on dead-letter: then the rest is released), else
// nack with backoff and release the rest of the group untried with the same
// retry time.
func (s *session) fail(g *group, i int, err error) bool {
	rec := &g.records[i]
	if s.outage(g, i, err) {
		return false
	}
	if rec.Attempts >= s.cfg.MaxAttempts || errors.Is(err, ErrPermanent) {
		s.deadLetter(g, rec, fmt.Sprintf("attempt %d of %d failed: %v", rec.Attempts, s.cfg.MaxAttempts, err))
		if s.f.holdOnDead {
			s.releaseRest(g, i+1, time.Now(), heldByDead)
			return false
		}
		return true
	}
	retryAt := time.Now().Add(s.cfg.Backoff.Delay(rec.Attempts))
	s.nack(g, rec, err, retryAt)
	// The rest of this key waits behind the failure, untried.
	s.releaseRest(g, i+1, retryAt, "behind a failed record of the same key")
	return false
}

// settleLocal counts n records of g as settled by a lane (nack, release,
// dead-letter) rather than by the completer.
func (s *session) settleLocal(g *group, n int) {
	g.local.Add(int64(n))
	s.unreported.Add(-int64(n))
}

// releaseRest releases g.records[from:], untried.
func (s *session) releaseRest(g *group, from int, retryAt time.Time, why string) {
	g.next.Store(int64(len(g.records)))
	rest := g.records[from:]
	if len(rest) == 0 {
		return
	}
	s.settleLocal(g, len(rest))
	s.release(g.own(rest), retryAt, why)
}
