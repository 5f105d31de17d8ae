package txoutbox_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if a goroutine outlives the tests: Run must return
// with nothing left behind.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// The shared test pool (backends_test.go) lives for the whole run.
		goleak.IgnoreAnyFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
		goleak.IgnoreAnyFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).triggerHealthCheck.func1"),
	)
}
