package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	mysqldrv "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"

	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// handMade is a database and table nothing has created yet, the client
// that runs a script on it as an operator would (psql, mariadb, sqlite3:
// the script on stdin), and a func executing one query as a migration tool
// would (a multi-statement query: golang-migrate runs a file so).
type handMade struct {
	kind   string
	url    string // the command's URL
	table  string // --table
	client func(t *testing.T, script string)
	// clientFails pipes a script the client must stop in with want (SQLite).
	clientFails func(t *testing.T, script, want string)
	exec        func(t *testing.T, query string)
}

func newHandMade(t *testing.T, kind string) handMade {
	t.Helper()
	var b [6]byte
	_, _ = rand.Read(b[:])
	suffix := hex.EncodeToString(b[:])
	ctx := context.Background()
	switch kind {
	case "postgres":
		u, schema := pgSchemaURL(t)
		pool := pgPool(t, pgTestURL())
		return handMade{kind: kind, url: u, table: schema + ".outbox",
			client: func(t *testing.T, script string) {
				t.Helper()
				runClient(t, script, "psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", pgTestURL())
			},
			exec: func(t *testing.T, q string) {
				t.Helper()
				if _, err := pool.Exec(ctx, q, pgx.QueryExecModeSimpleProtocol); err != nil {
					t.Fatalf("%v\n%s", err, q)
				}
			}}
	case "mysql":
		db := mysqlDB(t)
		table := "txo_cmd_sql_" + suffix
		t.Cleanup(func() {
			_, _ = db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_skipped, " + table + "_migrations, " + table + "_keys, " + table + "_inbox")
		})
		cfg, err := mysqldrv.ParseDSN(mysqlTestDSN())
		if err != nil {
			t.Fatal(err)
		}
		host, port, _ := strings.Cut(cfg.Addr, ":")
		args := []string{"--batch", "-h", host, "-P", port, "-u", cfg.User}
		if cfg.Passwd != "" {
			args = append(args, "-p"+cfg.Passwd)
		}
		multi := cfg.Clone()
		multi.MultiStatements = true
		mdb, err := sql.Open("mysql", multi.FormatDSN())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = mdb.Close() })
		return handMade{kind: kind, url: mysqlURL(t), table: table,
			client: func(t *testing.T, script string) {
				t.Helper()
				runClient(t, script, "mariadb", append(args, cfg.DBName)...)
			},
			exec: func(t *testing.T, q string) {
				t.Helper()
				if _, err := mdb.Exec(q); err != nil {
					t.Fatalf("%v\n%s", err, q)
				}
			}}
	default:
		path := filepath.Join(t.TempDir(), "hand.db")
		db, err := sqlite.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		return handMade{kind: kind, url: "sqlite://" + path, table: "outbox",
			client: func(t *testing.T, script string) {
				t.Helper()
				runClient(t, script, "sqlite3", "-bail", path)
			},
			clientFails: func(t *testing.T, script, want string) {
				t.Helper()
				out, err := clientOutput(t, script, "sqlite3", "-bail", path)
				if err == nil || !strings.Contains(out, want) {
					t.Fatalf("sqlite3 < migrate sql = %v, want it to stop at %q:\n%s", err, want, out)
				}
			},
			exec: func(t *testing.T, q string) {
				t.Helper()
				if _, err := db.Exec(q); err != nil {
					t.Fatalf("%v\n%s", err, q)
				}
			}}
	}
}

// runClient pipes script into a database's own command-line client.
func runClient(t *testing.T, script, name string, args ...string) {
	t.Helper()
	if _, err := exec.LookPath(name); err != nil {
		msg := fmt.Sprintf("%s is not installed: %v", name, err)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	if out, err := clientOutput(t, script, name, args...); err != nil {
		t.Fatalf("%s < migrate sql: %v\n%s", name, err, out)
	}
}

// clientOutput pipes script into a database's own command-line client and
// returns what it printed.
func clientOutput(t *testing.T, script, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdin = strings.NewReader(script)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// checkHandMade: the schema made by hand is at the latest version, migrate
// up has nothing to do, and doctor finds it as the migrations make it.
func checkHandMade(t *testing.T, h handMade) {
	t.Helper()
	r := txoutbox(t, h.url, "migrate", "status", "--table", h.table, "--json")
	r.want(t, 0)
	var st struct {
		Current int `json:"current_version"`
		Latest  int `json:"latest_version"`
	}
	r.json(t, &st)
	if st.Current != st.Latest {
		t.Fatalf("a schema made from migrate sql is at version %d, want %d", st.Current, st.Latest)
	}
	txoutbox(t, h.url, "migrate", "up", "--table", h.table).want(t, 0, "already at version")
	r = txoutbox(t, h.url, "doctor", "--table", h.table)
	r.want(t, 0)
	for _, l := range strings.Split(r.stdout, "\n") {
		if strings.HasPrefix(l, "schema") && !strings.Contains(l, " ok ") {
			t.Errorf("doctor: %s", l)
		}
	}
	txoutbox(t, h.url, "status", "--table", h.table).want(t, 0, "pending")
}

// TestMigrateSQLRunsAsAScript pipes `txoutbox migrate sql` into psql,
// mariadb and sqlite3, as a DBA would, on a database nothing has touched:
// the script runs (MySQL's needed semicolons between its statements), and
// the schema it makes is recorded at the latest version, so migrate up
// re-creates nothing (on PostgreSQL, the indexes a later step dropped).
func TestMigrateSQLRunsAsAScript(t *testing.T) {
	for _, kind := range []string{"postgres", "mysql", "sqlite"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			h := newHandMade(t, kind)
			r := txoutbox(t, h.url, "migrate", "sql", "--table", h.table)
			r.want(t, 0)
			h.client(t, r.stdout)
			checkHandMade(t, h)
			// Again, as a re-run of a deploy script would: nothing changes.
			// SQLite's step 3 adds a column, and SQLite has no ADD COLUMN IF
			// NOT EXISTS: there the re-run stops at it (sqlite3 -bail), after
			// step 1 made again two indexes step 4 dropped, which the doctor
			// reports. The operations guide says not to re-run it.
			if kind == "sqlite" {
				h.clientFails(t, r.stdout, "duplicate column name: hold")
				return
			}
			h.client(t, r.stdout)
			checkHandMade(t, h)
		})
	}
}

// TestMigrateSQLFilesRunAsMigrationToolsRunThem writes the steps as
// golang-migrate and goose files and runs them as those tools do:
// golang-migrate sends each file as one query (multiStatements=true on
// MySQL); goose splits a file at the semicolons that end a line, except
// inside a StatementBegin/StatementEnd block, which it sends whole.
func TestMigrateSQLFilesRunAsMigrationToolsRunThem(t *testing.T) {
	for _, kind := range []string{"postgres", "mysql", "sqlite"} {
		for _, format := range []string{"golang-migrate", "goose"} {
			t.Run(kind+"/"+format, func(t *testing.T) {
				t.Parallel()
				h := newHandMade(t, kind)
				dir := t.TempDir()
				txoutbox(t, h.url, "migrate", "sql", "--table", h.table, "--dir", dir, "--format", format).want(t, 0)
				files, err := filepath.Glob(filepath.Join(dir, "*.sql"))
				if err != nil {
					t.Fatal(err)
				}
				slices.Sort(files)
				for _, f := range files {
					if strings.HasSuffix(f, ".down.sql") {
						continue
					}
					b, err := os.ReadFile(f)
					if err != nil {
						t.Fatal(err)
					}
					if format == "golang-migrate" {
						h.exec(t, string(b))
						continue
					}
					for _, q := range gooseStatements(t, string(b)) {
						h.exec(t, q)
					}
				}
				checkHandMade(t, h)
			})
		}
	}
}

// gooseStatements splits the Up section of a goose file as goose does.
func gooseStatements(t *testing.T, text string) []string {
	t.Helper()
	var (
		out           []string
		cur           strings.Builder
		up, inBlock   bool
		sawUp, sawEnd bool
	)
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := sc.Text()
		switch strings.TrimSpace(line) {
		case "-- +goose Up":
			up, sawUp = true, true
			continue
		case "-- +goose Down":
			up = false
			continue
		case "-- +goose StatementBegin":
			inBlock = true
			continue
		case "-- +goose StatementEnd":
			inBlock, sawEnd = false, true
			if up {
				out = append(out, cur.String())
			}
			cur.Reset()
			continue
		}
		if !up {
			continue
		}
		cur.WriteString(line + "\n")
		if !inBlock && strings.HasSuffix(strings.TrimSpace(line), ";") {
			out = append(out, cur.String())
			cur.Reset()
		}
	}
	if !sawUp || (strings.Contains(text, "StatementBegin") && !sawEnd) {
		t.Fatalf("not a goose file:\n%s", text)
	}
	if strings.TrimSpace(cur.String()) != "" && up {
		t.Fatalf("goose would not run the SQL after the last semicolon: %q", cur.String())
	}
	return out
}

// TestMigrateUpRefusesAnotherTable: migrate up on a database where a table
// of the outbox's name is another application's (other columns) refuses,
// naming the columns it lacks, and records no version.
func TestMigrateUpRefusesAnotherTable(t *testing.T) {
	for _, kind := range []string{"postgres", "mysql", "sqlite"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			h := newHandMade(t, kind)
			h.exec(t, "CREATE TABLE "+h.table+" (id BIGINT PRIMARY KEY, note TEXT)")
			txoutbox(t, h.url, "migrate", "up", "--table", h.table).want(t, exitError, "exists but has no column uuid, topic,", "not an outbox table")
			r := txoutbox(t, h.url, "migrate", "status", "--table", h.table, "--json")
			var st struct {
				Current int `json:"current_version"`
			}
			r.json(t, &st)
			if st.Current != 0 {
				t.Fatalf("after the refused migrate up the schema is at version %d, want 0", st.Current)
			}
		})
	}
}

// TestMigrateSQLDownThenUp pipes `migrate sql --down` into psql, mariadb
// and sqlite3 on a schema migrate up made, then runs migrate up: the
// schema is whole again (doctor finds every index; the version says so).
// A down step is given only where every later step has one, so the script
// reverts from the latest step: it never reverts a middle step under
// later ones still recorded, which migrate up could not see to repair.
func TestMigrateSQLDownThenUp(t *testing.T) {
	for _, kind := range []string{"postgres", "mysql", "sqlite"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			h := newHandMade(t, kind)
			txoutbox(t, h.url, "migrate", "up", "--table", h.table).want(t, 0, "migrated from version 0")
			r := txoutbox(t, h.url, "migrate", "sql", "--down", "--table", h.table)
			r.want(t, 0)
			h.client(t, r.stdout)
			txoutbox(t, h.url, "migrate", "up", "--table", h.table).want(t, 0)
			checkHandMade(t, h)
		})
	}
}
