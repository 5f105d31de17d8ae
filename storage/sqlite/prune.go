package sqlite

import (
	"context"
	"fmt"

	"github.com/txoutbox/txoutbox/storage"
)

var _ storage.Pruner = (*Storage)(nil)

// Prune implements [storage.Pruner]: one DELETE of up to params.Limit
// records delivered more than params.OlderThan ago. SQLite's write lock
// makes prunes take turns, across processes too: each deletes what the one
// before left.
func (s *Storage) Prune(ctx context.Context, p storage.PruneParams) (int64, error) {
	if err := p.Validate(); err != nil {
		return 0, err
	}
	cutoff := nanos(s.now().Add(-p.OlderThan))
	query := fmt.Sprintf(`DELETE FROM %[1]s WHERE id IN (
    SELECT id FROM %[1]s WHERE status = 'delivered' AND delivered_at < ?1 LIMIT ?2)`, quote(s.table))
	var n int64
	err := s.write(ctx, func(ctx context.Context) error {
		res, err := s.db.ExecContext(ctx, query, cutoff, p.Limit)
		if err != nil {
			return err
		}
		n, err = res.RowsAffected()
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("prune outbox records from %q: %w", s.table, err)
	}
	return n, nil
}
