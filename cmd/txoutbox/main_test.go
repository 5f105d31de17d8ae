package main

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox/internal/pgbouncertest"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/postgres"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// binary is the command built once for the tests that run it as a process.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "txoutbox-cmd")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "txoutbox")
	if runtime.GOOS == "windows" {
		binary += ".exe"
	}
	if out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "go build: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

type result struct {
	stdout, stderr string
	code           int
}

// txoutbox runs the built command with the database URL in the environment.
func txoutbox(t *testing.T, dbURL string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = append(os.Environ(), envDatabaseURL+"="+dbURL)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	r := result{stdout.String(), stderr.String(), 0}
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		r.code = exit.ExitCode()
	} else if err != nil {
		t.Fatalf("run txoutbox %v: %v", args, err)
	}
	return r
}

func (r result) want(t *testing.T, code int, contains ...string) {
	t.Helper()
	if r.code != code {
		t.Fatalf("exit code %d, want %d\nstdout:\n%s\nstderr:\n%s", r.code, code, r.stdout, r.stderr)
	}
	for _, c := range contains {
		if !strings.Contains(r.stdout+r.stderr, c) {
			t.Fatalf("output lacks %q\nstdout:\n%s\nstderr:\n%s", c, r.stdout, r.stderr)
		}
	}
}

func (r result) json(t *testing.T, v any) {
	t.Helper()
	if err := json.Unmarshal([]byte(r.stdout), v); err != nil {
		t.Fatalf("stdout is not JSON: %v\n%s", err, r.stdout)
	}
}

// opStorage is what the tests use of a storage.
type opStorage interface {
	storage.Storage
	storage.Operator
	storage.Inserter
}

// fixture is a migrated outbox (SQLite file or PostgreSQL schema) with
// records in every state:
//
//	a1 dead (poison), a2 a3 pending behind it; b1 dead; c1 leased, c2 behind
//	it; d1 delivered (an hour ago, by the storage's clock); k keyless pending.
type fixture struct {
	kind string // sqlite or postgres
	url  string
	s    opStorage
	// exec runs a statement of the fixture's SQL dialect.
	exec func(t *testing.T, query string, args ...any)
	// begin starts a transaction for Insert.
	begin func(t *testing.T) (tx any, commit func() error)
	ids   map[string]int64
}

// backends lists the fixtures every process test runs on.
var backends = []struct {
	name string
	open func(t *testing.T) fixture
}{
	{"sqlite", openSQLiteFixture},
	{"postgres", openPostgresFixture},
}

// forEachBackend runs test as a parallel subtest per backend, on a fresh
// fixture.
func forEachBackend(t *testing.T, test func(t *testing.T, f fixture)) {
	t.Helper()
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			test(t, fill(t, b.open(t)))
		})
	}
}

func openSQLiteFixture(t *testing.T) fixture {
	t.Helper()
	path := filepath.Join(t.TempDir(), "app.db")
	url := "sqlite://" + path
	txoutbox(t, url, "migrate", "up").want(t, 0, "migrated from version 0 to")
	db, err := sqlite.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	s, err := sqlite.New(db, sqlite.Config{HoldOnDeadLetter: true})
	if err != nil {
		t.Fatal(err)
	}
	return fixture{kind: "sqlite", url: url, s: s,
		exec: func(t *testing.T, q string, args ...any) {
			t.Helper()
			if _, err := db.Exec(q, args...); err != nil {
				t.Fatal(err)
			}
		},
		begin: func(t *testing.T) (any, func() error) {
			tx, err := db.Begin()
			if err != nil {
				t.Fatal(err)
			}
			return tx, tx.Commit
		}}
}

// pgTestURL is the test database: TEST_DATABASE_URL or the local one.
func pgTestURL() string {
	return cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
}

// pgPool connects to the test database, skipping the test when it does not
// answer (failing with CI=true).
func pgPool(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, url)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		msg := fmt.Sprintf("PostgreSQL not reachable at %s: %v", url, err)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	t.Cleanup(pool.Close)
	return pool
}

// pgSchemaURL creates a schema of its own for the test (dropped at its end)
// and returns the test database's URL with that schema as search_path, so
// the command's default table "outbox" lands in it.
func pgSchemaURL(t *testing.T) (string, string) {
	t.Helper()
	admin := pgPool(t, pgTestURL())
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := "txo_cmd_" + hex.EncodeToString(b[:])
	if _, err := admin.Exec(context.Background(), "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
	})
	sep := "?"
	if strings.Contains(pgTestURL(), "?") {
		sep = "&"
	}
	return pgTestURL() + sep + "search_path=" + schema, schema
}

func openPostgresFixture(t *testing.T) fixture {
	t.Helper()
	url, _ := pgSchemaURL(t)
	txoutbox(t, url, "migrate", "up").want(t, 0, "migrated from version 0 to")
	pool := pgPool(t, url)
	s, err := postgres.New(pool, postgres.Config{HoldOnDeadLetter: true})
	if err != nil {
		t.Fatal(err)
	}
	return fixture{kind: "postgres", url: url, s: s,
		exec: func(t *testing.T, q string, args ...any) {
			t.Helper()
			if _, err := pool.Exec(context.Background(), q, args...); err != nil {
				t.Fatal(err)
			}
		},
		begin: func(t *testing.T) (any, func() error) {
			tx, err := pool.Begin(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			return tx, func() error { return tx.Commit(context.Background()) }
		}}
}

// fill inserts the fixture's records and puts them in their states.
func fill(t *testing.T, f fixture) fixture {
	t.Helper()
	s := f.s
	ctx := context.Background()
	names := []string{"a1", "b1", "c1", "d1", "k", "a2", "a3", "c2"}
	keys := map[string]string{"a1": "a", "a2": "a", "a3": "a", "b1": "b", "c1": "c", "c2": "c", "d1": "d", "k": ""}
	tx, commit := f.begin(t)
	var recs []storage.Record
	for _, n := range names {
		topic := "orders"
		if n == "b1" {
			topic = "invoices"
		}
		recs = append(recs, storage.Record{UUID: "uuid-" + n, Topic: topic, Key: keys[n], Payload: []byte(`{"name":"` + n + `"}`),
			Metadata: map[string]string{"trace": "t-" + n}})
	}
	if err := s.Insert(ctx, tx, recs); err != nil {
		t.Fatal(err)
	}
	if err := commit(); err != nil {
		t.Fatal(err)
	}
	ids := map[string]int64{}
	for i, n := range names {
		ids[n] = int64(i + 1)
	}
	claimed, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 4, Lease: time.Hour, WorkerID: "fwd-1"}) // a1 b1 c1 d1
	if err != nil || len(claimed) != 4 {
		t.Fatalf("claim: %v %v", claimed, err)
	}
	for _, n := range []string{"a1", "b1"} {
		if err := s.DeadLetter(ctx, storage.DeadLetterParams{ID: ids[n], WorkerID: "fwd-1", Error: "broker said no: " + n}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Ack(ctx, storage.AckParams{IDs: []int64{ids["d1"]}, WorkerID: "fwd-1"}); err != nil {
		t.Fatal(err)
	}
	if f.kind == "postgres" {
		f.exec(t, `UPDATE outbox_delivered SET delivered_at = delivered_at - interval '1 hour' WHERE id = $1`, ids["d1"])
	} else {
		f.exec(t, `UPDATE outbox SET delivered_at = delivered_at - ? WHERE id = ?`, int64(time.Hour), ids["d1"])
	}
	f.ids = ids
	return f
}

func TestMigrate(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		txoutbox(t, f.url, "migrate", "up").want(t, 0, "already at version")
		r := txoutbox(t, f.url, "migrate", "status", "--json")
		r.want(t, 0)
		var st struct {
			Current int `json:"current_version"`
			Latest  int `json:"latest_version"`
			Applied []struct {
				Version int `json:"version"`
			} `json:"applied"`
		}
		r.json(t, &st)
		latest, lastName := sqlite.LatestVersion(), "hold_and_skip"
		if f.kind == "postgres" {
			latest, lastName = postgres.LatestVersion(), "operator"
		}
		if st.Current != latest || st.Latest != st.Current || len(st.Applied) != st.Current {
			t.Fatalf("migrate status: %+v", st)
		}
		txoutbox(t, f.url, "migrate", "status").want(t, 0, "VERSION", lastName)
		txoutbox(t, "", "--database-url", f.url, "--json", "migrate", "status").want(t, 0, `"current_version"`) // shared flags first

		// Behind: exit 3, and the operating commands refuse to run.
		f.exec(t, fmt.Sprintf(`DELETE FROM outbox_migrations WHERE version = %d`, latest))
		txoutbox(t, f.url, "migrate", "status").want(t, exitAttention, "not applied")
		txoutbox(t, f.url, "status").want(t, exitError, "run `txoutbox migrate up`")
		txoutbox(t, f.url, "migrate", "up").want(t, 0, fmt.Sprintf("to %d", latest))
		if f.kind == "postgres" {
			r = txoutbox(t, "postgres:", "migrate", "sql", "--table", "app.events", "--notify-channel", "wake")
			r.want(t, 0, `CREATE TABLE IF NOT EXISTS "app"."events"`, `"app"."events_leases"`, "-- txoutbox migration 2", "pg_notify('wake'")
			txoutbox(t, "postgres:", "migrate", "sql", "--down").want(t, 0, `DROP INDEX IF EXISTS "outbox_failed_key_idx"`)
			return
		}

		r = txoutbox(t, "sqlite:", "migrate", "sql", "--table", "events")
		r.want(t, 0, `CREATE TABLE IF NOT EXISTS "events"`, "-- txoutbox migration 2")
		txoutbox(t, "sqlite:", "migrate", "sql", "--down").want(t, 0, `DROP INDEX IF EXISTS "outbox_failed_key"`)
		for _, format := range []string{"golang-migrate", "goose"} {
			dir := t.TempDir()
			txoutbox(t, "sqlite:", "migrate", "sql", "--dir", dir, "--format", format).want(t, 0, "001_txoutbox_create_outbox")
			entries, _ := os.ReadDir(dir)
			want := 2 * sqlite.LatestVersion()
			if format == "goose" {
				want = sqlite.LatestVersion()
			}
			if len(entries) != want {
				t.Fatalf("%s: %d files, want %d", format, len(entries), want)
			}
		}
		txoutbox(t, "sqlite:", "migrate", "sql", "--dir", t.TempDir(), "--format", "flyway").want(t, exitUsage, "--format")
	})
}

func TestStatus(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		r := txoutbox(t, f.url, "status", "--hold-on-dead-letter", "--json")
		r.want(t, exitAttention)
		var st struct {
			Pending, Leased, Dead, Delivered, Forwarders int64
			HeldKeyCount                                 int64 `json:"held_key_count"`
			HeldKeys                                     []struct {
				Key      string `json:"key"`
				HeadID   int64  `json:"head_id"`
				Reason   string `json:"reason"`
				LeasedBy string `json:"leased_by"`
				Behind   int64  `json:"behind"`
			} `json:"held_keys"`
		}
		r.json(t, &st)
		if st.Pending != 5 || st.Leased != 1 || st.Dead != 2 || st.Delivered != 1 || st.Forwarders != 1 || st.HeldKeyCount != 3 {
			t.Fatalf("status: %+v", st)
		}
		got := fmt.Sprint(st.HeldKeys)
		want := fmt.Sprintf("[{a %d dead  2} {b %d dead  0} {c %d leased fwd-1 1}]", f.ids["a1"], f.ids["b1"], f.ids["c1"])
		if got != want {
			t.Fatalf("held keys %s, want %s", got, want)
		}
		txoutbox(t, f.url, "status").want(t, exitAttention, "forwarders seen", "leased by fwd-1 until", "2 dead record(s), 0 key(s) held by a failing or dead record")
		// Only a key held by a record in flight: nothing needs an operator.
		if n, err := f.s.Redrive(context.Background(), storage.RedriveParams{All: true}); err != nil || n != 2 {
			t.Fatal(n, err)
		}
		txoutbox(t, f.url, "status", "--hold-on-dead-letter").want(t, 0, "leased by fwd-1")
	})
}

func TestDeadListAndShow(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		r := txoutbox(t, f.url, "dead", "list", "--json")
		r.want(t, 0)
		var list []struct {
			ID        int64  `json:"id"`
			Key       string `json:"key"`
			LastError string `json:"last_error"`
			Payload   string `json:"payload"`
		}
		r.json(t, &list)
		if len(list) != 2 || list[0].ID != f.ids["a1"] || list[1].ID != f.ids["b1"] || list[0].Payload != "" {
			t.Fatalf("dead list: %+v", list)
		}
		for _, c := range []struct {
			args []string
			want []int64
		}{
			{[]string{"--topic", "invoices"}, []int64{f.ids["b1"]}},
			{[]string{"--key", "a"}, []int64{f.ids["a1"]}},
			{[]string{"--error", "said no: b"}, []int64{f.ids["b1"]}},
			{[]string{"--older-than", "1h"}, nil},
			{[]string{"--after-id", fmt.Sprint(f.ids["a1"]), "--limit", "1"}, []int64{f.ids["b1"]}},
		} {
			var page []struct {
				ID int64 `json:"id"`
			}
			txoutbox(t, f.url, append([]string{"dead", "list", "--json"}, c.args...)...).json(t, &page)
			var got []int64
			for _, p := range page {
				got = append(got, p.ID)
			}
			if !slices.Equal(got, c.want) {
				t.Errorf("dead list %v = %v, want %v", c.args, got, c.want)
			}
		}
		txoutbox(t, f.url, "dead", "list").want(t, 0, "ID", "ERROR", "broker said no: a1")

		r = txoutbox(t, f.url, "dead", "show", fmt.Sprint(f.ids["a1"]), "--json")
		r.want(t, 0)
		var rec struct {
			Status, Payload, LastError string
			Attempts                   int
			Metadata                   map[string]string
			PayloadEncoding            string `json:"payload_encoding"`
		}
		r.json(t, &rec)
		if rec.Status != "dead" || rec.Payload != `{"name":"a1"}` || rec.PayloadEncoding != "text" || rec.Attempts != 1 || rec.Metadata["trace"] != "t-a1" {
			t.Fatalf("dead show: %+v", rec)
		}
		txoutbox(t, f.url, "dead", "show", fmt.Sprint(f.ids["a1"])).want(t, 0, "payload (text)", `{"name":"a1"}`, "metadata trace", "broker said no: a1")
		txoutbox(t, f.url, "dead", "show", "999").want(t, exitNotFound, "not found")
		txoutbox(t, f.url, "dead", "show").want(t, exitUsage, "record ID")
		txoutbox(t, f.url, "dead", "show", "abc").want(t, exitUsage, "positive integer")
	})
}

func TestRedrive(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		txoutbox(t, f.url, "redrive").want(t, exitUsage, "exactly one of")
		txoutbox(t, f.url, "redrive", "--key", "a", "--all").want(t, exitUsage, "exactly one of")

		r := txoutbox(t, f.url, "redrive", "--all", "--dry-run", "--json")
		r.want(t, 0)
		var dry struct {
			DryRun bool    `json:"dry_run"`
			Count  int     `json:"count"`
			IDs    []int64 `json:"ids"`
		}
		r.json(t, &dry)
		if !dry.DryRun || dry.Count != 2 || !slices.Equal(dry.IDs, []int64{f.ids["a1"], f.ids["b1"]}) {
			t.Fatalf("dry run: %+v", dry)
		}
		txoutbox(t, f.url, "redrive", "--id", fmt.Sprintf("%d,%d", f.ids["a1"], f.ids["a2"]), "--dry-run").want(t, 0, fmt.Sprintf("would re-drive 1 dead record(s): %d", f.ids["a1"]))
		if st, _ := f.s.Stats(context.Background()); st.Dead != 2 {
			t.Fatalf("dry run changed something: %+v", st)
		}
		txoutbox(t, f.url, "redrive", "--key", "a").want(t, 0, "re-drove 1 dead record(s)")
		txoutbox(t, f.url, "redrive", "--key", "a").want(t, 0, "re-drove 0 dead record(s)") // idempotent
		txoutbox(t, f.url, "redrive", "--topic", "invoices").want(t, 0, "re-drove 1 dead record(s)")
		// Key a flows again in id order: a1 first, then a2 and a3.
		got, err := f.s.Claim(context.Background(), storage.ClaimParams{BatchSize: 10, Lease: time.Minute, WorkerID: "fwd-2"})
		if err != nil {
			t.Fatal(err)
		}
		var a []int64
		for _, r := range got {
			if r.Key == "a" {
				a = append(a, r.ID)
			}
		}
		if !slices.Equal(a, []int64{f.ids["a1"], f.ids["a2"], f.ids["a3"]}) {
			t.Fatalf("key a claimed %v after redrive, want a1 a2 a3 in id order", a)
		}
	})
}

func TestSkipAndPurge(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		a1 := fmt.Sprint(f.ids["a1"])
		txoutbox(t, f.url, "skip", a1).want(t, exitUsage, "--reason is required")
		txoutbox(t, f.url, "skip", fmt.Sprint(f.ids["a2"]), "--reason", "x").want(t, exitNotFound, "not dead-lettered")
		txoutbox(t, f.url, "skip", "999", "--reason", "x").want(t, exitNotFound, "not found")
		txoutbox(t, f.url, "skip", a1, "--reason", "customer deleted, OPS-1").want(t, 0, "skipped record "+a1)
		r := txoutbox(t, f.url, "dead", "show", a1, "--json")
		var rec struct {
			Status     string `json:"status"`
			SkipReason string `json:"skip_reason"`
			Payload    string `json:"payload"`
		}
		r.json(t, &rec)
		if rec.Status != "skipped" || rec.SkipReason != "customer deleted, OPS-1" || rec.Payload != `{"name":"a1"}` {
			t.Fatalf("skipped record: %+v", rec)
		}
		// The key moves on at once: a2 is claimable although the storage holds keys on dead-letter.
		got, err := f.s.Claim(context.Background(), storage.ClaimParams{BatchSize: 10, Lease: time.Minute, WorkerID: "fwd-2"})
		if err != nil || len(got) == 0 || !slices.ContainsFunc(got, func(r storage.Record) bool { return r.ID == f.ids["a2"] }) {
			t.Fatalf("claim after skip: %v, %v; want a2 among them", got, err)
		}

		txoutbox(t, f.url, "purge").want(t, exitUsage, "--older-than is required")
		txoutbox(t, f.url, "purge", "--older-than", "2h").want(t, 0, "purged 0 delivered record(s)")
		txoutbox(t, f.url, "purge", "--older-than", "30m", "--json").want(t, 0, `"purged": 1`)
	})
}

func TestDoctor(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		index := "outbox_dead_key"
		if f.kind == "postgres" {
			index = "outbox_dead_key_idx"
			txoutbox(t, f.url, "doctor").want(t, 0, "schema version", "schema drift", "privileges", "connection pooler")
			// The forwarders' NotifyChannel: its trigger is missing until
			// migrate up is told the channel.
			txoutbox(t, f.url, "doctor", "--notify-channel", "wake").want(t, exitAttention, "migrate up --notify-channel wake")
			txoutbox(t, f.url, "migrate", "up", "--notify-channel", "wake").want(t, 0)
			txoutbox(t, f.url, "doctor", "--notify-channel", "wake").want(t, 0, "notifies channel wake")
		} else {
			txoutbox(t, f.url, "doctor").want(t, 0, "schema version", "schema drift", "journal mode", "wal")
		}
		f.exec(t, `DROP INDEX `+index)
		r := txoutbox(t, f.url, "doctor", "--json")
		r.want(t, exitAttention, index+" is missing")
		var findings []struct{ Check, Severity, Message string }
		r.json(t, &findings)
		if len(findings) < 4 {
			t.Fatalf("findings: %+v", findings)
		}
		f.exec(t, `UPDATE outbox_migrations SET version = 99 WHERE version = 1`)
		txoutbox(t, f.url, "doctor").want(t, exitAttention, "newer than this build")
	})
}

func TestHelpAndUsage(t *testing.T) {
	t.Parallel()
	txoutbox(t, "", "help").want(t, 0, "Commands:", "Exit codes")
	txoutbox(t, "", "--help").want(t, 0, "Commands:")
	txoutbox(t, "").want(t, exitUsage, "no command")
	txoutbox(t, "", "frobnicate").want(t, exitUsage, "unknown command")
	txoutbox(t, "", "status", "--bogus").want(t, exitUsage, "flag provided but not defined")
	txoutbox(t, "", "status").want(t, exitUsage, "no database URL")
	txoutbox(t, "ftp://x/y", "status").want(t, exitUsage, "scheme")
	txoutbox(t, "sqlite://"+filepath.Join(t.TempDir(), "missing.db"), "status").want(t, exitError, "migrate up")
	for _, c := range commands {
		r := txoutbox(t, "", append(strings.Fields(c.name), "--help")...)
		r.want(t, 0, "Usage: txoutbox "+c.name, "Example:", "txoutbox "+c.name, "-database-url")
		txoutbox(t, "", "help", c.name).want(t, 0, "Example:")
	}
}

// TestNoPasswordInAnyOutput runs every command, on its error paths and with
// --json, against URLs holding a password (from the environment and from
// the flag), and checks that the password appears nowhere.
func TestNoPasswordInAnyOutput(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-Pa55"
	urls := []string{
		"postgres://user:" + secret + "@db.internal:5432/app?sslmode=disable",
		"postgresql://user:" + secret + "@pooler.example.com:6543/app",
		"mysql://user:" + secret + "@tcp(db:3306)/app",
		"postgres://db/app?user=u&password=" + secret,
		"sqlite://user:" + secret + "@host/x.db",
	}
	var runs [][]string
	for _, c := range commands {
		args := strings.Fields(c.name)
		runs = append(runs, args, append(slices.Clone(args), "--json"), append(slices.Clone(args), "--help"))
	}
	runs = append(runs, []string{"dead", "show", "1"}, []string{"skip", "1", "--reason", "x"}, []string{"redrive", "--all"},
		[]string{"purge", "--older-than", "1h"}, []string{"nope"})
	for _, u := range urls {
		for _, args := range runs {
			for _, viaFlag := range []bool{false, true} {
				env, a := u, args
				if viaFlag {
					env, a = "", append([]string{args[0], "--database-url", u}, args[1:]...)
					if len(args) > 1 && !strings.HasPrefix(args[1], "-") && findCommand(args[:2]) != nil {
						a = append([]string{args[0], args[1], "--database-url=" + u}, args[2:]...)
					}
				}
				r := txoutbox(t, env, a...)
				if strings.Contains(r.stdout+r.stderr, secret) {
					t.Errorf("txoutbox %v with %s: password in output:\n%s%s", a, u, r.stdout, r.stderr)
				}
			}
		}
	}
}

func TestRedact(t *testing.T) {
	t.Parallel()
	r := newRedactor("postgres://u:p%40ss-word@h/db")
	for in, want := range map[string]string{
		"dial postgres://u:p%40ss-word@h/db: refused":       "dial postgres://u:xxxxx@h/db: refused",
		"password authentication failed: p@ss-word":         "password authentication failed: xxxxx",
		"conn string host=h password=hunter2 user=u":        "conn string host=h password=xxxxx user=u",
		"mysql://root:toor@tcp(h:3306)/x and amqp://g:g@h/": "mysql://root:xxxxx@tcp(h:3306)/x and amqp://g:xxxxx@h/",
		"no secrets here": "no secrets here",
	} {
		if got := r.redact(in); got != want {
			t.Errorf("redact(%q) = %q, want %q", in, got, want)
		}
	}
	if got := displayURL("postgres://u:pw123@h/db", newRedactor("postgres://u:pw123@h/db")); got != "postgres://u:xxxxx@h/db" {
		t.Errorf("displayURL = %q", got)
	}
}

// TestDoctorBehindPgBouncer runs doctor through PgBouncer in transaction
// mode (Debian's package, run by the test): the command works through it
// and reports that LISTEN does not.
func TestDoctorBehindPgBouncer(t *testing.T) {
	t.Parallel()
	direct, schema := pgSchemaURL(t)
	txoutbox(t, direct, "migrate", "up").want(t, 0, "migrated from version 0 to")
	bouncer := pgbouncertest.Start(t, pgTestURL())
	r := txoutbox(t, bouncer, "doctor", "--table", schema+".outbox")
	r.want(t, 0, "LISTEN", "transaction-mode pooler", "Storage.Listen")
	if strings.Contains(r.stdout, "problem") {
		t.Fatalf("doctor through PgBouncer found a problem:\n%s", r.stdout)
	}
	txoutbox(t, direct, "doctor").want(t, 0, "LISTEN works")
}
