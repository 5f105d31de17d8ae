package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/txoutbox/txoutbox/storage"
)

// What a hostile (or broken) producer can store, and a worker id and a
// skip reason an operator or a forwarder might pass on. Each would take
// over the operator's terminal or forge a row if printed raw: the key
// prints a row for a dead record 4242 that does not exist.
const (
	hostileKey    = "k3\n4242\tforged-key\tforged.topic\t1"
	hostileTopic  = "orders\x1b]0;pwned\x07"
	hostileError  = "boom\r\n4244\tforged\x1b[2K\u202eesrever"
	hostilePay    = "\x1b[2J\x1b[Hcleared\r\nforged payload line\u0085"
	hostileMetaK  = "m\x1b[31m"
	hostileMetaV  = "v\n4243\tforged"
	hostileKey2   = "c\u202ekey\u2066"
	hostileWorker = "fwd\x1b]0;x\x07"
	hostileReason = "ok\nforged skip line\x1b[2K"
)

// terminalUnsafe returns the first character of out that must not reach a
// terminal (anything but graphic characters, spaces and newlines).
func terminalUnsafe(out string) (rune, bool) {
	for i, r := range out {
		switch {
		case r == '\n':
		case r == utf8.RuneError:
			if _, size := utf8.DecodeRuneInString(out[i:]); size != 3 {
				return r, true
			}
		case !unicode.IsGraphic(r):
			return r, true
		}
	}
	return 0, false
}

// hostileFixture fills a migrated fixture with hostile records: a dead one
// (hostileKey, with one more record behind it), a leased one of
// hostileKey2 (one behind it), and a skipped one. It returns their ids.
func hostileFixture(t *testing.T, f fixture) (dead, leased, skipped int64) {
	t.Helper()
	ctx := context.Background()
	s := f.s
	tx, commit := f.begin(t)
	recs := []storage.Record{
		{UUID: "u-dead", Topic: hostileTopic, Key: hostileKey, Payload: []byte(hostilePay), Metadata: map[string]string{hostileMetaK: hostileMetaV}},
		{UUID: "u-leased", Topic: hostileTopic, Key: hostileKey2, Payload: []byte("x")},
		{UUID: "u-skipped", Topic: "t", Key: "s", Payload: []byte("x")},
		{UUID: "u-behind", Topic: hostileTopic, Key: hostileKey, Payload: []byte("x")},
		{UUID: "u-behind2", Topic: hostileTopic, Key: hostileKey2, Payload: []byte("x")},
	}
	if err := s.Insert(ctx, tx, recs); err != nil {
		t.Fatal(err)
	}
	if err := commit(); err != nil {
		t.Fatal(err)
	}
	got, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 3, Lease: time.Hour, WorkerID: hostileWorker})
	if err != nil || len(got) != 3 {
		t.Fatalf("claim: %v %v", got, err)
	}
	dead, leased, skipped = got[0].ID, got[1].ID, got[2].ID
	for _, ref := range []storage.ClaimRef{got[0].Ref(), got[2].Ref()} {
		if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: ref, WorkerID: hostileWorker, Error: hostileError}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Skip(ctx, storage.SkipParams{ID: skipped, Reason: hostileReason}); err != nil {
		t.Fatal(err)
	}
	return dead, leased, skipped
}

// TestHostileTextNeverReachesTheTerminal feeds control characters, bidi
// overrides and bytes that are not UTF-8 through each real storage and
// checks every text and JSON output of the commands that print them: no
// such character comes out raw, no row is forged, and JSON still gives the
// exact values back.
func TestHostileTextNeverReachesTheTerminal(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			f := b.open(t)
			dead, leased, skipped := hostileFixture(t, f)
			runs := [][]string{
				{"dead", "list"}, {"dead", "list", "--json"},
				{"dead", "show", fmt.Sprint(dead)}, {"dead", "show", fmt.Sprint(dead), "--json"},
				{"dead", "show", fmt.Sprint(skipped)}, {"dead", "show", fmt.Sprint(leased)},
				{"status", "--hold-on-dead-letter"}, {"status", "--hold-on-dead-letter", "--json"},
				{"dead", "list", "--key", hostileKey}, {"redrive", "--key", hostileKey, "--dry-run"},
			}
			out := map[string]result{}
			for _, args := range runs {
				r := f.run(t, args...)
				if r.code != 0 && r.code != exitAttention {
					t.Fatalf("txoutbox %q: exit %d\n%s%s", args, r.code, r.stdout, r.stderr)
				}
				if c, bad := terminalUnsafe(r.stdout + r.stderr); bad {
					t.Errorf("txoutbox %q prints %U raw:\n%q", args, c, r.stdout+r.stderr)
				}
				out[strings.Join(args, " ")] = r
			}
			// One row per dead record: the key's newline and tabs forge none.
			list := out["dead list"].stdout
			if lines := strings.Split(strings.TrimSpace(list), "\n"); len(lines) != 2 {
				t.Errorf("dead list prints %d lines for one dead record:\n%s", len(lines), list)
			}
			for _, l := range strings.Split(list+out["status --hold-on-dead-letter"].stdout+out["dead show "+fmt.Sprint(dead)].stdout, "\n") {
				if strings.HasPrefix(strings.TrimSpace(l), "424") {
					t.Errorf("a forged line: %q", l)
				}
			}
			// The names an operator acts on are shown quoted, and exactly.
			for _, want := range []string{fmt.Sprintf("%q", hostileKey), `"c\u202ekey\u2066"`} {
				if !strings.Contains(out["status --hold-on-dead-letter"].stdout, want) {
					t.Errorf("status does not show the key as %s:\n%s", want, out["status --hold-on-dead-letter"].stdout)
				}
			}
			// JSON keeps the exact values.
			var recs []recordJSON
			out["dead list --json"].json(t, &recs)
			if len(recs) != 1 || recs[0].Key != hostileKey || recs[0].Topic != hostileTopic || recs[0].LastError != hostileError {
				t.Errorf("dead list --json = %+v, want the hostile values exactly", recs)
			}
			var rec recordJSON
			out["dead show "+fmt.Sprint(dead)+" --json"].json(t, &rec)
			if rec.Payload != hostilePay || rec.Metadata[hostileMetaK] != hostileMetaV {
				t.Errorf("dead show --json = %+v, want the hostile payload and metadata exactly", rec)
			}
		})
	}
}

// TestFiltersNotText: a filter that is not UTF-8 (a shell's $'\xff') is a
// usage error, not a database error.
func TestFiltersNotText(t *testing.T) {
	t.Parallel()
	f := openPostgresFixture(t)
	for _, args := range [][]string{{"dead", "list", "--key", "k\xff"}, {"dead", "list", "--topic=\xfe"}, {"redrive", "--key", "\xff", "--dry-run"},
		{"skip", "1", "--reason", "bad \xff"}} {
		f.run(t, args...).want(t, exitUsage, "not UTF-8 text")
	}
}
