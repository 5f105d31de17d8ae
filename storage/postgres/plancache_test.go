package postgres

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox/storage"
)

// TestClaimPlansOnce: on a pool that prepares statements (pgx's default
// exec mode) the claim's statements run on the generic plan of their
// prepared statement from the first claim on, the full strict claim (a key
// held back) included, never on a plan made for their parameters: left to
// choose, PostgreSQL plans the first five executions of a prepared
// statement for their parameters, and could go on doing so at every claim
// (3.3 ms a claim with 200k rows parked). The storage runs on a pool of one
// connection, so that pg_prepared_statements shows the plans of every
// claim. In the other exec modes the statement is unnamed, planned at every
// execution: the claim sets nothing there.
func TestClaimPlansOnce(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig(testDatabaseURL())
	must(t, err)
	cfg.MaxConns = 1
	cfg.ConnConfig.RuntimeParams["search_path"] = ""
	p, err := pgxpool.NewWithConfig(t.Context(), cfg)
	must(t, err)
	t.Cleanup(p.Close)
	s := newStoreOn(t, p, Config{})
	ctx := t.Context()

	// A key held back: its head waits an hour for its retry, so every claim
	// after the one that sees it held is the full claim.
	insert(t, s, rec("held"), rec("held"))
	head := claim(t, s, "w", 1, time.Minute)
	must(t, s.Nack(ctx, storage.NackParams{Record: head[0].Ref(), WorkerID: "w", Error: "down", RetryAt: time.Now().Add(time.Hour)}))
	const claims = 12
	for i := range claims {
		insert(t, s, rec(fmt.Sprintf("a%d", i)), rec(fmt.Sprintf("b%d", i)))
		got := claim(t, s, "w", 100, time.Minute)
		if len(got) != 2 {
			t.Fatalf("claim %d: got %d records, want the 2 fresh ones", i, len(got))
		}
		must(t, s.Ack(ctx, storage.AckParams{Records: storage.Refs(got), WorkerID: "w"}))
	}
	if s.nothingHeld.Load() {
		t.Fatal("the last claim was the lean one: nothing held, so the full claim was not exercised")
	}

	rows, err := p.Query(ctx, `SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements`)
	must(t, err)
	defer rows.Close()
	full := false
	for rows.Next() {
		var stmt string
		var generic, custom int64
		must(t, rows.Scan(&stmt, &generic, &custom))
		if stmt == s.q.claim {
			full = true
			if generic < claims-2 {
				t.Errorf("the full claim ran %d times on its generic plan, want at least %d", generic, claims-2)
			}
		}
		if strings.HasPrefix(stmt, "WITH clk") && custom > 0 {
			t.Errorf("a claim statement was planned for its parameters %d times (generic plan %d times):\n%.200s", custom, generic, stmt)
		}
	}
	must(t, rows.Err())
	if !full {
		t.Fatal("the full claim is not among the connection's prepared statements")
	}

	// The settings statement of each kind of claim (with strict ordering
	// and without), in each exec mode: the generic plan is forced where
	// statements are prepared, and nowhere else. New does not connect.
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		cfg, err := pgxpool.ParseConfig(testDatabaseURL())
		must(t, err)
		cfg.ConnConfig.DefaultQueryExecMode = mode
		other, err := pgxpool.NewWithConfig(t.Context(), cfg)
		must(t, err)
		strict, err := New(other, Config{Table: s.config.Table})
		must(t, err)
		loose, err := New(other, Config{Table: s.config.Table, DisableStrictOrdering: true})
		other.Close()
		must(t, err)
		want := mode == pgx.QueryExecModeCacheStatement
		for name, sql := range map[string]string{"strict": strict.q.planLock, "without strict ordering": loose.q.plan} {
			if got := strings.Contains(sql, "'plan_cache_mode', 'force_generic_plan'"); got != want {
				t.Errorf("exec mode %v, %s: the claim forces the generic plan: %v, want %v", mode, name, got, want)
			}
		}
	}
}
