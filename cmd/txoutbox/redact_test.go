package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// runRaw runs the built command without txoutbox's check that the URL's
// password appears nowhere: here the password is a word the output holds
// for its own sake.
func runRaw(t *testing.T, dbURL string, args ...string) result {
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
		t.Fatal(err)
	}
	return r
}

// TestPasswordThatIsAWord: the password is redacted where a URL or DSN can
// appear, not wherever its text does. With passwords that are words of
// the output (trust authentication ignores them), the JSON stays JSON, its
// fields keep their names, doctor names the role, and the command's own
// hints keep their example URLs.
func TestPasswordThatIsAWord(t *testing.T) {
	t.Parallel()
	f := fill(t, openPostgresFixture(t))
	with := func(password string) string {
		u, err := url.Parse(f.url)
		if err != nil {
			t.Fatal(err)
		}
		u.User = url.UserPassword(u.User.Username(), password)
		return u.String()
	}

	r := runRaw(t, with("true"), "redrive", "--all", "--dry-run", "--json")
	var dry map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &dry); err != nil || dry["dry_run"] != true {
		t.Errorf("password true: redrive --dry-run --json = %v, %v\n%s", dry, err, r.stdout)
	}
	r = runRaw(t, with("dead"), "status", "--json")
	var st map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &st); err != nil || st["dead"] != float64(2) {
		t.Errorf("password dead: status --json = %v, %v; want a dead count of 2\n%s", st, err, r.stdout)
	}
	r = runRaw(t, with("postgres"), "doctor")
	if r.code != 0 || !strings.Contains(r.stdout, "role postgres") && !strings.Contains(r.stdout, "role "+urlUser(f.url)) || strings.Contains(r.stdout, redacted) {
		t.Errorf("password postgres: doctor = exit %d\n%s", r.code, r.stdout)
	}
	// The command's own hints, for a URL with a password that is their word.
	r = runRaw(t, "mysql://user:password@/orders", "status")
	if r.code != exitUsage || !strings.Contains(r.stderr, "write mysql://user:password@host:3306/dbname") {
		t.Errorf("a mysql URL without a host: exit %d\n%s", r.code, r.stderr)
	}
}

func urlUser(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.User == nil {
		return ""
	}
	return u.User.Username()
}

// TestNoPasswordInMalformedURLs: URLs an operator gets wrong (a key=value
// connection string, a password with an unescaped @ or a bad escape) are
// refused without quoting the password, or any part of it.
func TestNoPasswordInMalformedURLs(t *testing.T) {
	t.Parallel()
	for u, fragment := range map[string]string{
		"host=127.0.0.1 port=1 user=u password=kvSecret99":  "kvSecret99",
		"postgres://u:pa@atSecret99@127.0.0.1:1/db":         "atSecret99",
		"postgresql://u:pa@atSecret98@127.0.0.1:1/db?x=1":   "atSecret98",
		"sqlite://u:esc%zzSecret99@localhost/tmp/x.db":      "Secret99",
		"postgres://u:esc%zzSecret97@127.0.0.1:1/db":        "Secret97",
		"mysql://u:esc%zzSecret96@127.0.0.1:1/db":           "Secret96",
		"mysql://u:pa@atSecret95@127.0.0.1:1/db?timeout=1s": "atSecret95",
		"postgres://u:sp ace Secret94@127.0.0.1:1/db":       "Secret94",
		"postgres://u:sl/ash Secret93@127.0.0.1:1/db":       "Secret93",
		"mysql://u:pa@atSecret92@tcp(127.0.0.1:1)/db?x=%zz": "atSecret92",
	} {
		for _, args := range [][]string{{"status"}, {"doctor", "--json"}, {"migrate", "sql"}, {"migrate", "up"}} {
			r := runRaw(t, u, args...)
			if (r.code == 0 && args[0] != "migrate") || strings.Contains(r.stdout+r.stderr, fragment) {
				t.Errorf("txoutbox %v on %s: exit %d, the output holds the password:\n%s%s", args, u, r.code, r.stdout, r.stderr)
			}
		}
	}
}

func TestCheckURL(t *testing.T) {
	t.Parallel()
	for u, ok := range map[string]bool{
		"postgres://u:p%40ss@db:5432/app?sslmode=require": true,
		"postgres://db:5432/app?options=-c%20x@y":         true,
		"postgres://db:5432/my@db":                        true,
		"postgres://[::1]:5432/app":                       true,
		"mysql://u:p@ss@tcp(db:3306)/app":                 true,
		"mysql://u:pw@db/app?tls=true":                    true,
		"sqlite:///var/lib/app.db":                        true,
		"sqlite:app.db":                                   true,
		"postgres:":                                       true,
		"postgres://u:p@ss@db/app":                        false,
		"postgres://u:p/ss@db/app":                        false,
		"host=db password=x":                              false,
		"://x":                                            false,
		"postgres://u:p%zz@db/app":                        false,
	} {
		if err := checkURL(u); (err == nil) != ok {
			t.Errorf("checkURL(%q) = %v, want ok %v", u, err, ok)
		}
	}
}
