package sqlite

import (
	"time"

	"github.com/txoutbox/txoutbox/internal/sqlinbox"
	"github.com/txoutbox/txoutbox/storage"
)

// InboxTable returns the name of the inbox table of the inbox package: the
// outbox table's name with "_inbox" appended. Migrate creates it (schema
// step 5).
func (s *Storage) InboxTable() string { return s.table + "_inbox" }

// Inbox returns the inbox table on the storage's database, for the inbox
// package: handlers get a *sql.Tx. SQLite has one writer at a time, so a
// consumer's transaction waits for another's to end (up to the busy
// timeout, then it retries).
func (s *Storage) Inbox() storage.InboxStore {
	t := quote(s.InboxTable())
	return &sqlinbox.Store{DB: s.db,
		Insert: "INSERT INTO " + t + " (consumer, uuid, received_at) VALUES (?, ?, ?) ON CONFLICT (consumer, uuid) DO NOTHING",
		Prune:  "DELETE FROM " + t + " WHERE rowid IN (SELECT rowid FROM " + t + " WHERE consumer = ? AND received_at < ? ORDER BY received_at LIMIT ?)",
		Stats:  "SELECT count(*), min(received_at) / 1000 FROM " + t,
		Time:   func(t time.Time) any { return nanos(t) },
		Retry:  s.write,
	}
}
