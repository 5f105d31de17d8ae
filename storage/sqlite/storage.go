package sqlite

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"regexp"
	"strings"
	"time"

	msqlite "modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/txoutbox/txoutbox/storage"
)

// TableDefault is the outbox table name used when [Config.Table] is empty.
const TableDefault = "outbox"

// Config configures a [Storage]. The zero value is ready to use.
type Config struct {
	// Table is the outbox table: a plain identifier (letters, digits and
	// underscores, not starting with a digit nor with "sqlite_"), at most 64
	// characters. Defaults to TableDefault.
	Table string

	// DisableStrictOrdering turns strict per-key ordering off: a record is then
	// claimable even while an earlier record with the same key waits for a
	// retry or is leased by another worker. Strict ordering is on by default.
	DisableStrictOrdering bool

	// VisibilityDelay only claims records at least this old (by created_at,
	// which never decreases in id order, so a record never shows while an
	// earlier one is hidden). With SQLite it is rarely needed: writers are
	// serialised, so id order is commit order. Defaults to 0; must be >= 0.
	VisibilityDelay time.Duration

	// HoldOnDeadLetter makes a dead-lettered record hold back the later
	// records of its key until it is re-driven or skipped (pg-boss calls
	// these blocked keys), so that a poison message never breaks the order
	// of its key. A record that failed before is then claimed without the
	// later records of its key, so that a forwarder cannot publish them in
	// the same batch after dead-lettering it. A record dead-lettered with it
	// holds its key for every storage on the table, also one without it,
	// until re-driven or skipped: turning it off releases no key already
	// held. Needs strict ordering. Defaults to false: a dead record lets its
	// key move on.
	HoldOnDeadLetter bool
}

func (c *Config) setDefaults() {
	c.Table = cmp.Or(c.Table, TableDefault)
}

var identifierRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,63}$`)

// Validate reports the first invalid field. Table is checked after defaults are
// applied, so an empty Table is valid.
func (c Config) Validate() error {
	c.setDefaults()
	if !identifierRE.MatchString(c.Table) || strings.HasPrefix(strings.ToLower(c.Table), "sqlite_") {
		return fmt.Errorf("Config.Table %q: %w (use letters, digits and underscores, at most 64, not starting with a digit or sqlite_)",
			c.Table, storage.ErrInvalidIdentifier)
	}
	if c.HoldOnDeadLetter && c.DisableStrictOrdering {
		return errors.New("Config.HoldOnDeadLetter needs strict ordering (unset DisableStrictOrdering)")
	}
	if c.VisibilityDelay < 0 {
		return fmt.Errorf("Config.VisibilityDelay must be >= 0, got %s", c.VisibilityDelay)
	}
	return nil
}

// Storage is the SQLite outbox storage. It implements [storage.Storage],
// [storage.Inserter], [storage.StatsReader], [storage.Maintainer],
// [storage.Operator], [storage.Migrator] and [storage.Diagnoser], and is
// safe for concurrent use, including by forwarders in other processes that
// share the database file.
type Storage struct {
	db              *sql.DB
	table           string // unquoted; valid identifier
	strict          bool
	hold            bool
	visibilityDelay time.Duration

	// now is the clock of every timestamp the storage writes and compares.
	// Tests replace it.
	now func() time.Time

	// writeSem serialises this Storage's own write transactions. SQLite takes
	// one writer at a time anyway; waiting here wakes the next writer as soon
	// as the lock is free, where waiting in SQLite's busy handler polls with
	// sleeps of up to 100 ms.
	writeSem chan struct{}

	probeSQL   string
	dueSQL     string
	claimSQL   string
	queueSQL   string
	alongSQL   string
	ackSQL     string
	nackSQL    string
	relSQL     string
	deadSQL    string
	extendSQL  string
	redriveSet string
}

var (
	_ storage.Storage     = (*Storage)(nil)
	_ storage.Inserter    = (*Storage)(nil)
	_ storage.StatsReader = (*Storage)(nil)
	_ storage.Maintainer  = (*Storage)(nil)
	_ storage.Operator    = (*Storage)(nil)
	_ storage.Migrator    = (*Storage)(nil)
	_ storage.Diagnoser   = (*Storage)(nil)

	_ storage.DeadLetterHolder = (*Storage)(nil)
)

// New returns a Storage over db, which must come from [Open] or carry the
// same settings ([DSNParams]): New refuses a database without WAL, a busy
// timeout or BEGIN IMMEDIATE, with an error that says what is missing
// (wrapping [ErrDatabaseSettings]). It does not create the table: call
// [Storage.Migrate] or run [Storage.Migrations] in your migration tool.
func New(db *sql.DB, config Config) (*Storage, error) {
	if db == nil {
		return nil, errors.New("new sqlite storage: db is nil (open one with sqlite.Open)")
	}
	config.setDefaults()
	if err := config.Validate(); err != nil {
		return nil, fmt.Errorf("new sqlite storage: %w", err)
	}
	if err := checkSettings(db); err != nil {
		return nil, fmt.Errorf("new sqlite storage: %w", err)
	}
	return newStorage(db, config), nil
}

// Migrations returns the schema steps for config's table, as
// [Storage.Migrations] does, without a database: for tools that print or
// export them.
func Migrations(config Config) ([]storage.Migration, error) {
	config.setDefaults()
	if err := config.Validate(); err != nil {
		return nil, fmt.Errorf("sqlite migrations: %w", err)
	}
	return newStorage(nil, config).Migrations(), nil
}

func newStorage(db *sql.DB, config Config) *Storage {
	config.setDefaults()
	s := &Storage{
		db:              db,
		table:           config.Table,
		strict:          !config.DisableStrictOrdering,
		hold:            config.HoldOnDeadLetter,
		visibilityDelay: config.VisibilityDelay,
		now:             time.Now,
		writeSem:        make(chan struct{}, 1),
	}
	s.buildSQL()
	return s
}

// Table returns the outbox table name.
func (s *Storage) Table() string { return s.table }

// StrictOrdering reports whether strict per-key ordering is on.
func (s *Storage) StrictOrdering() bool { return s.strict }

// HoldOnDeadLetter reports whether a dead record holds back its key.
func (s *Storage) HoldOnDeadLetter() bool { return s.hold }

// write runs fn, a write that has no effect when it fails, while holding this
// Storage's write semaphore, and runs it again while it fails because another
// connection holds the write lock.
//
// The busy timeout alone is not enough: SQLite's lock is not fair. A waiter
// sleeps in growing steps (up to 100 ms) between tries, and a connection that
// just released the lock usually takes it again before a sleeper wakes, so
// under load a waiter can starve past any timeout. Retrying until ctx is done
// makes the wait as long as the caller allows, like a row lock wait in a
// database server.
func (s *Storage) write(ctx context.Context, fn func(context.Context) error) error {
	select {
	case s.writeSem <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-s.writeSem }()
	for attempt := 0; ; attempt++ {
		err := fn(ctx)
		if !isBusy(err) {
			return err
		}
		// A pause only matters for a handle without a busy timeout, where
		// SQLITE_BUSY comes back at once.
		select {
		case <-ctx.Done():
			return err
		case <-time.After(min(time.Millisecond<<min(attempt, 5), 20*time.Millisecond)):
		}
	}
}

// isBusy reports whether err is SQLITE_BUSY or SQLITE_LOCKED (any extended
// code): another connection holds a lock the statement needed.
func isBusy(err error) bool {
	var e *msqlite.Error
	if !errors.As(err, &e) {
		return false
	}
	switch e.Code() & 0xff {
	case sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED:
		return true
	}
	return false
}

// quote quotes a validated identifier.
func quote(ident string) string { return `"` + ident + `"` }

var (
	minNanosTime = time.Unix(0, math.MinInt64+1)
	maxNanosTime = time.Unix(0, math.MaxInt64)
)

// nanos converts t to the stored form: Unix nanoseconds, 0 for the zero
// time, clamped to the range an int64 holds.
func nanos(t time.Time) int64 {
	switch {
	case t.IsZero():
		return 0
	case t.Before(minNanosTime):
		return math.MinInt64 + 1
	case t.After(maxNanosTime):
		return math.MaxInt64
	}
	return t.UnixNano()
}

// fromNanos is the inverse of nanos: 0 is the zero time.
func fromNanos(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}
