package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/txoutbox/txoutbox/storage"
)

// TestPgBouncerParameter: pgbouncer=true, the way Prisma (and many
// DATABASE_URLs) mark a transaction-mode pooler, is accepted: the command
// already uses the simple protocol, and doctor still notes the pooler.
func TestPgBouncerParameter(t *testing.T) {
	t.Parallel()
	f := fill(t, openPostgresFixture(t))
	u := f.url + "&pgbouncer=true"
	txoutbox(t, u, "status").want(t, exitAttention, "dead")
	txoutbox(t, u, "doctor").want(t, 0, "pgbouncer=true is set", "LISTEN works")
	txoutbox(t, f.url+"&pgbouncer=false", "dead", "list").want(t, 0, "broker said no")
}

// TestDatabaseNewerThanBinary: a schema version this build does not know
// fails migrate status (a deploy gate must not pass an old binary), and no
// command advises migrate up, which would refuse.
func TestDatabaseNewerThanBinary(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		migs := f.s.(storage.Migrator).Migrations()
		newer := migs[len(migs)-1].Version + 1
		switch f.kind {
		case "mysql":
			f.sql(t, `INSERT INTO {table}_migrations (version, name, applied_at) VALUES (?, 'from_the_future', UTC_TIMESTAMP(6))`, newer)
		case "postgres":
			f.sql(t, `INSERT INTO {table}_migrations (version, name) VALUES ($1, 'from_the_future')`, newer)
		default:
			f.sql(t, `INSERT INTO {table}_migrations (version, name, applied_at) VALUES (?, 'from_the_future', 0)`, newer)
		}
		r := f.run(t, "migrate", "status")
		if r.code == 0 || !strings.Contains(r.stdout+r.stderr, "newer than this build") {
			t.Fatalf("migrate status on a newer database: exit %d\n%s%s", r.code, r.stdout, r.stderr)
		}
		for _, args := range [][]string{{"status"}, {"dead", "list"}, {"migrate", "status"}} {
			r := f.run(t, args...)
			if r.code == 0 || strings.Contains(r.stdout+r.stderr, "migrate up") || !strings.Contains(r.stdout+r.stderr, "newer") {
				t.Errorf("txoutbox %v on a newer database: exit %d, want an error saying it is newer, not advising migrate up\n%s%s", args, r.code, r.stdout, r.stderr)
			}
		}
	})
}

// TestMistypedTable: a table that is not there is named as missing, not
// as a schema to migrate (migrate up would create a stray empty table).
func TestMistypedTable(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		table := cmp2(f.table, "outbox") + "_typo"
		for _, args := range [][]string{{"status"}, {"dead", "list"}, {"redrive", "--all"}, {"skip", "1", "--reason", "x"}} {
			r := txoutbox(t, f.url, append(args, "--table", table)...)
			if r.code != exitError || strings.Contains(r.stderr, "migrate up") || !strings.Contains(r.stderr, "does not exist") || !strings.Contains(r.stderr, "--table") {
				t.Errorf("txoutbox %v --table %s: exit %d, want 1 saying the table does not exist\n%s", args, table, r.code, r.stderr)
			}
		}
		r := txoutbox(t, f.url, "migrate", "status", "--table", table)
		r.want(t, exitAttention, "does not exist")
	})
}

func cmp2(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// TestConcurrentMigrateUp: of runs started together on an empty database,
// exactly one says it applied the steps; the others say another run did.
func TestConcurrentMigrateUp(t *testing.T) {
	for _, kind := range []string{"sqlite", "postgres", "mysql"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			dbURL, table := emptyDB(t, kind)
			const runs = 4
			results := make([]result, runs)
			var wg sync.WaitGroup
			for i := range runs {
				wg.Go(func() { results[i] = txoutbox(t, dbURL, "migrate", "up", "--table", table, "--json") })
			}
			wg.Wait()
			applied := 0
			for _, r := range results {
				r.want(t, 0)
				var v struct {
					From    int   `json:"from_version"`
					To      int   `json:"to_version"`
					Applied []int `json:"applied"`
				}
				r.json(t, &v)
				if len(v.Applied) > 0 {
					applied++
					if v.Applied[0] != 1 || v.Applied[len(v.Applied)-1] != v.To {
						t.Errorf("applied %v, want 1 to %d", v.Applied, v.To)
					}
				}
			}
			if applied != 1 {
				t.Fatalf("%d runs say they applied steps, want 1:\n%+v", applied, results)
			}
			txoutbox(t, dbURL, "migrate", "up", "--table", table).want(t, 0, "already at version")
		})
	}
}

// emptyDB returns a database URL and a table name nothing has created yet.
func emptyDB(t *testing.T, kind string) (string, string) {
	t.Helper()
	switch kind {
	case "postgres":
		u, _ := pgSchemaURL(t)
		return u, "outbox"
	case "mysql":
		db := mysqlDB(t)
		var b [6]byte
		_, _ = rand.Read(b[:])
		table := "txo_cmd_empty_" + hex.EncodeToString(b[:])
		t.Cleanup(func() {
			_, _ = db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_skipped, " + table + "_migrations, " + table + "_keys, " + table + "_inbox")
		})
		return mysqlURL(t), table
	default:
		return "sqlite://" + t.TempDir() + "/empty.db", "outbox"
	}
}

// TestDoctorUnreachable: doctor --json on a database it cannot reach says
// so in its findings, not only on stderr.
func TestDoctorUnreachable(t *testing.T) {
	t.Parallel()
	for _, u := range []string{"postgres://nobody@127.0.0.1:1/app?connect_timeout=2", "mysql://nobody@127.0.0.1:1/app?timeout=2s"} {
		r := txoutbox(t, u, "doctor", "--json")
		var findings []struct{ Check, Severity, Message string }
		r.json(t, &findings)
		found := false
		for _, f := range findings {
			if f.Check == "connection" && f.Severity == "problem" && strings.Contains(f.Message, "127.0.0.1") {
				found = true
			}
		}
		if r.code == 0 || !found {
			t.Errorf("doctor --json on %s: exit %d, findings %+v; want a connection problem", u, r.code, findings)
		}
	}
}

// TestGroupHelp: the words that group commands print their subcommands.
func TestGroupHelp(t *testing.T) {
	t.Parallel()
	for group, subs := range map[string][]string{"migrate": {"migrate up", "migrate status", "migrate sql"}, "dead": {"dead list", "dead show"}} {
		for _, args := range [][]string{{group, "--help"}, {group, "-h"}, {"help", group}} {
			r := txoutbox(t, "", args...)
			r.want(t, 0, subs...)
		}
		r := txoutbox(t, "", group)
		r.want(t, exitUsage, subs...)
		txoutbox(t, "", group, "nope").want(t, exitUsage, "unknown command", subs[0])
	}
}

// TestHelpListsUsefulFlags: each command's --help lists the flags that do
// something for it, and it refuses the others.
func TestHelpListsUsefulFlags(t *testing.T) {
	t.Parallel()
	for _, c := range commands {
		r := txoutbox(t, "", append(strings.Fields(c.name), "--help")...)
		r.want(t, 0)
		notify := c.name == "migrate up" || c.name == "migrate sql" || c.name == "doctor"
		if got := strings.Contains(r.stdout, "-notify-channel"); got != notify {
			t.Errorf("%s --help lists --notify-channel: %v, want %v", c.name, got, notify)
		}
		hold := c.name == "status" || c.name == "console"
		if got := strings.Contains(r.stdout, "-hold-on-dead-letter"); got != hold {
			t.Errorf("%s --help lists --hold-on-dead-letter: %v, want %v", c.name, got, hold)
		}
	}
	txoutbox(t, "sqlite:///nonexistent.db", "status", "--notify-channel", "x").want(t, exitUsage, "flag provided but not defined: -notify-channel")
}

// TestOutOfRangeArgumentsWriteNothing: an argument a command does not take
// (a second id after redrive --id, a stray word after purge) and a count
// or age out of range are usage errors, before anything is written; they
// used to be ignored, or read by the storage as "no limit".
func TestOutOfRangeArgumentsWriteNothing(t *testing.T) {
	forEachBackend(t, func(t *testing.T, f fixture) {
		a1, b1 := fmt.Sprint(f.ids["a1"]), fmt.Sprint(f.ids["b1"])
		f.run(t, "redrive", "--id", a1, b1).want(t, exitUsage, `redrive takes no arguments, got "`+b1+`"`)
		f.run(t, "redrive", "--all", "now").want(t, exitUsage, "takes no arguments")
		f.run(t, "purge", "--older-than", "1m", "all").want(t, exitUsage, "takes no arguments")
		f.run(t, "purge", "--older-than", "-1h").want(t, exitUsage, "--older-than must not be negative")
		f.run(t, "dead", "list", "--limit", "0").want(t, exitUsage, "--limit must be at least 1")
		f.run(t, "dead", "list", "--limit", "-1").want(t, exitUsage, "--limit must be at least 1")
		f.run(t, "dead", "list", "--after-id", "-1").want(t, exitUsage, "--after-id must not be negative")
		f.run(t, "dead", "list", "--older-than", "-1h").want(t, exitUsage, "--older-than must not be negative")
		f.run(t, "status", "--limit", "-5").want(t, exitUsage, "--limit must be at least 1")
		if st, err := f.s.Stats(context.Background()); err != nil || st.Dead != 2 || st.Delivered != 1 {
			t.Fatalf("after the refused commands: %+v, %v; want the 2 dead and 1 delivered records untouched", st, err)
		}
		f.run(t, "dead", "list", "--limit", "1").want(t, 0, a1)
	})
}
