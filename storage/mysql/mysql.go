package mysql

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/txoutbox/txoutbox/storage"
)

// TableDefault is the outbox table used when [Config.Table] is empty.
// Unqualified, it lives in the connection's current database.
const TableDefault = "outbox"

// WalkFactorDefault is [Config.WalkFactor] when it is 0.
const WalkFactorDefault = 1

// maxWalkFactor bounds [Config.WalkFactor], and how many batches of rows a
// claim walks in all when its walks find only rows to park.
const maxWalkFactor = 16

// maxIdentifierLen is MySQL's limit for database and table names.
const maxIdentifierLen = 64

// Config configures a [Storage]. The zero value is usable: table "outbox",
// strict ordering on, no visibility delay, delivered rows kept until purged.
type Config struct {
	// Table is the outbox table, optionally qualified with its database
	// ("app.outbox"). Each part must be a plain identifier: ASCII letters,
	// digits and underscores, not starting with a digit, at most 64 bytes.
	// Names are quoted with backticks. Defaults to [TableDefault].
	Table string

	// DisableStrictOrdering turns strict per-key ordering off. With it on (the
	// default) a record is held back while an earlier pending record with the
	// same key is not claimable. Off, claims take due rows in order and need no
	// per-key probes.
	DisableStrictOrdering bool

	// VisibilityDelay makes Claim take only records created at least this long
	// ago, so that a record whose id was taken by a long producer transaction
	// is not overtaken by later ids that committed first. The key locks
	// (DisableKeyLocks) make it unnecessary for keyed records; it remains for
	// keyless ones, and with DisableKeyLocks. Set it above your longest
	// producer transaction. Defaults to 0 (no delay); must not be negative.
	VisibilityDelay time.Duration

	// DeleteOnAck makes Ack delete delivered rows instead of marking them
	// delivered. It writes a little less per message, but delivered records
	// leave no trace: [Storage.Stats] reports Delivered as 0 and
	// [Storage.Purge] has nothing to delete. Dead-lettered rows are kept
	// either way. Defaults to false.
	DeleteOnAck bool

	// WalkFactor bounds how many candidate rows one strict claim looks at: at
	// most WalkFactor times the batch size. A larger factor finds more
	// claimable rows behind rows that must be parked, at the price of longer
	// claims, and of parking: with keys spread out, a claim of a batch that
	// walks twice the batch parks the rows it walked behind its heads and did
	// not take, and the acks set them free again, two writes per row that
	// a walk of one batch does not make (it takes them as the heads' followers).
	// A claim whose walk found only rows to park walks again, up to 16
	// batches in all, so that a backlog held back behind one key does not
	// make claims come back empty while other keys wait behind it.
	// Defaults to [WalkFactorDefault] (1: a drain of 1000 keys, batch 100 and
	// 1000, ran 25% to 60% faster than with 2); must be between 1 and 16.
	WalkFactor int

	// DisableKeyLocks turns off the lock Insert takes, in the producer's
	// transaction, on each key of its records (a row of [Storage.KeyTable],
	// written with INSERT ... ON DUPLICATE KEY UPDATE, in key order). With
	// the locks (the default with strict ordering), producers of one key
	// run their Insert one after another: the second waits until the first
	// commits or rolls back, and only then takes its ids, so the records of
	// a key commit in id order and a claim never sees a record before an
	// earlier one of its key. Producers of different keys do not wait for
	// each other. Without them, a transaction that took a smaller id and
	// commits after one that took a larger id has its record delivered
	// after the later one (see VisibilityDelay). Keyless records take no
	// lock, nor does anything without strict ordering. A producer that
	// inserts records of several keys in separate Insert calls, in
	// different orders in different transactions, can deadlock with another
	// (InnoDB rolls one back, error 1213); one Insert call locks its keys in
	// order.
	DisableKeyLocks bool

	// HoldOnDeadLetter makes a dead-lettered record hold back the later
	// records of its key until it is re-driven or skipped, so that a poison
	// message never breaks the order of its key. A record that failed before
	// is then claimed without the later records of its key, so that a
	// forwarder cannot publish them in the same batch after dead-lettering
	// it. Needs strict ordering. Defaults to false: a dead record lets its
	// key move on.
	HoldOnDeadLetter bool
}

func (c *Config) setDefaults() {
	c.Table = cmp.Or(c.Table, TableDefault)
	c.WalkFactor = cmp.Or(c.WalkFactor, WalkFactorDefault)
}

// Validate reports the first invalid field. Identifier errors wrap
// [storage.ErrInvalidIdentifier].
func (c Config) Validate() error {
	parts, err := parseTable(cmp.Or(c.Table, TableDefault))
	if err != nil {
		return fmt.Errorf("Config.Table: %w", err)
	}
	if name := parts[len(parts)-1]; len(name)+len(migrationsSuffix) > maxIdentifierLen {
		return fmt.Errorf("Config.Table: %w: %q is %d bytes, at most %d allowed (the version table appends %q)",
			storage.ErrInvalidIdentifier, name, len(name), maxIdentifierLen-len(migrationsSuffix), migrationsSuffix)
	}
	if c.HoldOnDeadLetter && c.DisableStrictOrdering {
		return errors.New("Config.HoldOnDeadLetter needs strict ordering (unset DisableStrictOrdering)")
	}
	if c.VisibilityDelay < 0 {
		return fmt.Errorf("Config.VisibilityDelay is %s: must be >= 0", c.VisibilityDelay)
	}
	if c.WalkFactor < 0 || c.WalkFactor > maxWalkFactor {
		return fmt.Errorf("Config.WalkFactor is %d: must be between 1 and %d (or 0 for the default, %d)", c.WalkFactor, maxWalkFactor, WalkFactorDefault)
	}
	return nil
}

// checkIdentifier accepts only plain identifiers, so that names coming from
// configuration can never change the meaning of a statement.
func checkIdentifier(name string) error {
	if name == "" {
		return fmt.Errorf("%w: empty name", storage.ErrInvalidIdentifier)
	}
	if len(name) > maxIdentifierLen {
		return fmt.Errorf("%w: %q is %d bytes, at most %d allowed", storage.ErrInvalidIdentifier, name, len(name), maxIdentifierLen)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		letter := c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
		digit := c >= '0' && c <= '9'
		if !letter && !(digit && i > 0) {
			return fmt.Errorf("%w: %q: use ASCII letters, digits and underscores, not starting with a digit", storage.ErrInvalidIdentifier, name)
		}
	}
	return nil
}

// parseTable splits "table" or "database.table" and validates each part.
func parseTable(name string) ([]string, error) {
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return nil, fmt.Errorf("%w: %q: expected table or database.table", storage.ErrInvalidIdentifier, name)
	}
	for _, p := range parts {
		if err := checkIdentifier(p); err != nil {
			return nil, err
		}
	}
	return parts, nil
}

// quoteIdent quotes validated identifier parts with backticks.
func quoteIdent(parts []string) string {
	q := make([]string, len(parts))
	for i, p := range parts {
		q[i] = "`" + p + "`"
	}
	return strings.Join(q, ".")
}

// Storage is the MySQL and MariaDB outbox storage over a database/sql pool
// opened with github.com/go-sql-driver/mysql. It implements
// [storage.Storage], [storage.Inserter], [storage.StatsReader],
// [storage.Maintainer], [storage.Operator], [storage.Migrator],
// [storage.Diagnoser] and [storage.DeadLetterHolder], and is safe for
// concurrent use.
type Storage struct {
	db     *sql.DB
	config Config
	table  string   // quoted for SQL
	parts  []string // [database,] table, unquoted
	hold   bool     // Config.HoldOnDeadLetter

	// deadlocks counts the deadlocks InnoDB reported to this storage (each
	// retried), claimDeadlocks those of claims, for the tests that prove
	// there are none.
	deadlocks, claimDeadlocks atomic.Int64

	// nextSweep is when the next claim sweeps parked rows (Unix
	// nanoseconds; 0: the first claim does).
	nextSweep atomic.Int64
}

var (
	_ storage.Storage     = (*Storage)(nil)
	_ storage.Inserter    = (*Storage)(nil)
	_ storage.StatsReader = (*Storage)(nil)
	_ storage.Maintainer  = (*Storage)(nil)

	_ storage.Operator         = (*Storage)(nil)
	_ storage.Migrator         = (*Storage)(nil)
	_ storage.Diagnoser        = (*Storage)(nil)
	_ storage.DeadLetterHolder = (*Storage)(nil)
)

// HoldOnDeadLetter implements [storage.DeadLetterHolder]: it reports
// [Config.HoldOnDeadLetter].
func (s *Storage) HoldOnDeadLetter() bool { return s.hold }

// New returns a storage over db, a pool opened with the "mysql" driver of
// github.com/go-sql-driver/mysql. It validates config and does not touch the
// database: create the table with [Storage.CreateSchema] or your migration
// tool ([Storage.SchemaSQL]).
func New(db *sql.DB, config Config) (*Storage, error) {
	if db == nil {
		return nil, errors.New("mysql: nil database (open one with sql.Open(\"mysql\", dsn))")
	}
	config.setDefaults()
	if err := config.Validate(); err != nil {
		return nil, fmt.Errorf("mysql: invalid config: %w", err)
	}
	parts, _ := parseTable(config.Table)
	return &Storage{db: db, config: config, table: quoteIdent(parts), parts: parts, hold: config.HoldOnDeadLetter}, nil
}

// Table returns the outbox table as quoted in SQL, for example `app`.`outbox`.
func (s *Storage) Table() string { return s.table }

// StrictOrdering reports whether claims hold back records behind an earlier
// unclaimable record of the same key.
func (s *Storage) StrictOrdering() bool { return !s.config.DisableStrictOrdering }

// MySQL error numbers the storage reacts to.
const (
	errDeadlock        = 1213 // ER_LOCK_DEADLOCK: the transaction was rolled back
	errLockWaitTimeout = 1205 // ER_LOCK_WAIT_TIMEOUT
	errNoSuchTable     = 1146 // ER_NO_SUCH_TABLE
)

// mysqlErrNumber returns the server's error number of err, 0 when err is not
// a server error.
func mysqlErrNumber(err error) uint16 {
	var me *mysql.MySQLError
	if errors.As(err, &me) {
		return me.Number
	}
	return 0
}

// retryable reports a deadlock: InnoDB rolled the whole transaction back, so
// running it again is safe.
func (s *Storage) retryable(err error) bool {
	if mysqlErrNumber(err) == errDeadlock {
		s.deadlocks.Add(1)
		return true
	}
	return false
}

// deadlockAttempts is how many times a transaction InnoDB rolled back as a
// deadlock victim is run in all.
const deadlockAttempts = 5

// inTx runs fn in a READ COMMITTED transaction (no gap locks on the range
// scans) and commits it. A transaction InnoDB chose as a deadlock victim
// (whole transaction rolled back) is run again after a short random pause,
// up to deadlockAttempts times in all.
func (s *Storage) inTx(ctx context.Context, fn func(tx *sql.Tx) error) error {
	var err error
	for attempt := 1; ; attempt++ {
		err = s.tryTx(ctx, fn)
		if attempt == deadlockAttempts || !s.retryable(err) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(time.Duration(rand.IntN(2000*attempt)) * time.Microsecond): //nolint:gosec // retry jitter is not a secret
		}
	}
}

func (s *Storage) tryTx(ctx context.Context, fn func(tx *sql.Tx) error) error {
	tx, err := s.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}
