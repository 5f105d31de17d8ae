package postgres

import (
	"context"

	"github.com/txoutbox/txoutbox/storage"
)

// Diagnose implements [storage.Diagnoser].
func (s *Storage) Diagnose(ctx context.Context) ([]storage.Finding, error) {
	return nil, nil
}
