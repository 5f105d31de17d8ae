package postgres

import (
	"cmp"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox/storage"
)

// TableDefault is the outbox table used when [Config.Table] is empty. Unqualified,
// it resolves through the connection's search_path.
const TableDefault = "outbox"

// maxIdentifierLen is PostgreSQL's NAMEDATALEN-1: longer names are silently
// truncated by the server, so they are refused instead.
const maxIdentifierLen = 63

// Config configures a [Storage]. The zero value is usable: table "outbox",
// strict ordering on, no visibility delay, no LISTEN/NOTIFY.
type Config struct {
	// Table is the outbox table, optionally schema-qualified ("app.outbox").
	// Each part must be a plain identifier: ASCII letters, digits and
	// underscores, not starting with a digit, at most 63 bytes. Names are quoted,
	// so they are case-sensitive. Defaults to [TableDefault].
	Table string

	// DisableStrictOrdering turns strict per-key ordering off. With it on (the
	// default) a record is held back while an earlier pending record with the
	// same key is not claimable, and claims on one table are serialised by a
	// transaction-scoped advisory lock.
	DisableStrictOrdering bool

	// VisibilityDelay makes Claim take only records created at least this long
	// ago, so that a record whose id was taken by a long producer transaction is
	// not overtaken by later ids that committed first. Set it above your longest
	// producer transaction. Defaults to 0 (no delay); must not be negative.
	VisibilityDelay time.Duration

	// DeleteOnAck makes Ack only delete delivered rows, without recording
	// them in the delivered table ([Storage.DeliveredTable]). It writes less
	// per message (no row and index entry in the delivered table), so
	// forwarding is faster, but delivered records leave no trace at once:
	// [Storage.Stats] then reports Delivered as 0 and [Storage.Purge] has
	// nothing to delete. Dead-lettered rows are kept either way. Defaults to
	// false.
	DeleteOnAck bool

	// CommitFence makes Claim take only records whose producer transaction
	// can no longer be overtaken by an earlier one: records written by a
	// transaction older than every transaction still running in the
	// database (pg_snapshot_xmin of the current snapshot, the fence
	// watermill-sql v3 uses). Ids are taken at insert, not at commit, so
	// without it a record of a long producer transaction can commit after a
	// later record of its key was delivered; [Config.VisibilityDelay]
	// guesses a time bound, the fence needs none. With strict ordering a
	// fenced record also holds back the later records of its key. Its cost:
	// any long transaction in the database, producer or not (a report, a
	// migration, a session idle in transaction), holds delivery back until
	// it ends; [Storage.Stats] reports how many pending records the fence
	// holds back (Fenced, also the metrics middleware's
	// txoutbox_outbox_fenced). Needs schema version 3. Defaults to false.
	CommitFence bool

	// NotifyChannel, when set, makes [Storage.Migrate] create (when missing)
	// a trigger that sends a notification on this channel after every insert
	// statement, and enables [Storage.Listen]. Same rules as a Table part.
	// Defaults to "" (no trigger).
	//
	// The cost is the producers': PostgreSQL serialises notifying
	// transactions on a cluster-wide lock held until their commit is done,
	// so they no longer share a WAL flush. Measured on 2 cores (10-row
	// inserts): 17% fewer commits a second with one producer, 33-46% with
	// four to eight. It pays where commits are few and a forwarder would
	// otherwise sleep PollMin to PollMax between them; above a few hundred
	// commits a second a forwarder claims back to back anyway, and polling
	// with a short PollMin adds no lock to the producers' commits.
	NotifyChannel string

	// HoldOnDeadLetter makes a dead-lettered record hold back the later
	// records of its key until it is re-driven or skipped (pg-boss calls
	// these blocked keys), so that a poison message never breaks the order
	// of its key. A record that failed before is then claimed without the
	// later records of its key, so that a forwarder cannot publish them in
	// the same batch after dead-lettering it. Needs strict ordering. Each
	// claim then also reads the dead and failed keyed rows (two partial
	// indexes): keep the dead letters few (re-drive or skip them). Defaults
	// to false: a dead record lets its key move on.
	HoldOnDeadLetter bool

	// Logger receives the listener's connection events. Defaults to
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *Config) setDefaults() {
	c.Table = cmp.Or(c.Table, TableDefault)
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first invalid field. Identifier errors wrap
// [storage.ErrInvalidIdentifier].
func (c Config) Validate() error {
	table := cmp.Or(c.Table, TableDefault)
	if _, err := parseTable(table); err != nil {
		return fmt.Errorf("Config.Table: %w", err)
	}
	if c.NotifyChannel != "" {
		if err := checkIdentifier(c.NotifyChannel); err != nil {
			return fmt.Errorf("Config.NotifyChannel: %w", err)
		}
	}
	if c.HoldOnDeadLetter && c.DisableStrictOrdering {
		return errors.New("Config.HoldOnDeadLetter needs strict ordering (unset DisableStrictOrdering)")
	}
	if c.VisibilityDelay < 0 {
		return fmt.Errorf("Config.VisibilityDelay is %s: must be >= 0", c.VisibilityDelay)
	}
	return nil
}

// checkIdentifier accepts only plain SQL identifiers, so that names coming from
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

// parseTable splits "table" or "schema.table" and validates each part.
func parseTable(name string) (pgx.Identifier, error) {
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return nil, fmt.Errorf("%w: %q: expected table or schema.table", storage.ErrInvalidIdentifier, name)
	}
	for _, p := range parts {
		if err := checkIdentifier(p); err != nil {
			return nil, err
		}
	}
	return pgx.Identifier(parts), nil
}

// Storage is the PostgreSQL outbox storage over a pgx pool. It implements
// [storage.Storage], [storage.Inserter], [storage.StatsReader],
// [storage.Maintainer], [storage.Membership], [storage.Operator],
// [storage.Migrator], [storage.Diagnoser] and [storage.DeadLetterHolder],
// and is safe for concurrent use.
type Storage struct {
	pool   *pgxpool.Pool
	config Config

	ident     pgx.Identifier // table, as configured
	table     string         // table, quoted for SQL
	leases    string         // lease table, quoted for SQL
	workers   string         // worker table (slot sharing), quoted for SQL
	delivered string         // delivered table (one narrow row per acked record), quoted for SQL
	skipped   string         // skipped table (skipped records and their audit record), quoted for SQL

	q queries

	// nextSweep is when a claim next looks for parked rows that nothing
	// holds back (unix nanoseconds; see sweepEvery).
	nextSweep atomic.Int64
	// nothingHeld: the wake of the last claim found no row held, so the
	// next claim can be the lean one (strict ordering; see Claim). False at
	// first, and set false by this storage's nack, release, or dead-letter
	// with HoldOnDeadLetter, which may hold rows, so that the claim after
	// them is usually a full one (a claim running beside them may store its
	// older answer after them), and by a claim told to park behind records
	// in flight.
	nothingHeld atomic.Bool
	// walkedFar: the walk of the last claim spanned more than walkFar ids,
	// so the next claim is a full one that looks for rows behind records
	// in flight to park (strict ordering; see Claim).
	walkedFar atomic.Bool
	// parkFlightMin is parkFlightMin, which the tests lower to park behind
	// records in flight with a few rows.
	parkFlightMin int
}

var (
	_ storage.Storage     = (*Storage)(nil)
	_ storage.Inserter    = (*Storage)(nil)
	_ storage.StatsReader = (*Storage)(nil)
	_ storage.Maintainer  = (*Storage)(nil)
	_ storage.Membership  = (*Storage)(nil)
	_ storage.Operator    = (*Storage)(nil)
	_ storage.Migrator    = (*Storage)(nil)
	_ storage.Diagnoser   = (*Storage)(nil)

	_ storage.DeadLetterHolder = (*Storage)(nil)
)

// New returns a storage over pool. It validates config and does not touch the
// database: create the tables with [Storage.Migrate] or your migration tool
// ([Storage.Migrations], [Storage.SchemaSQL]).
func New(pool *pgxpool.Pool, config Config) (*Storage, error) {
	if pool == nil {
		return nil, errors.New("postgres: nil pool (create one with pgxpool.New)")
	}
	config.setDefaults()
	if err := config.Validate(); err != nil {
		return nil, fmt.Errorf("postgres: invalid config: %w", err)
	}
	ident, _ := parseTable(config.Table)
	s := &Storage{
		pool:   pool,
		config: config,
		ident:  ident,
		table:  ident.Sanitize(),

		parkFlightMin: parkFlightMin,
	}
	s.leases = siblingName(ident, "leases")
	s.workers = siblingName(ident, "workers")
	s.delivered = siblingName(ident, "delivered")
	s.skipped = siblingName(ident, "skipped")
	s.q = buildQueries(s.table, s.leases, s.workers, s.delivered, !config.DisableStrictOrdering, config.VisibilityDelay, config.DeleteOnAck,
		config.HoldOnDeadLetter, config.CommitFence, prepares(pool))
	return s, nil
}

// prepares reports whether pool prepares its statements (pgx's default exec
// mode, QueryExecModeCacheStatement): the claim then runs on their generic
// plans (see plan in buildQueries). It reads the pool's config when the
// storage is made: a mode changed later, or by a BeforeConnect hook, is not
// seen (the claim is then planned as PostgreSQL chooses, or forced generic
// where it is planned at every execution: slower, never wrong). A zero Pool,
// which has no config and serves only to render SQL (SchemaSQL), counts as
// one.
func prepares(pool *pgxpool.Pool) (yes bool) {
	defer func() {
		if recover() != nil {
			yes = true
		}
	}()
	return pool.Config().ConnConfig.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement
}

// Table returns the outbox table as quoted in SQL, for example "app"."outbox".
func (s *Storage) Table() string { return s.table }

// LeaseTable returns the table that holds the live leases, as quoted in SQL:
// the outbox table's name with the suffix "_leases", in the same schema (for
// example "app"."outbox_leases"). A forwarder's role needs SELECT, INSERT,
// UPDATE and DELETE on it.
func (s *Storage) LeaseTable() string { return s.leases }

// WorkerTable returns the table of the workers that are claiming, as quoted
// in SQL: the outbox table's name with the suffix "_workers", in the same
// schema. Claims with strict ordering share the key slots among these
// workers. A forwarder's role needs SELECT, INSERT, UPDATE and DELETE on it.
func (s *Storage) WorkerTable() string { return s.workers }

// DeliveredTable returns the table that records the delivered records, as
// quoted in SQL: the outbox table's name with the suffix "_delivered", in the
// same schema (for example "app"."outbox_delivered"). An ack deletes the
// outbox row and adds one narrow row here (id, uuid, topic, key, created_at,
// delivered_at, attempts, last_error; not the payload nor the metadata), which
// [Storage.Stats] counts and [Storage.Purge] deletes by age; with
// [Config.DeleteOnAck] it stays empty. A forwarder's role needs INSERT on it
// (and SELECT and DELETE to run Stats and Purge).
func (s *Storage) DeliveredTable() string { return s.delivered }

// StrictOrdering reports whether claims hold back records behind an earlier
// unclaimable record of the same key.
func (s *Storage) StrictOrdering() bool { return !s.config.DisableStrictOrdering }

// HoldOnDeadLetter implements [storage.DeadLetterHolder]: it reports
// [Config.HoldOnDeadLetter].
func (s *Storage) HoldOnDeadLetter() bool { return s.config.HoldOnDeadLetter }
