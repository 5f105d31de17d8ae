package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

var update = flag.Bool("update", false, "rewrite the example outputs in docs/operations.md from this run")

const operationsGuide = "../../docs/operations.md"

// exampleRE is an example of docs/operations.md: a marker comment naming
// the command's arguments, then a fenced block holding "$ txoutbox ARGS"
// and what it printed.
var exampleRE = regexp.MustCompile("(?s)<!-- example: ([^>]*?) -->\n```\n(.*?)```\n")

// Parts of an output that change from run to run.
var (
	timeRE     = regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z`)
	durationRE = regexp.MustCompile(`(oldest (?:pending|delivered) age +)\S+`)
)

func normalizeExample(s string) string {
	s = timeRE.ReplaceAllString(s, "<time>")
	return durationRE.ReplaceAllString(s, "${1}<duration>")
}

// TestOperationsGuideExamples runs every example of docs/operations.md
// against PostgreSQL holding the records the guide describes, and compares
// what the command prints with what the guide shows, times and durations
// aside. go test ./cmd/txoutbox -run TestOperationsGuideExamples -update
// rewrites the guide's examples from the run.
func TestOperationsGuideExamples(t *testing.T) {
	guide, err := os.ReadFile(operationsGuide)
	if err != nil {
		t.Fatal(err)
	}
	examples := exampleRE.FindAllSubmatchIndex(guide, -1)
	if len(examples) < 4 {
		t.Fatalf("docs/operations.md has %d marked examples, want at least 4", len(examples))
	}
	dbURL, role := docsFixture(t)
	var out strings.Builder
	last := 0
	for _, m := range examples {
		args := strings.Fields(string(guide[m[2]:m[3]]))
		documented := string(guide[m[4]:m[5]])
		r := txoutbox(t, dbURL, args...)
		if r.code != exitOK && r.code != exitAttention {
			t.Fatalf("txoutbox %s: exit %d\n%s%s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
		}
		got := "$ txoutbox " + strings.Join(args, " ") + "\n" + strings.ReplaceAll(r.stdout, "role "+role+" ", "role app ")
		if !*update && normalizeExample(got) != normalizeExample(documented) {
			t.Errorf("docs/operations.md shows for txoutbox %s:\n%s\nthe command prints:\n%s\n(run go test ./cmd/txoutbox -run TestOperationsGuideExamples -update to rewrite the guide)",
				strings.Join(args, " "), documented, got)
		}
		out.Write(guide[last:m[4]])
		out.WriteString(got)
		last = m[5]
	}
	out.Write(guide[last:])
	if *update {
		if err := os.WriteFile(operationsGuide, []byte(out.String()), 0o644); err != nil { //nolint:gosec // a document of the repository
			t.Fatal(err)
		}
	}
}

// docsFixture makes the outbox the guide's examples show, on PostgreSQL in
// a schema of its own: a poison record of order-1042 dead with two of its
// key's records behind it, a dead invoice, a record of customer-77 in
// flight with one behind it, one delivered, one keyless pending. It
// returns the command's URL and the role it connects as.
func docsFixture(t *testing.T) (string, string) {
	t.Helper()
	dbURL, _ := pgSchemaURL(t)
	txoutbox(t, dbURL, "migrate", "up").want(t, 0)
	pool := pgPool(t, dbURL)
	s, err := postgres.New(pool, postgres.Config{HoldOnDeadLetter: true})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	type rec struct{ topic, key, payload string }
	recs := []rec{
		{"orders.created", "order-1042", `{"order":1042,"total":"99.90"}`},
		{"invoices.issued", "invoice-311", `{"invoice":311}`},
		{"customers.updated", "customer-77", `{"customer":77,"tier":"gold"}`},
		{"orders.created", "order-1043", `{"order":1043,"total":"12.00"}`},
		{"orders.created", "", `{"ping":true}`},
		{"orders.paid", "order-1042", `{"order":1042}`},
		{"orders.shipped", "order-1042", `{"order":1042}`},
		{"customers.updated", "customer-77", `{"customer":77,"tier":"silver"}`},
	}
	var in []storage.Record
	for i, r := range recs {
		in = append(in, storage.Record{UUID: fmt.Sprintf("0190a1c4-7e2b-7c3d-9f00-00000000000%d", i+1), Topic: r.topic, Key: r.key,
			Payload: []byte(r.payload), Metadata: map[string]string{"trace_id": fmt.Sprintf("4bf92f3577b34da6a3ce929d0e0e%04d", i+1)}})
	}
	insertTx(t, pool, s, in)
	claimed, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 4, Lease: time.Hour, WorkerID: "orders-relay-7d9f-1"})
	if err != nil || len(claimed) != 4 {
		t.Fatalf("claim: %v %v", claimed, err)
	}
	for id, e := range map[int64]string{1: "kafka: topic orders.created: message too large (1048588 > 1048576 bytes)", 2: "amqp: NOT_FOUND - no exchange 'invoices'"} {
		if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: storage.ClaimRef{ID: id, Attempt: 1}, WorkerID: "orders-relay-7d9f-1", Error: e}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Ack(ctx, storage.AckParams{Records: []storage.ClaimRef{{ID: 4, Attempt: 1}}, WorkerID: "orders-relay-7d9f-1"}); err != nil {
		t.Fatal(err)
	}
	var role string
	if err := pool.QueryRow(ctx, "SELECT current_user").Scan(&role); err != nil {
		t.Fatal(err)
	}
	return dbURL, role
}

func insertTx(t *testing.T, pool *pgxpool.Pool, s *postgres.Storage, recs []storage.Record) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	if err := s.Insert(ctx, tx, recs); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}
