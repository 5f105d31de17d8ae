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
