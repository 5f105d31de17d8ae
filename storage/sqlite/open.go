package sqlite

import (
	"database/sql"
	"errors"
	"fmt"
	"strings"

	_ "modernc.org/sqlite" // registers the "sqlite" database/sql driver
)

// DriverName is the database/sql driver name registered by modernc.org/sqlite,
// the pure-Go (no cgo) SQLite this package is built on.
const DriverName = "sqlite"

// DSNParams are the driver parameters [Open] appends to the file name. Add
// them to your own data source name if you open the database yourself:
//
//   - busy_timeout(5000): SQLite allows one writer per file. Without a busy timeout a
//     second writer (another goroutine's connection, another process) fails at
//     once with SQLITE_BUSY ("database is locked"); with it, it waits up to
//     5 s for the lock.
//   - journal_mode(WAL): readers do not block the writer and the writer does
//     not block readers, and a commit is one append to the log. The mode is
//     stored in the file, so every process sharing it gets it.
//   - synchronous(NORMAL): in WAL mode a commit is not fsynced, only
//     checkpoints are. A power loss may lose the last commits, never corrupt
//     the file; an application crash loses nothing. This is the usual WAL
//     setting and many times faster than FULL.
//   - _txlock=immediate: database/sql's Begin sends BEGIN IMMEDIATE, so a
//     transaction takes the write lock at BEGIN, waiting under the busy
//     timeout. A deferred transaction that reads first and writes later fails
//     with SQLITE_BUSY, without waiting, when another connection committed in
//     between; producers that read before writing their outbox rows would
//     see that under load.
const DSNParams = "_pragma=busy_timeout(5000)&_pragma=journal_mode(WAL)&_pragma=synchronous(NORMAL)&_txlock=immediate"

// Open opens (creating it if needed) the SQLite database file at path with the
// settings an outbox shared by producers and forwarders needs: WAL journal
// mode, a 5 s busy timeout, synchronous=NORMAL and write transactions that take
// the write lock at BEGIN (see [DSNParams] for why each). Use the returned
// *sql.DB for your own transactions too, so producers get the same settings.
//
// path is a file name, not a URI; in-memory databases are refused because
// every pooled connection would get its own empty database.
func Open(path string) (*sql.DB, error) {
	if path == "" || path == ":memory:" || strings.HasPrefix(path, "file:") {
		return nil, fmt.Errorf("open sqlite database: path must be a file name, got %q", path)
	}
	db, err := sql.Open(DriverName, dsn(path))
	if err != nil {
		return nil, fmt.Errorf("open sqlite database %q: %w", path, err)
	}
	// One query opens a connection, which runs the pragmas: a bad path or a
	// file that is not a database fails here rather than at first use.
	var mode string
	if err := db.QueryRow("PRAGMA journal_mode").Scan(&mode); err != nil { //nolint:noctx // Open takes no context, like sql.Open; one local query on the file
		_ = db.Close()
		return nil, fmt.Errorf("open sqlite database %q: %w", path, err)
	}
	if !strings.EqualFold(mode, "wal") {
		_ = db.Close()
		return nil, fmt.Errorf("open sqlite database %q: journal_mode is %q, not wal (WAL needs a file on a local file system)", path, mode)
	}
	return db, nil
}

// dsn turns a file name into the driver's data source name: a file: URI, so
// a name holding '?' or '#' still names the file, followed by [DSNParams].
func dsn(path string) string {
	escaped := strings.NewReplacer("%", "%25", "?", "%3F", "#", "%23").Replace(path)
	if strings.HasPrefix(escaped, "//") {
		// "file://" would start a URI authority.
		escaped = "/" + strings.TrimLeft(escaped, "/")
	}
	return "file:" + escaped + "?" + DSNParams
}

// ErrDatabaseSettings is wrapped by the error of [New] for a database not
// opened with the settings an outbox shared by producers and forwarders
// needs ([DSNParams]): with a plain sql.Open, producers' transactions fail
// with SQLITE_BUSY while a forwarder runs.
var ErrDatabaseSettings = errors.New("sqlite database not opened with the outbox's settings")

// checkSettings reports, in one error, every setting of [DSNParams] that db
// lacks and that producers and forwarders sharing the file need: WAL, a
// busy timeout, and write transactions that take the write lock at BEGIN.
// Without them producers' transactions fail with SQLITE_BUSY while a
// forwarder runs.
//
// It takes no context, like [Open] and sql.Open: the BEGIN IMMEDIATE waits
// at most the busy timeout for another writer.
func checkSettings(db *sql.DB) error {
	var problems []string
	var mode string
	if err := db.QueryRow(`PRAGMA journal_mode`).Scan(&mode); err != nil { //nolint:noctx // see above
		return fmt.Errorf("read journal_mode: %w", err)
	}
	if !strings.EqualFold(mode, "wal") {
		problems = append(problems, fmt.Sprintf("journal_mode is %q, not wal (readers and the writer block each other)", mode))
	}
	var busy int
	if err := db.QueryRow(`PRAGMA busy_timeout`).Scan(&busy); err != nil { //nolint:noctx // see above
		return fmt.Errorf("read busy_timeout: %w", err)
	}
	if busy <= 0 {
		problems = append(problems, "busy_timeout is 0 (a second writer fails at once with SQLITE_BUSY)")
	}
	// A transaction that holds the write lock cannot checkpoint the WAL
	// (SQLITE_LOCKED); one begun with a plain BEGIN holds no lock before its
	// first statement and can (NOOP: nothing is written). A BEGIN that
	// waits for the lock, or is refused it, is a BEGIN IMMEDIATE too.
	if problems == nil {
		tx, err := db.Begin() //nolint:noctx // see above
		if err == nil {
			var busy, log, done int
			err = tx.QueryRow(`PRAGMA wal_checkpoint(NOOP)`).Scan(&busy, &log, &done) //nolint:noctx // see above
			_ = tx.Rollback()
			if err == nil {
				problems = append(problems, "transactions begin DEFERRED, not IMMEDIATE (a transaction that reads first fails with SQLITE_BUSY when another commits)")
			}
		}
	}
	if problems != nil {
		return fmt.Errorf("%w: %s: open it with sqlite.Open(path), or add sqlite.DSNParams to your data source name",
			ErrDatabaseSettings, strings.Join(problems, "; "))
	}
	return nil
}
