package mysql

import (
	"time"

	"github.com/txoutbox/txoutbox/internal/sqlinbox"
	"github.com/txoutbox/txoutbox/storage"
)

const inboxSuffix = "_inbox"

// InboxTable returns the inbox table of the inbox package, quoted: the
// outbox table's name with "_inbox" appended, in the same database. Migrate
// creates it (schema step 4).
func (s *Storage) InboxTable() string { return s.sibling(inboxSuffix) }

// Inbox returns the inbox table on the storage's database, for the inbox
// package: handlers get a *sql.Tx. The entry is written with INSERT IGNORE,
// which waits for a transaction holding the same entry uncommitted; the
// inbox package checks consumer names and uuids before, so that nothing
// else a strict SQL mode would refuse is ignored.
func (s *Storage) Inbox() storage.InboxStore {
	t := s.InboxTable()
	return &sqlinbox.Store{DB: s.db,
		Insert: "INSERT IGNORE INTO " + t + " (consumer, uuid, received_at) VALUES (?, ?, ?)",
		Prune:  "DELETE FROM " + t + " WHERE consumer = ? AND received_at < ? ORDER BY received_at LIMIT ?",
		Stats:  "SELECT COUNT(*), " + micros("MIN(received_at)") + " FROM " + t,
		Time:   func(t time.Time) any { return t.UTC().Format("2006-01-02 15:04:05.000000") },
	}
}
