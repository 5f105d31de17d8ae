package mysql

import (
	"strings"
	"testing"
)

// TestClaimUsesIndexes checks the plans of the claim's statements: the walk
// reads the claim index in its order (no filesort), the per-key probes the
// key index.
func TestClaimUsesIndexes(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	keys := make([]string, 2000)
	for i := range keys {
		keys[i] = []string{"a", "b", "c", ""}[i%4]
	}
	insert(t, s, recs(keys...)...)
	must(t, exec(t, s, "ANALYZE TABLE "+s.table))
	for _, c := range []struct{ q, index string }{
		{"SELECT id FROM " + s.table + " WHERE status = 'pending' AND parked = 0 AND due_at <= UTC_TIMESTAMP(6) ORDER BY due_at, id LIMIT 200 FOR UPDATE SKIP LOCKED", "claim_idx"},
		{"SELECT `key`, MIN(id) FROM " + s.table + " WHERE `key` IN ('a','b') AND status = 'pending' GROUP BY `key`", "key_idx"},
		{"SELECT id FROM " + s.table + " WHERE `key` = 'a' AND status = 'pending' AND id > 5 ORDER BY id LIMIT 16", "key_idx"},
	} {
		p := explain(t, s, c.q)
		if !strings.Contains(p, "key="+c.index) || strings.Contains(p, "filesort") {
			t.Errorf("plan of %s:\n%s\nwant index %s and no filesort", c.q, p, c.index)
		}
		t.Logf("%s\n  %s", c.q, p)
	}
}

// explain returns the plan of q as "column=value" pairs.
func explain(t testing.TB, s *Storage, q string) string {
	rows, err := s.db.QueryContext(t.Context(), "EXPLAIN "+q)
	must(t, err)
	defer func() { _ = rows.Close() }()
	cols, _ := rows.Columns()
	var plan []string
	for rows.Next() {
		vals := make([]any, len(cols))
		ptrs := make([]any, len(cols))
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		must(t, rows.Scan(ptrs...))
		for i, c := range cols {
			if b, ok := vals[i].([]byte); ok {
				plan = append(plan, c+"="+string(b))
			}
		}
	}
	must(t, rows.Err())
	return strings.Join(plan, " ")
}

func exec(t testing.TB, s *Storage, q string) error {
	_, err := s.db.ExecContext(t.Context(), q)
	return err
}
