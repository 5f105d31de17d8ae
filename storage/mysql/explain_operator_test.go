package mysql

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/txoutbox/txoutbox/storage"
)

// fillLarge fills the table with rows 1..n (n <= 10^6) in one INSERT ...
// SELECT: 5,000 keys; 1 row in 60 dead; the last 20,000 pending, of which
// 1 in 40 leased for an hour, 1 in 50 waiting an hour for a retry, the rest
// parked behind them; all others delivered an hour ago.
func fillLarge(t *testing.T, s *Storage, n, deadEvery int) {
	t.Helper()
	digits := "(SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 " +
		"UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9)"
	var from, num []string
	for i, mul := 0, 1; mul < n; i, mul = i+1, mul*10 {
		from = append(from, fmt.Sprintf("%s d%d", digits, i))
		num = append(num, fmt.Sprintf("d%d.d * %d", i, mul))
	}
	seq := "SELECT " + strings.Join(num, " + ") + " + 1 AS n FROM " + strings.Join(from, " CROSS JOIN ")
	p := strconv.Itoa(n - 20000) // rows above it are pending (unless dead)
	pending := "(n > " + p + " AND n % " + strconv.Itoa(deadEvery) + " <> 0)"
	leased := "(" + pending + " AND n % 40 = 0)"
	retry := "(" + pending + " AND n % 40 <> 0 AND n % 50 = 0)"
	q := "INSERT INTO " + s.table + " (uuid, topic, `key`, payload, created_at, due_at, attempts, status, parked, leased_by, leased_until, last_error, delivered_at)\n" +
		"SELECT CONCAT('u', n), IF(n % 7 = 0, 'invoices', 'orders'), CONCAT('k', n % 5000), 'p', UTC_TIMESTAMP(6) - INTERVAL 1 DAY,\n" +
		"  IF(" + leased + " OR " + retry + ", UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, UTC_TIMESTAMP(6)), 1,\n" +
		"  CASE WHEN n % " + strconv.Itoa(deadEvery) + " = 0 THEN 'dead' WHEN n > " + p + " THEN 'pending' ELSE 'delivered' END,\n" +
		"  IF(" + pending + " AND NOT " + leased + " AND NOT " + retry + ", 1, 0),\n" +
		"  IF(" + leased + ", 'w', NULL), IF(" + leased + ", UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, NULL),\n" +
		"  IF(n % " + strconv.Itoa(deadEvery) + " = 0 OR " + retry + ", 'broker said no', NULL),\n" +
		"  IF(n % " + strconv.Itoa(deadEvery) + " <> 0 AND n <= " + p + ", UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, NULL)\n" +
		"FROM (" + seq + ") AS seq WHERE n <= " + strconv.Itoa(n) + " ORDER BY n"
	must(t, exec(t, s, q))
	must(t, exec(t, s, "ANALYZE TABLE "+s.table))
}

// handlerReads runs q on one connection and returns the rows the storage
// engine handed over for it (the sum of the Handler_read_* counters).
func handlerReads(t *testing.T, s *Storage, q string) int64 {
	t.Helper()
	conn, err := s.db.Conn(t.Context())
	must(t, err)
	defer func() { _ = conn.Close() }()
	read := func() int64 {
		rows, err := conn.QueryContext(t.Context(), "SHOW SESSION STATUS LIKE 'Handler_read%'")
		must(t, err)
		defer func() { _ = rows.Close() }()
		var total int64
		for rows.Next() {
			var k string
			var v int64
			must(t, rows.Scan(&k, &v))
			total += v
		}
		must(t, rows.Err())
		return total
	}
	before := read()
	func() {
		rows, err := conn.QueryContext(t.Context(), q)
		must(t, err)
		defer func() { _ = rows.Close() }()
		for rows.Next() { //nolint:revive // drain the result
		}
		must(t, rows.Err())
	}()
	return read() - before
}

var baseTableScan = regexp.MustCompile(`table=([^< ][^ ]*) type=ALL`)

// TestOperatorQueriesUseIndexes checks the operator's reads on a table of
// 300,000 rows (20,000 pending, the rest delivered or dead), once with dead
// rows common (1 in 60) and once rare (1 in 6,000): no step scans the outbox
// table, the dead-letter pages are read in id order without a sort, and the
// rows each statement reads are bounded by the dead and in-flight rows, not
// by the table. The answers are checked against the data.
func TestOperatorQueriesUseIndexes(t *testing.T) {
	if testing.Short() {
		t.Skip("fills 300,000 rows")
	}
	t.Parallel()
	const n = 300_000
	for _, every := range []int{60, 6000} {
		s := newStore(t, Config{HoldOnDeadLetter: true})
		fillLarge(t, s, n, every)
		dead := int64(n / every)
		var heads int64 // the rows HeldKeys looks at: dead, leased or waiting
		must(t, s.db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM "+s.table+" WHERE status = 'dead' OR (status = 'pending' AND due_at > UTC_TIMESTAMP(6))").Scan(&heads))
		for _, c := range []struct {
			name     string
			q        string
			page     bool // an id-ordered page: no filesort
			maxReads int64
		}{
			{"ListDead", s.listDeadSQL(storage.ListDeadParams{}), true, dead + 1},
			{"ListDead by topic", s.listDeadSQL(storage.ListDeadParams{Topic: "invoices", AfterID: 1000}), true, dead + 1},
			{"ListDead by key", s.listDeadSQL(storage.ListDeadParams{Key: "k120"}), true, dead + 1},
			{"ListDead by an error no row has", s.listDeadSQL(storage.ListDeadParams{ErrorContains: "nothing like it", OlderThan: 1}), true, dead + 1},
			{"HeldKeys", s.heldKeysSQL(false, "k1", 100), false, 20 * heads},
			{"HeldKeys count", s.heldKeysSQL(true, "", 0), false, 20 * heads},
		} {
			p := explain(t, s, c.q)
			reads := handlerReads(t, s, c.q)
			t.Logf("dead 1 in %d, %s: %d rows read\n  %s", every, c.name, reads, strings.ReplaceAll(p, " id=", "\n  id="))
			if baseTableScan.MatchString(p) {
				t.Errorf("dead 1 in %d: %s scans the table:\n%s", every, c.name, p)
			}
			if c.page && strings.Contains(p, "filesort") {
				t.Errorf("dead 1 in %d: %s sorts its page:\n%s", every, c.name, p)
			}
			if reads > c.maxReads {
				t.Errorf("dead 1 in %d: %s read %d rows, want at most %d", every, c.name, reads, c.maxReads)
			}
		}
		if every == 60 {
			checkLargeAnswers(t, s, n)
		}
	}
}

func checkLargeAnswers(t *testing.T, s *Storage, n int64) {
	ctx := t.Context()
	dead, err := s.ListDead(ctx, storage.ListDeadParams{Limit: 3})
	must(t, err)
	if len(dead) != 3 || dead[0].Record.ID != 60 || dead[2].Record.ID != 180 {
		t.Fatalf("ListDead first page = %d records from %v", len(dead), dead)
	}
	held, err := s.HeldKeys(ctx, storage.HeldKeysParams{Limit: 5})
	must(t, err)
	if len(held) != 5 || held[0].Key != "k0" || held[0].Reason != storage.HoldDead {
		t.Fatalf("HeldKeys = %+v", held)
	}
	st, err := s.Stats(ctx)
	must(t, err)
	var all []storage.HeldKey
	for after := ""; ; {
		page, err := s.HeldKeys(ctx, storage.HeldKeysParams{AfterKey: after, Limit: 1000})
		must(t, err)
		if len(page) == 0 {
			break
		}
		all, after = append(all, page...), page[len(page)-1].Key
	}
	// Keys with a dead row (n % 60 = 0: 250 keys), and keys whose first
	// pending row is leased or waiting with rows behind it.
	if st.Dead != n/60 || st.Pending+st.Dead+st.Delivered != n || st.Forwarders != 1 || st.Leased != 333 ||
		st.HeldKeys != int64(len(all)) || len(all) <= 250 {
		t.Fatalf("Stats = %+v, %d held keys listed", st, len(all))
	}
}
