package postgres

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
)

// Reconnect backoff of [Storage.Listen].
const (
	ListenBackoffMin = 100 * time.Millisecond
	ListenBackoffMax = 5 * time.Second
)

// ListenApplicationName is the application_name of the listener's connection
// when the pool's configuration sets none, so operators can tell it apart in
// pg_stat_activity.
const ListenApplicationName = "txoutbox-listener"

// ErrNoNotifyChannel is returned by [Storage.Listen] when [Config.NotifyChannel]
// is empty.
var ErrNoNotifyChannel = errors.New("postgres: Config.NotifyChannel is empty: nothing to listen on")

// Listen blocks until ctx is done, calling wake on every notification of
// [Config.NotifyChannel] (after [Config.VisibilityDelay] when set); pass the
// forwarder's Wake. It takes one connection from the pool (so the pool's
// BeforeConnect and AfterConnect hooks apply) and keeps it outside the pool
// for good (it no longer counts towards MaxConns); when that connection drops,
// it reconnects by itself with a backoff from
// [ListenBackoffMin] doubling to [ListenBackoffMax]. It also calls wake after
// every (re)connect, so rows inserted while it was away are not left to the
// next poll. It returns nil when ctx is done, and no timer or goroutine it
// started outlives it.
func (s *Storage) Listen(ctx context.Context, wake func()) error {
	if s.config.NotifyChannel == "" {
		return ErrNoNotifyChannel
	}
	if wake == nil {
		return errors.New("postgres: Listen: nil wake func")
	}
	notify := wake
	if d := s.config.VisibilityDelay; d > 0 {
		dw := &delayedWake{delay: d, wake: wake}
		defer dw.stop()
		notify = dw.notify
	}
	log := s.config.Logger.With(watermill.LogFields{"channel": s.config.NotifyChannel, "table": s.table})
	backoff := ListenBackoffMin
	for {
		connected, err := s.listenOnce(ctx, log, wake, notify)
		if ctx.Err() != nil {
			return nil
		}
		if connected {
			backoff = ListenBackoffMin
		}
		log.Error("Outbox listener lost its connection, reconnecting", err, watermill.LogFields{"retry_in": backoff.String()})
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		backoff = min(backoff*2, ListenBackoffMax)
	}
}

// listenOnce runs one connection until it fails; connected reports whether
// LISTEN succeeded, which resets the backoff.
func (s *Storage) listenOnce(ctx context.Context, log watermill.LoggerAdapter, wake, notify func()) (connected bool, err error) {
	// The connection comes from the pool, through its own connect path
	// (BeforeConnect, AfterConnect: rotating passwords, IAM tokens), and is
	// then taken out of it for good: LISTEN needs a session of its own.
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return false, fmt.Errorf("connect: %w", err)
	}
	conn := pc.Hijack()
	if _, ok := s.pool.Config().ConnConfig.RuntimeParams["application_name"]; !ok {
		if _, err := conn.Exec(ctx, "SELECT set_config('application_name', $1, false)", ListenApplicationName); err != nil {
			_ = conn.Close(context.WithoutCancel(ctx))
			return false, fmt.Errorf("set application_name: %w", err)
		}
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{s.config.NotifyChannel}.Sanitize()); err != nil {
		return false, fmt.Errorf("listen: %w", err)
	}
	log.Info("Outbox listener connected", nil)
	wake()
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return true, fmt.Errorf("wait for notification: %w", err)
		}
		notify()
	}
}

// delayedWake calls wake delay after each notify, with at most one timer:
// notifications that arrive while it runs are covered by re-arming it for the
// latest one.
type delayedWake struct {
	delay time.Duration
	wake  func()

	mu      sync.Mutex
	timer   *time.Timer
	next    time.Time // the latest wake owed
	stopped bool
	running sync.WaitGroup
}

func (d *delayedWake) notify() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.stopped {
		return
	}
	d.next = time.Now().Add(d.delay)
	if d.timer == nil {
		d.timer = time.AfterFunc(d.delay, d.fire)
	}
}

func (d *delayedWake) fire() {
	d.mu.Lock()
	if d.stopped {
		d.mu.Unlock()
		return
	}
	d.running.Add(1)
	if rest := time.Until(d.next); rest > 0 {
		d.timer.Reset(rest)
	} else {
		d.timer = nil
	}
	d.mu.Unlock()
	defer d.running.Done()
	d.wake()
}

// stop cancels the owed wakes and waits for a running one.
func (d *delayedWake) stop() {
	d.mu.Lock()
	d.stopped = true
	if d.timer != nil {
		d.timer.Stop()
	}
	d.mu.Unlock()
	d.running.Wait()
}
