package mysql

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// fillHot inserts a key "hot" whose head waits an hour for its retry, with
// behind rows parked behind it, and 100 other keys held the same way with
// one row behind each.
func fillHot(t *testing.T, s *Storage, behind int) {
	t.Helper()
	digits := "(SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 " +
		"UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9)"
	var from, num []string
	for i, mul := 0, 1; mul < behind+1; i, mul = i+1, mul*10 {
		from = append(from, fmt.Sprintf("%s d%d", digits, i))
		num = append(num, fmt.Sprintf("d%d.d * %d", i, mul))
	}
	seq := "SELECT " + strings.Join(num, " + ") + " + 1 AS n FROM " + strings.Join(from, " CROSS JOIN ")
	must(t, exec(t, s, "INSERT INTO "+s.table+" (uuid, topic, `key`, payload, created_at, due_at, attempts, last_error, parked)\n"+
		"SELECT CONCAT('u', n), 't', 'hot', 'p', UTC_TIMESTAMP(6), IF(n = 1, UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, UTC_TIMESTAMP(6)), IF(n = 1, 1, 0),\n"+
		"  IF(n = 1, 'later', NULL), IF(n = 1, 0, 1) FROM ("+seq+") AS seq WHERE n <= "+strconv.Itoa(behind+1)+" ORDER BY n"))
	must(t, exec(t, s, "INSERT INTO "+s.table+" (uuid, topic, `key`, payload, created_at, due_at, attempts, last_error, parked)\n"+
		"SELECT CONCAT('v', n), 't', CONCAT('k', n % 100), 'p', UTC_TIMESTAMP(6), IF(n <= 100, UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, UTC_TIMESTAMP(6)),\n"+
		"  IF(n <= 100, 1, 0), IF(n <= 100, 'later', NULL), IF(n <= 100, 0, 1) FROM ("+seq+") AS seq WHERE n <= 200 ORDER BY n"))
	must(t, exec(t, s, "ANALYZE TABLE "+s.table))
}

// TestHeldKeysCountBounded: the count of held keys (Stats, on the metrics
// collector's timer) reads the heads and one row behind each, not the
// backlog behind them.
func TestHeldKeysCountBounded(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	fillHot(t, s, 50_000)
	if reads := handlerReads(t, s, s.heldKeysSQL(true, "", 0)); reads > 2_000 {
		t.Errorf("held keys count read %d rows behind 101 held keys, want at most 2,000", reads)
	}
	st := mustStats(t, s)
	if st.HeldKeys != 101 || st.Pending != 50_001+200 {
		t.Errorf("Stats = %+v, want 101 held keys, %d pending", st, 50_001+200)
	}
}

// TestMeasureHeldKeysAtScale measures Stats and HeldKeys with a million
// rows behind one held key (TXOUTBOX_MEASURE=1).
func TestMeasureHeldKeysAtScale(t *testing.T) {
	if os.Getenv("TXOUTBOX_MEASURE") == "" {
		t.Skip("a measurement: set TXOUTBOX_MEASURE=1")
	}
	s := newStore(t, Config{})
	fillHot(t, s, 1_000_000)
	ctx := t.Context()
	for range 3 {
		start := time.Now()
		reads := handlerReads(t, s, s.heldKeysSQL(true, "", 0))
		t.Logf("held keys count: %v, %d rows read", time.Since(start), reads)
		start = time.Now()
		reads = handlerReads(t, s, "SELECT COUNT(*) FROM "+s.table+" WHERE status = 'pending'")
		t.Logf("pending count alone: %v, %d rows read", time.Since(start), reads)
		start = time.Now()
		_, err := s.Stats(ctx)
		must(t, err)
		t.Logf("Stats: %v", time.Since(start))
		start = time.Now()
		held, err := s.HeldKeys(ctx, storagetestHeldParams())
		must(t, err)
		t.Logf("HeldKeys (%d keys): %v", len(held), time.Since(start))
		start = time.Now()
		must(t, s.sweep(ctx))
		t.Logf("sweep: %v", time.Since(start))
	}
}

func storagetestHeldParams() storage.HeldKeysParams { return storage.HeldKeysParams{Limit: 100} }
