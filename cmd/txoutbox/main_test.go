package main

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	mysqldrv "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox/internal/pgbouncertest"
	"github.com/txoutbox/txoutbox/storage"
	mysqlstore "github.com/txoutbox/txoutbox/storage/mysql"
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
	for _, a := range append([]string{dbURL}, args...) {
		if p := urlPassword(a); len(p) >= 3 && strings.Contains(r.stdout+r.stderr, p) {
			t.Errorf("txoutbox %v: the URL's password is in the output:\n%s%s", args, r.stdout, r.stderr)
		}
	}
	return r
}

// urlPassword is the password of a database URL (either mysql:// form), or "".
func urlPassword(raw string) string {
	if scheme, _, _ := strings.Cut(raw, ":"); strings.EqualFold(scheme, "mysql") {
		if cfg, err := mysqlConfig(raw); err == nil {
			return cfg.Passwd
		}
	}
	if u, err := url.Parse(raw); err == nil && u.User != nil {
		p, _ := u.User.Password()
		return p
	}
	return ""
}

// ignoredPassword goes into the URLs of the fixtures whose server does not
// check it (a SQLite file, PostgreSQL with trust authentication), so that
// every process test also checks that no output shows it.
const ignoredPassword = "pw-Ign0red-by-server"

// withPassword adds ignoredPassword to a URL that has none.
func withPassword(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.User == nil {
		if err == nil && u.Host != "" {
			u.User = url.UserPassword("", ignoredPassword)
			return u.String()
		}
		return raw
	}
	if _, ok := u.User.Password(); ok {
		return raw
	}
	u.User = url.UserPassword(u.User.Username(), ignoredPassword)
	return u.String()
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

// fixture is a migrated outbox (SQLite file, PostgreSQL schema or MySQL
// table of its own) with records in every state:
//
//	a1 dead (poison), a2 a3 pending behind it; b1 dead; c1 leased, c2 behind
//	it; d1 delivered (an hour ago, by the storage's clock); k keyless pending.
type fixture struct {
	kind  string // sqlite, postgres or mysql
	url   string
	table string // the outbox table; "" for the command's default, outbox
	s     opStorage
	// exec runs a statement of the fixture's SQL dialect.
	exec func(t *testing.T, query string, args ...any)
	// begin starts a transaction for Insert.
	begin func(t *testing.T) (tx any, commit func() error)
	ids   map[string]int64
}

// run runs the command on the fixture's database and table.
func (f fixture) run(t *testing.T, args ...string) result {
	t.Helper()
	if f.table != "" {
		args = append(slices.Clone(args), "--table", f.table)
	}
	return txoutbox(t, f.url, args...)
}

// sql runs a statement of the fixture's dialect on its database; {table}
// stands for the outbox table.
func (f fixture) sql(t *testing.T, query string, args ...any) {
	t.Helper()
	f.exec(t, strings.ReplaceAll(query, "{table}", cmp.Or(f.table, "outbox")), args...)
}

// backends lists the fixtures every process test runs on.
var backends = []struct {
	name string
	open func(t *testing.T) fixture
}{
	{"sqlite", openSQLiteFixture},
	{"postgres", openPostgresFixture},
	{"mysql", openMySQLFixture},
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
	url := "sqlite://user:" + ignoredPassword + "@localhost" + filepath.ToSlash(path) // the password goes unused
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
	url = withPassword(url) // trust authentication ignores it; when the URL has one, that one
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

// mysqlTestDSN is the MySQL test database: TEST_MYSQL_DSN or the local
// MariaDB, as the driver spells it.
func mysqlTestDSN() string {
	return cmp.Or(os.Getenv("TEST_MYSQL_DSN"), "root@tcp(127.0.0.1:3306)/test")
}

// mysqlDB connects to the MySQL test database, skipping the test when it
// does not answer (failing with CI=true).
func mysqlDB(t *testing.T) *sql.DB {
	t.Helper()
	db, err := sql.Open("mysql", mysqlTestDSN())
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = db.PingContext(ctx)
		cancel()
		if err != nil {
			_ = db.Close()
		}
	}
	if err != nil {
		msg := fmt.Sprintf("MySQL not reachable at TEST_MYSQL_DSN (default root@tcp(127.0.0.1:3306)/test): %v; "+
			"start MariaDB with: start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd", err)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// mysqlURL is the command's mysql:// URL for the test database.
func mysqlURL(t *testing.T) string {
	t.Helper()
	cfg, err := mysqldrv.ParseDSN(mysqlTestDSN())
	if err != nil {
		t.Fatalf("TEST_MYSQL_DSN: %v", err)
	}
	u := &url.URL{Scheme: "mysql", Host: cfg.Addr, Path: "/" + cfg.DBName, User: url.User(cfg.User)}
	if cfg.Passwd != "" {
		u.User = url.UserPassword(cfg.User, cfg.Passwd)
	}
	return u.String()
}

// openMySQLFixture makes an outbox table of the test's own in the shared
// test database (its tables are dropped at the end).
func openMySQLFixture(t *testing.T) fixture {
	t.Helper()
	db := mysqlDB(t)
	var b [6]byte
	_, _ = rand.Read(b[:])
	table := "txo_cmd_" + hex.EncodeToString(b[:])
	t.Cleanup(func() {
		_, _ = db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_skipped, " + table + "_migrations, " + table + "_keys, " + table + "_inbox")
	})
	url := mysqlURL(t)
	txoutbox(t, url, "migrate", "up", "--table", table).want(t, 0, "migrated from version 0 to")
	s, err := mysqlstore.New(db, mysqlstore.Config{Table: table, HoldOnDeadLetter: true})
	if err != nil {
		t.Fatal(err)
	}
	return fixture{kind: "mysql", url: url, table: table, s: s,
		exec: func(t *testing.T, q string, args ...any) {
			t.Helper()
			if _, err := db.Exec(q, args...); err != nil {
				t.Fatalf("%s: %v", q, err)
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
	ref := func(n string) storage.ClaimRef { return storage.ClaimRef{ID: ids[n], Attempt: 1} } // first claims
	for _, n := range []string{"a1", "b1"} {
		if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: ref(n), WorkerID: "fwd-1", Error: "broker said no: " + n}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Ack(ctx, storage.AckParams{Records: []storage.ClaimRef{ref("d1")}, WorkerID: "fwd-1"}); err != nil {
		t.Fatal(err)
	}
	switch f.kind {
	case "postgres":
		f.sql(t, `UPDATE {table}_delivered SET delivered_at = delivered_at - interval '1 hour' WHERE id = $1`, ids["d1"])
	case "mysql":
		f.sql(t, `UPDATE {table} SET delivered_at = delivered_at - INTERVAL 1 HOUR WHERE id = ?`, ids["d1"])
	default:
		f.sql(t, `UPDATE {table} SET delivered_at = delivered_at - ? WHERE id = ?`, int64(time.Hour), ids["d1"])
	}
	f.ids = ids
	return f
}

func TestMigrate(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		f.run(t, "migrate", "up").want(t, 0, "already at version")
		r := f.run(t, "migrate", "status", "--json")
		r.want(t, 0)
		var st struct {
			Current int `json:"current_version"`
			Latest  int `json:"latest_version"`
			Applied []struct {
				Version int `json:"version"`
			} `json:"applied"`
		}
		r.json(t, &st)
		migs := f.s.(storage.Migrator).Migrations()
		latest, lastName := migs[len(migs)-1].Version, migs[len(migs)-1].Name
		if st.Current != latest || st.Latest != st.Current || len(st.Applied) != st.Current {
			t.Fatalf("migrate status: %+v", st)
		}
		f.run(t, "migrate", "status").want(t, 0, "VERSION", lastName)
		txoutbox(t, "", "--database-url", f.url, "--table", cmp.Or(f.table, "outbox"), "--json", "migrate", "status").want(t, 0, `"current_version"`) // shared flags first

		// Behind: exit 3, and the operating commands refuse to run.
		f.sql(t, fmt.Sprintf(`DELETE FROM {table}_migrations WHERE version = %d`, latest))
		f.run(t, "migrate", "status").want(t, exitAttention, "not applied")
		f.run(t, "status").want(t, exitError, "run `txoutbox migrate up`")
		f.run(t, "migrate", "up").want(t, 0, fmt.Sprintf("to %d", latest))

		// migrate sql needs the scheme only and connects nowhere.
		scheme := f.kind + ":"
		switch f.kind {
		case "postgres":
			r = txoutbox(t, scheme, "migrate", "sql", "--table", "app.events", "--notify-channel", "wake")
			r.want(t, 0, `CREATE TABLE IF NOT EXISTS "app"."events"`, `"app"."events_leases"`, "-- txoutbox migration 2", "pg_notify('wake'")
			txoutbox(t, scheme, "migrate", "sql", "--down").want(t, 0, "-- no down step")
		case "mysql":
			r = txoutbox(t, scheme, "migrate", "sql", "--table", "events")
			r.want(t, 0, "CREATE TABLE IF NOT EXISTS `events`", "CREATE TABLE IF NOT EXISTS `events_skipped`", "-- txoutbox migration 2")
			txoutbox(t, "mysql://app:"+ignoredPassword+"@nowhere.invalid/app", "migrate", "sql", "--table", "app.events").want(t, 0, "CREATE TABLE IF NOT EXISTS `app`.`events`")
			txoutbox(t, scheme, "migrate", "sql", "--down").want(t, 0, "-- no down step")
		default:
			r = txoutbox(t, scheme, "migrate", "sql", "--table", "events")
			r.want(t, 0, `CREATE TABLE IF NOT EXISTS "events"`, "-- txoutbox migration 2")
			txoutbox(t, scheme, "migrate", "sql", "--down").want(t, 0, `DROP INDEX IF EXISTS "outbox_failed_key"`)
		}
		for _, format := range []string{"golang-migrate", "goose"} {
			dir := t.TempDir()
			txoutbox(t, scheme, "migrate", "sql", "--dir", dir, "--format", format).want(t, 0, "001_txoutbox_create_outbox")
			entries, _ := os.ReadDir(dir)
			want := 2 * latest
			if format == "goose" {
				want = latest
			}
			if len(entries) != want {
				t.Fatalf("%s: %d files, want %d", format, len(entries), want)
			}
		}
		txoutbox(t, scheme, "migrate", "sql", "--dir", t.TempDir(), "--format", "flyway").want(t, exitUsage, "--format")
	})
}

func TestStatus(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		// One inbox entry, received at a known time.
		received := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
		tx, seen, err := f.s.(interface{ Inbox() storage.InboxStore }).Inbox().BeginInbox(context.Background(),
			storage.InboxParams{Consumer: "billing", UUID: "u-1", ReceivedAt: received})
		if err != nil || seen {
			t.Fatal(seen, err)
		}
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
		r := f.run(t, "status", "--hold-on-dead-letter", "--json")
		r.want(t, exitAttention)
		var st struct {
			Pending, Leased, Dead, Delivered, Forwarders int64
			InboxEntries                                 int64     `json:"inbox_entries"`
			InboxOldest                                  time.Time `json:"inbox_oldest_received_at"`
			HeldKeyCount                                 int64     `json:"held_key_count"`
			HeldKeys                                     []struct {
				Key      string `json:"key"`
				HeadID   int64  `json:"head_id"`
				Reason   string `json:"reason"`
				LeasedBy string `json:"leased_by"`
				Behind   int64  `json:"behind"`
			} `json:"held_keys"`
		}
		r.json(t, &st)
		if st.Pending != 5 || st.Leased != 1 || st.Dead != 2 || st.Delivered != 1 || st.Forwarders != 1 || st.HeldKeyCount != 3 ||
			st.InboxEntries != 1 || !st.InboxOldest.Equal(received) {
			t.Fatalf("status: %+v", st)
		}
		got := fmt.Sprint(st.HeldKeys)
		want := fmt.Sprintf("[{a %d dead  2} {b %d dead  0} {c %d leased fwd-1 1}]", f.ids["a1"], f.ids["b1"], f.ids["c1"])
		if got != want {
			t.Fatalf("held keys %s, want %s", got, want)
		}
		// Without --hold-on-dead-letter, the SQLite storage still counts the
		// keys held by records dead-lettered with HoldOnDeadLetter: the record
		// says so, and holds its key for every storage on the table.
		heldByDead := map[bool]string{false: "0", true: "2"}[f.kind == "sqlite"]
		f.run(t, "status").want(t, exitAttention, "forwarders seen", "leased by fwd-1 until", "inbox oldest entry", "2026-01-02T03:04:05Z",
			"2 dead record(s), "+heldByDead+" key(s) held by a failing or dead record")
		// Only a key held by a record in flight: nothing needs an operator.
		if n, err := f.s.Redrive(context.Background(), storage.RedriveParams{All: true}); err != nil || n != 2 {
			t.Fatal(n, err)
		}
		f.run(t, "status", "--hold-on-dead-letter").want(t, 0, "leased by fwd-1")
	})
}

func TestDeadListAndShow(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		r := f.run(t, "dead", "list", "--json")
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
			f.run(t, append([]string{"dead", "list", "--json"}, c.args...)...).json(t, &page)
			var got []int64
			for _, p := range page {
				got = append(got, p.ID)
			}
			if !slices.Equal(got, c.want) {
				t.Errorf("dead list %v = %v, want %v", c.args, got, c.want)
			}
		}
		f.run(t, "dead", "list").want(t, 0, "ID", "ERROR", "broker said no: a1")

		r = f.run(t, "dead", "show", fmt.Sprint(f.ids["a1"]), "--json")
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
		f.run(t, "dead", "show", fmt.Sprint(f.ids["a1"])).want(t, 0, "payload (text)", `{"name":"a1"}`, "metadata trace", "broker said no: a1")
		f.run(t, "dead", "show", "999").want(t, exitNotFound, "not found")
		f.run(t, "dead", "show").want(t, exitUsage, "record ID")
		f.run(t, "dead", "show", "abc").want(t, exitUsage, "positive integer")
	})
}

func TestRedrive(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		f.run(t, "redrive").want(t, exitUsage, "exactly one of")
		f.run(t, "redrive", "--key", "a", "--all").want(t, exitUsage, "exactly one of")

		r := f.run(t, "redrive", "--all", "--dry-run", "--json")
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
		f.run(t, "redrive", "--id", fmt.Sprintf("%d,%d", f.ids["a1"], f.ids["a2"]), "--dry-run").want(t, 0, fmt.Sprintf("would re-drive 1 dead record(s): %d", f.ids["a1"]))
		if st, _ := f.s.Stats(context.Background()); st.Dead != 2 {
			t.Fatalf("dry run changed something: %+v", st)
		}
		f.run(t, "redrive", "--key", "a").want(t, 0, "re-drove 1 dead record(s)")
		f.run(t, "redrive", "--key", "a").want(t, 0, "re-drove 0 dead record(s)") // idempotent
		f.run(t, "redrive", "--topic", "invoices").want(t, 0, "re-drove 1 dead record(s)")
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
		f.run(t, "skip", a1).want(t, exitUsage, "--reason is required")
		f.run(t, "skip", fmt.Sprint(f.ids["a2"]), "--reason", "x").want(t, exitNotFound, "not dead-lettered")
		f.run(t, "skip", "999", "--reason", "x").want(t, exitNotFound, "not found")
		f.run(t, "skip", a1, "--reason", "customer deleted, OPS-1").want(t, 0, "skipped record "+a1)
		r := f.run(t, "dead", "show", a1, "--json")
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

		f.run(t, "purge").want(t, exitUsage, "--older-than is required")
		f.run(t, "purge", "--older-than", "2h").want(t, 0, "purged 0 delivered record(s)")
		f.run(t, "purge", "--older-than", "30m", "--json").want(t, 0, `"purged": 1`)
	})
}

func TestDoctor(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		// Per database: an index re-created on other columns and what doctor
		// says of it, then an index dropped and what doctor says of that.
		var alter, altered, drop, dropped string
		switch f.kind {
		case "postgres":
			f.run(t, "doctor").want(t, 0, "schema version", "schema drift", "privileges", "connection pooler", "LISTEN works")
			// The forwarders' NotifyChannel: its trigger is missing until
			// migrate up is told the channel.
			f.run(t, "doctor", "--notify-channel", "wake").want(t, exitAttention, "migrate up --notify-channel wake")
			f.run(t, "migrate", "up", "--notify-channel", "wake").want(t, 0)
			f.run(t, "doctor", "--notify-channel", "wake").want(t, 0, "notifies channel wake")
			alter = `DROP INDEX outbox_dead_idx; CREATE INDEX outbox_dead_idx ON outbox (key, id) WHERE status = 'dead'`
			altered = `index outbox_dead_idx differs: found "btree (key, id) WHERE status = 'dead'::text", expected "btree (topic, id) WHERE status = 'dead'::text"`
			drop, dropped = `DROP INDEX outbox_dead_key_idx`, "index outbox_dead_key_idx is missing"
		case "mysql":
			f.run(t, "doctor").want(t, 0, "schema version", "schema drift", "privileges", "server version", "binary log")
			alter = "ALTER TABLE {table} DROP INDEX key_idx, ADD INDEX key_idx (`key`, id)"
			altered = "index key_idx of `" + f.table + "` differs: found (key, id), expected (key, status, id)"
			drop, dropped = `ALTER TABLE {table} DROP INDEX done_idx`, "index done_idx of `"+f.table+"` is missing"
		default:
			f.run(t, "doctor").want(t, 0, "schema version", "schema drift", "journal mode", "wal")
			alter = `DROP INDEX outbox_dead_topic; CREATE INDEX outbox_dead_topic ON outbox (key, id) WHERE status = 'dead'`
			altered = `outbox_dead_topic differs: found "CREATE INDEX outbox_dead_topic ON outbox (key, id) WHERE status = 'dead'", expected "CREATE INDEX \"outbox_dead_topic\" ON \"outbox\" (topic, id) WHERE status = 'dead'"`
			drop, dropped = `DROP INDEX outbox_dead_key`, "outbox_dead_key is missing"
		}
		f.sql(t, alter)
		f.run(t, "doctor").want(t, exitAttention, "schema drift", altered, "doctor found 1 problem(s)")
		f.sql(t, drop)
		r := f.run(t, "doctor", "--json")
		r.want(t, exitAttention, dropped)
		var findings []struct{ Check, Severity, Message string }
		r.json(t, &findings)
		if len(findings) < 4 {
			t.Fatalf("findings: %+v", findings)
		}
		for _, g := range findings {
			if g.Check == "schema drift" && (g.Severity != "problem" || !strings.Contains(g.Message, altered)) {
				t.Fatalf("schema drift with an altered and a dropped index: %+v", g)
			}
		}
		f.sql(t, `UPDATE {table}_migrations SET version = 99 WHERE version = 1`)
		f.run(t, "doctor").want(t, exitAttention, "newer than this build")
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
// the flag), and checks that the password appears nowhere. The process
// tests of every backend (forEachBackend) check it on the success paths:
// their URLs hold a password the server ignores (SQLite, PostgreSQL with
// trust authentication), or the test database's own.
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
	// A real server refusing the password: the MySQL test database.
	if cfg, err := mysqldrv.ParseDSN(mysqlTestDSN()); err == nil {
		urls = append(urls, "mysql://"+cfg.User+":"+secret+"@"+cfg.Addr+"/"+cfg.DBName,
			"mysql://"+cfg.User+":"+secret+"@tcp("+cfg.Addr+")/"+cfg.DBName)
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
	for in, want := range map[string]string{
		"dial postgres://u:p%40ss-word@h/db: refused":       "dial postgres://u:xxxxx@h/db: refused",
		"conn string host=h password=hunter2 user=u":        "conn string host=h password=xxxxx user=u",
		"mysql://root:toor@tcp(h:3306)/x and amqp://g:g@h/": "mysql://root:xxxxx@tcp(h:3306)/x and amqp://g:xxxxx@h/",
		"dsn root:toor@tcp(h:3306)/x, (app:p@ss@unix(/s))":  "dsn root:xxxxx@tcp(h:3306)/x, (app:xxxxx@unix(/s))",
		"postgres://u:p@ss@h/db?password=x&sslmode=require": "postgres://u:xxxxx@h/db?password=xxxxx&sslmode=require",
		// Only URLs and DSNs: the words of a message stay, whatever the password.
		"role postgres has what a forwarder needs; dead: true": "role postgres has what a forwarder needs; dead: true",
		"password authentication failed for user \"u\"":        "password authentication failed for user \"u\"",
		"no secrets here": "no secrets here",
	} {
		if got := redact(in); got != want {
			t.Errorf("redact(%q) = %q, want %q", in, got, want)
		}
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
