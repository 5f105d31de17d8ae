package main

import (
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/txoutbox/txoutbox/internal/safetext"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

// errHelp: help was asked for and printed; exit 0.
var errHelp = errors.New("help requested")

// env is what a command runs with.
type env struct {
	out, errOut io.Writer
	opts        options
	args        []string // positional arguments
	fs          *flag.FlagSet
}

// command is one subcommand.
type command struct {
	name       string // one or two words
	args       string // positional arguments, for the usage line
	summary    string
	details    string
	example    string
	flags      func(fs *flag.FlagSet)
	run        func(ctx context.Context, e *env) error
	withHold   bool // takes --hold-on-dead-letter
	withNotify bool // takes --notify-channel (PostgreSQL's trigger)
}

var commands []*command

func init() {
	commands = []*command{
		cmdMigrateUp, cmdMigrateStatus, cmdMigrateSQL,
		cmdStatus, cmdDeadList, cmdDeadShow, cmdRedrive, cmdSkip, cmdPurge, cmdDoctor, cmdConsole,
	}
}

func dispatch(ctx context.Context, args []string, out, errOut io.Writer, getenv func(string) string) error {
	if len(args) == 0 {
		printUsage(errOut)
		return usageError{"no command given"}
	}
	switch args[0] {
	case "help", "-h", "-help", "--help":
		if len(args) > 1 {
			if c := findCommand(args[1:]); c != nil {
				printCommandHelp(out, c)
				return errHelp
			}
			if group(args[1]) != nil {
				printGroupUsage(out, args[1])
				return errHelp
			}
		}
		printUsage(out)
		return errHelp
	}
	// A word that groups commands (migrate, dead): alone or with --help,
	// it lists them.
	if group(args[0]) != nil && findCommand(args) == nil {
		if len(args) > 1 && isHelpFlag(args[1]) {
			printGroupUsage(out, args[0])
			return errHelp
		}
		printGroupUsage(errOut, args[0])
		if len(args) == 1 {
			return usageError{fmt.Sprintf("%s: give one of its commands", args[0])}
		}
		return usageError{fmt.Sprintf("unknown command %q", strings.Join(args[:2], " "))}
	}
	// Shared flags may come before the command: move them after it.
	var lead []string
	for len(args) > 0 && strings.HasPrefix(args[0], "-") && args[0] != "--" {
		n := 2
		if strings.Contains(args[0], "=") || strings.TrimLeft(args[0], "-") == "json" {
			n = 1
		}
		n = min(n, len(args))
		lead, args = append(lead, args[:n]...), args[n:]
	}
	c := findCommand(args)
	if c == nil && len(lead) > 0 && len(args) == 0 {
		return usageError{"no command given"}
	}
	if c == nil {
		return usageError{fmt.Sprintf("unknown command %q", strings.Join(args[:min(2, len(args))], " "))}
	}
	rest := slices.Concat(lead, args[len(strings.Fields(c.name)):])

	e := &env{out: out, errOut: errOut}
	fs := flag.NewFlagSet("txoutbox "+c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	sharedFlags(fs, c, &e.opts, getenv(envDatabaseURL))
	pos, err := parseInterspersed(fs, rest)
	if errors.Is(err, flag.ErrHelp) {
		printCommandHelp(out, c)
		return errHelp
	}
	if err != nil {
		return usageError{fmt.Sprintf("%s: %v (see 'txoutbox %s --help')", c.name, err, c.name)}
	}
	// Keys, topics, errors and reasons are text: bytes that are not UTF-8
	// would be a database error (PostgreSQL and MySQL refuse to compare them).
	var notText string
	fs.Visit(func(f *flag.Flag) {
		if !utf8.ValidString(f.Value.String()) {
			notText = "--" + f.Name
		}
	})
	for _, a := range pos {
		if !utf8.ValidString(a) {
			notText = "an argument"
		}
	}
	if notText != "" {
		return usageError{fmt.Sprintf("%s: %s is not UTF-8 text", c.name, notText)}
	}
	if c.args == "" && len(pos) > 0 {
		return usageError{fmt.Sprintf("%s takes no arguments, got %q (see 'txoutbox %s --help')", c.name, pos[0], c.name)}
	}
	// A count or an age below its range would read as "no limit" or "no
	// filter" in the storage: say so instead of listing something else.
	var bad string
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "limit":
			if n, _ := f.Value.(flag.Getter).Get().(int); n < 1 {
				bad = "--limit must be at least 1"
			}
		case "after-id":
			if n, _ := f.Value.(flag.Getter).Get().(int64); n < 0 {
				bad = "--after-id must not be negative"
			}
		case "older-than":
			if d, _ := f.Value.(flag.Getter).Get().(time.Duration); d < 0 {
				bad = "--older-than must not be negative"
			}
		}
	})
	if bad != "" {
		return usageError{fmt.Sprintf("%s: %s", c.name, bad)}
	}
	e.args, e.fs = pos, fs
	return c.run(ctx, e)
}

// sharedFlags defines on fs the flags of c that every command, or a few,
// take, then c's own: only those that do something for c.
func sharedFlags(fs *flag.FlagSet, c *command, o *options, defaultURL string) {
	urlUsage := "database URL (default $" + envDatabaseURL + ")"
	if c.name == "migrate sql" {
		urlUsage = "database URL, of which only the scheme is read: sqlite:, postgres: or mysql: (default $" + envDatabaseURL + ")"
	}
	fs.StringVar(&o.url, "database-url", defaultURL, urlUsage)
	fs.StringVar(&o.table, "table", sqlite.TableDefault, "outbox table name")
	if c.withNotify {
		fs.StringVar(&o.notifyChannel, "notify-channel", "", notifyChannelUsage)
	}
	fs.BoolVar(&o.jsonOut, "json", false, "write JSON for scripts instead of aligned text")
	if c.withHold {
		fs.BoolVar(&o.hold, "hold-on-dead-letter", false, "the forwarders run with HoldOnDeadLetter: a dead record holds back its key")
	}
	if c.flags != nil {
		c.flags(fs)
	}
}

// group returns the commands whose first word is word, when they are more
// than one word long (migrate up, migrate status, ...).
func group(word string) []*command {
	var out []*command
	for _, c := range commands {
		if first, _, ok := strings.Cut(c.name, " "); ok && first == word {
			out = append(out, c)
		}
	}
	return out
}

func isHelpFlag(a string) bool {
	return a == "-h" || a == "-help" || a == "--help" || a == "help"
}

// printGroupUsage lists the commands of a group.
func printGroupUsage(w io.Writer, word string) {
	fmt.Fprintf(w, "Usage: txoutbox %s <command> [flags]\n\nCommands:\n", word)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, c := range group(word) {
		fmt.Fprintf(tw, "  %s %s\t%s\n", c.name, c.args, c.summary)
	}
	_ = tw.Flush()
	fmt.Fprintf(w, "\n'txoutbox %s <command> --help' shows a command's flags and an example.\n", word)
}

func findCommand(args []string) *command {
	for _, c := range commands {
		words := strings.Fields(c.name)
		if len(args) >= len(words) && strings.Join(args[:len(words)], " ") == c.name {
			return c
		}
	}
	return nil
}

// parseInterspersed parses flags anywhere among the positional arguments,
// so `dead show 42 --json` works.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		if args[0] == "--" {
			return append(pos, args[1:]...), nil
		}
		pos, args = append(pos, args[0]), args[1:]
	}
}

func printUsage(w io.Writer) {
	fmt.Fprint(w, `txoutbox operates a txoutbox outbox table: migrations, status, dead letters,
re-drive, skip, purge and doctor.

Usage:
  txoutbox <command> [flags]

Commands:
`)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, c := range commands {
		fmt.Fprintf(tw, "  %s %s\t%s\n", c.name, c.args, c.summary)
	}
	_ = tw.Flush()
	fmt.Fprintf(w, `
Every command takes --database-url (default $%s), --table (default outbox)
and --json. 'txoutbox <command> --help' shows a command's flags and an example.

Exit codes: 0 ok, 1 error (also: no such table, a schema newer than this
build), 2 usage, 3 attention (dead records or keys held by a failing record in
status, a problem in doctor, a pending migration), 4 not found (or not dead).

Example:
  export %s=sqlite:///var/lib/app/app.db
  txoutbox migrate up && txoutbox status
`, envDatabaseURL, envDatabaseURL)
}

const notifyChannelUsage = "PostgreSQL: the forwarders' Config.NotifyChannel (migrate creates its trigger, doctor checks it)"

func printCommandHelp(w io.Writer, c *command) {
	fmt.Fprintf(w, "Usage: txoutbox %s [flags] %s\n\n%s\n", c.name, c.args, c.summary)
	if c.details != "" {
		fmt.Fprintf(w, "\n%s\n", c.details)
	}
	fmt.Fprintf(w, "\nExample:\n  %s\n\nFlags:\n", c.example)
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	sharedFlags(fs, c, &options{}, "")
	fs.SetOutput(w)
	fs.PrintDefaults()
}

// emit writes v as JSON with --json, else calls text. Text that came from
// the table goes through safetext in text (Quote for names, Escape for free
// text); in JSON, safetext.JSON escapes what encoding/json leaves raw, so
// neither can reach the terminal with a control character.
func (e *env) emit(v any, text func(w io.Writer)) error {
	if e.opts.jsonOut {
		b, err := json.MarshalIndent(v, "", "  ")
		if err != nil {
			return err
		}
		_, err = e.out.Write(append(safetext.JSON(b), '\n'))
		return err
	}
	tw := tabwriter.NewWriter(e.out, 0, 4, 2, ' ', 0)
	text(tw)
	return tw.Flush()
}

func (e *env) open(ctx context.Context) (*backend, error) {
	return open(ctx, e.opts)
}

// ---- migrate ----

var cmdMigrateUp = &command{
	name:    "migrate up",
	summary: "bring the schema to the latest version (creates the table and, for SQLite, the file)",
	details: "Applies the missing steps under a lock, so concurrent runs are safe: one applies them,\n" +
		"the others wait and find them applied, and each says which it was. Records are never\n" +
		"touched. A table made by hand from `migrate sql` or SchemaSQL is recorded at the version\n" +
		"its SQL made; one made without the version table is adopted at the latest step whose\n" +
		"tables, columns and indexes are all there.",
	example:    "txoutbox migrate up --database-url sqlite:///var/lib/app/app.db",
	withNotify: true,
	run: func(ctx context.Context, e *env) error {
		e.opts.create, e.opts.skipSchemaCheck = true, true
		b, err := e.open(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = b.close() }()
		before, err := b.mig.MigrationStatus(ctx)
		if err != nil {
			return err
		}
		applied, err := b.migrate(ctx)
		if err != nil {
			return err
		}
		after, err := b.mig.MigrationStatus(ctx)
		if err != nil {
			return err
		}
		names := map[int]string{}
		for _, m := range b.mig.Migrations() {
			names[m.Version] = m.Name
		}
		return e.emit(struct {
			From    int   `json:"from_version"`
			To      int   `json:"to_version"`
			Applied []int `json:"applied"`
		}{before.Current, after.Current, append([]int{}, applied...)}, func(w io.Writer) {
			switch {
			case len(applied) > 0:
				steps := make([]string, len(applied))
				for i, v := range applied {
					steps[i] = fmt.Sprintf("%d %s", v, names[v])
				}
				fmt.Fprintf(w, "schema migrated from version %d to %d: this run applied %s\n", applied[0]-1, after.Current, strings.Join(steps, ", "))
			case before.Current != after.Current:
				fmt.Fprintf(w, "schema at version %d, the latest: another run applied the steps from version %d meanwhile\n", after.Current, before.Current)
			default:
				fmt.Fprintf(w, "schema already at version %d, the latest\n", after.Current)
			}
		})
	},
}

var cmdMigrateStatus = &command{
	name:    "migrate status",
	summary: "show the schema version, the latest one and the steps applied (exit 3 when behind, 1 when newer)",
	example: "txoutbox migrate status --json",
	run: func(ctx context.Context, e *env) error {
		e.opts.skipSchemaCheck = true
		b, err := e.open(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = b.close() }()
		st, err := b.mig.MigrationStatus(ctx)
		if err != nil {
			return err
		}
		type applied struct {
			Version   int       `json:"version"`
			Name      string    `json:"name"`
			AppliedAt time.Time `json:"applied_at"`
		}
		v := struct {
			Current int       `json:"current_version"`
			Latest  int       `json:"latest_version"`
			Applied []applied `json:"applied"`
		}{Current: st.Current, Latest: st.Latest, Applied: []applied{}}
		for _, a := range st.Applied {
			v.Applied = append(v.Applied, applied{a.Version, a.Name, a.AppliedAt.UTC()})
		}
		err = e.emit(v, func(w io.Writer) {
			fmt.Fprintf(w, "version\t%d of %d\n", st.Current, st.Latest)
			if len(st.Applied) > 0 {
				fmt.Fprintln(w, "\nVERSION\tNAME\tAPPLIED AT")
				for _, a := range st.Applied {
					fmt.Fprintf(w, "%d\t%s\t%s\n", a.Version, safetext.Quote(a.Name), formatTime(a.AppliedAt))
				}
			}
		})
		if err != nil {
			return err
		}
		switch {
		case st.Current > st.Latest:
			return fmt.Errorf("the schema is at version %d, newer than this build's %d: use the txoutbox release that migrated it, or a later one", st.Current, st.Latest)
		case st.Current == 0:
			ok, err := b.tableExists(ctx)
			if err != nil {
				return err
			}
			if !ok {
				return attentionError{fmt.Sprintf("outbox table %s does not exist: check --table and the database URL, or run `txoutbox migrate up` to create it", b.table)}
			}
			return attentionError{fmt.Sprintf("outbox table %s has no schema version recorded: run `txoutbox migrate up` to record it and add what it lacks", b.table)}
		case st.Current < st.Latest:
			return attentionError{fmt.Sprintf("%d migration step(s) not applied: run `txoutbox migrate up`", st.Latest-st.Current)}
		}
		return nil
	},
}

var cmdMigrateSQL = &command{
	name:       "migrate sql",
	summary:    "print the migration steps' SQL, or write them as files for golang-migrate, goose or Atlas",
	details:    "Needs only the URL's scheme (sqlite: or mysql: is enough); the database is not opened.\nWith --dir, writes NNN_name.up.sql and NNN_name.down.sql (golang-migrate, which\nAtlas imports) or NNN_name.sql with goose annotations.",
	example:    "txoutbox migrate sql --database-url sqlite: --table outbox --dir db/migrations --format goose",
	withNotify: true,
	flags: func(fs *flag.FlagSet) {
		fs.Bool("down", false, "print the down steps, latest first, instead of the up steps")
		fs.String("dir", "", "write one file per step into this directory instead of printing")
		fs.String("format", "golang-migrate", "file format with --dir: golang-migrate or goose")
	},
	run: func(ctx context.Context, e *env) error {
		fs := e.flagSet()
		migs, err := migrationsFor(e.opts)
		if err != nil {
			return err
		}
		if dir := fs.string("dir"); dir != "" {
			return writeMigrationFiles(e, migs, dir, fs.string("format"))
		}
		if e.opts.jsonOut {
			return e.emit(migs, nil)
		}
		down := fs.bool("down")
		for i := range migs {
			m := migs[i]
			text := m.Up
			if down {
				m = migs[len(migs)-1-i]
				text = m.Down
				if text == "" {
					text = noDownStep
				}
			}
			fmt.Fprintf(e.out, "-- txoutbox migration %d: %s\n%s\n", m.Version, m.Name, text)
		}
		return nil
	},
}

// noDownStep stands for a step without a down: reverting it would lose
// records, or a later step has none (a down runs only from the latest step).
const noDownStep = "-- no down step: reverting it would lose records, or a later step has none\n"

// migrationsFor returns the steps for the URL's storage without opening
// the database.
func migrationsFor(o options) ([]storage.Migration, error) {
	if o.url != "" {
		if err := checkURL(o.url); err != nil {
			return nil, err
		}
	}
	scheme, _, _ := strings.Cut(o.url, ":")
	switch strings.ToLower(scheme) {
	case "sqlite", "file":
		migs, err := sqlite.Migrations(sqlite.Config{Table: o.table})
		if err != nil {
			return nil, usageError{err.Error()}
		}
		return migs, nil
	case "postgres", "postgresql":
		if !strings.Contains(o.url, "//") {
			o.url = "postgres://localhost/unused" // never connected
		}
		s, pool, err := postgresStorage(context.Background(), o)
		if err != nil {
			return nil, err
		}
		defer pool.Close()
		migs := s.Migrations()
		if trg := s.TriggerSQL(); trg != "" {
			// The trigger is no numbered step (it depends on the
			// configuration): it goes with the last one.
			migs[len(migs)-1].Up += trg
		}
		return migs, nil
	case "mysql":
		s, err := mysqlMigrations(o)
		if err != nil {
			return nil, err
		}
		return s.Migrations(), nil
	case "":
		return nil, usageError{"no database URL: set --database-url or TXOUTBOX_DATABASE_URL (for migrate sql the scheme is enough, e.g. sqlite:, postgres: or mysql:)"}
	}
	_, err := open(context.Background(), o)
	return nil, err
}

func writeMigrationFiles(e *env, migs []storage.Migration, dir, format string) error {
	scheme, _, _ := strings.Cut(e.opts.url, ":")
	whole := strings.HasPrefix(strings.ToLower(scheme), "postgres")
	if format != "golang-migrate" && format != "goose" {
		return usageError{fmt.Sprintf("--format %q: want golang-migrate or goose", format)}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil { //nolint:gosec // migration files go into the user's repository, readable like any source file
		return err
	}
	var files []string
	write := func(name, text string) error {
		files = append(files, filepath.Join(dir, name))
		return os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644) //nolint:gosec // a source file for the user's repository
	}
	for _, m := range migs {
		base := fmt.Sprintf("%03d_txoutbox_%s", m.Version, m.Name)
		var err error
		switch format {
		case "golang-migrate":
			if err = write(base+".up.sql", m.Up); err == nil {
				down := m.Down
				if down == "" {
					down = noDownStep
				}
				err = write(base+".down.sql", down)
			}
		case "goose":
			// goose runs each statement it finds (a line ending with a
			// semicolon ends one), or a StatementBegin/End block as one:
			// PostgreSQL's steps hold a DO block, whose semicolons are not
			// ends of statements, and run as one block (a simple-protocol
			// query may hold several statements); MySQL's and SQLite's run
			// statement by statement, which needs no multiStatements=true.
			block := func(sql string) string {
				if !whole {
					return sql
				}
				return "-- +goose StatementBegin\n" + sql + "-- +goose StatementEnd\n"
			}
			text := "-- +goose Up\n" + block(m.Up)
			if m.Down != "" {
				text += "\n-- +goose Down\n" + block(m.Down)
			}
			err = write(base+".sql", text)
		}
		if err != nil {
			return err
		}
	}
	return e.emit(map[string][]string{"files": files}, func(w io.Writer) {
		for _, f := range files {
			fmt.Fprintln(w, f)
		}
	})
}

// ---- status ----

var cmdStatus = &command{
	name:     "status",
	summary:  "counts by state, oldest pending age, forwarders seen, the keys held back, and the inbox's size (exit 3 with dead records or failing keys)",
	example:  "txoutbox status --hold-on-dead-letter --json",
	withHold: true,
	flags: func(fs *flag.FlagSet) {
		fs.Int("limit", storage.ListLimitDefault, "most held keys listed")
	},
	run: func(ctx context.Context, e *env) error {
		b, err := e.open(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = b.close() }()
		ms, err := b.mig.MigrationStatus(ctx)
		if err != nil {
			return err
		}
		st, err := b.op.Stats(ctx)
		if err != nil {
			return err
		}
		held, err := b.op.HeldKeys(ctx, storage.HeldKeysParams{Limit: e.flagSet().int("limit")})
		if err != nil {
			return err
		}
		ist, err := b.inbox.InboxStats(ctx)
		if err != nil {
			return redactErr(err)
		}
		v := struct {
			Table         string        `json:"table"`
			SchemaVersion int           `json:"schema_version"`
			Pending       int64         `json:"pending"`
			Leased        int64         `json:"leased"`
			Dead          int64         `json:"dead"`
			Skipped       int64         `json:"skipped"`
			Delivered     int64         `json:"delivered"`
			DeliveredAge  float64       `json:"oldest_delivered_age_seconds"`
			OldestAge     float64       `json:"oldest_pending_age_seconds"`
			Forwarders    int64         `json:"forwarders"`
			HeldKeyCount  int64         `json:"held_key_count"`
			HeldKeys      []heldKeyJSON `json:"held_keys"`
			InboxEntries  int64         `json:"inbox_entries"`
			InboxOldest   *time.Time    `json:"inbox_oldest_received_at"`
		}{e.opts.table, ms.Current, st.Pending, st.Leased, st.Dead, st.Skipped, st.Delivered, st.OldestDeliveredAge.Seconds(),
			st.OldestPendingAge.Seconds(), st.Forwarders, st.HeldKeys, []heldKeyJSON{}, ist.Entries, timePtr(ist.Oldest)}
		for _, h := range held {
			v.HeldKeys = append(v.HeldKeys, toHeldKeyJSON(h))
		}
		err = e.emit(v, func(w io.Writer) {
			fmt.Fprintf(w, "table\t%s\n", e.opts.table)
			fmt.Fprintf(w, "schema version\t%d\n", ms.Current)
			fmt.Fprintf(w, "pending\t%d\n", st.Pending)
			fmt.Fprintf(w, "leased\t%d\n", st.Leased)
			fmt.Fprintf(w, "dead\t%d\n", st.Dead)
			fmt.Fprintf(w, "skipped\t%d\n", st.Skipped)
			fmt.Fprintf(w, "delivered\t%d\n", st.Delivered)
			fmt.Fprintf(w, "oldest delivered age\t%s\n", st.OldestDeliveredAge.Round(time.Millisecond))
			fmt.Fprintf(w, "oldest pending age\t%s\n", st.OldestPendingAge.Round(time.Millisecond))
			fmt.Fprintf(w, "forwarders seen\t%d\n", st.Forwarders)
			fmt.Fprintf(w, "held keys\t%d\n", st.HeldKeys)
			fmt.Fprintf(w, "inbox entries\t%d\n", ist.Entries)
			if !ist.Oldest.IsZero() {
				fmt.Fprintf(w, "inbox oldest entry\t%s\n", formatTime(ist.Oldest))
			}
			if len(held) > 0 {
				fmt.Fprintln(w, "\nKEY\tHEAD\tWHY\tBEHIND\tSINCE\tLAST ERROR")
				for _, h := range held {
					fmt.Fprintf(w, "%s\t%d\t%s\t%d\t%s\t%s\n", safetext.Quote(h.Key), h.HeadID, holdWhy(h), h.Behind, formatTime(h.Since), oneLine(h.LastError, 60))
				}
			}
		})
		// Keys held by a record in flight are normal under load; a key held
		// by a failing or dead record is not.
		failing := 0
		for _, h := range held {
			if h.Reason != storage.HoldLeased {
				failing++
			}
		}
		if err == nil && (st.Dead > 0 || failing > 0) {
			return attentionError{fmt.Sprintf("%d dead record(s), %d key(s) held by a failing or dead record", st.Dead, failing)}
		}
		return err
	},
}

type heldKeyJSON struct {
	Key       string     `json:"key"`
	HeadID    int64      `json:"head_id"`
	Reason    string     `json:"reason"`
	LeasedBy  string     `json:"leased_by,omitempty"`
	Until     *time.Time `json:"until,omitempty"`
	LastError string     `json:"last_error,omitempty"`
	Since     time.Time  `json:"since"`
	Behind    int64      `json:"behind"`
}

func toHeldKeyJSON(h storage.HeldKey) heldKeyJSON {
	return heldKeyJSON{Key: h.Key, HeadID: h.HeadID, Reason: string(h.Reason), LeasedBy: h.LeasedBy,
		Until: timePtr(h.Until), LastError: h.LastError, Since: h.Since.UTC(), Behind: h.Behind}
}

func holdWhy(h storage.HeldKey) string {
	switch h.Reason {
	case storage.HoldLeased:
		return fmt.Sprintf("leased by %s until %s", safetext.Quote(h.LeasedBy), formatTime(h.Until))
	case storage.HoldRetry:
		return "retry at " + formatTime(h.Until)
	}
	return string(h.Reason)
}

// ---- dead letters ----

var cmdDeadList = &command{
	name:    "dead list",
	summary: "list dead-lettered records, filtered by topic, key, error text or age, in id order",
	details: "Pages with --after-id: pass the last id printed to get the next page.",
	example: "txoutbox dead list --topic orders.created --error timeout --older-than 1h --limit 50",
	flags: func(fs *flag.FlagSet) {
		fs.String("topic", "", "only records of this topic")
		fs.String("key", "", "only records of this ordering key")
		fs.String("error", "", "only records whose last error contains this text")
		fs.Duration("older-than", 0, "only records created more than this long ago (e.g. 24h)")
		fs.Int64("after-id", 0, "only records with a larger id (paging)")
		fs.Int("limit", storage.ListLimitDefault, "most records listed")
	},
	run: func(ctx context.Context, e *env) error {
		fs := e.flagSet()
		b, err := e.open(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = b.close() }()
		recs, err := b.op.ListDead(ctx, storage.ListDeadParams{
			Topic: fs.string("topic"), Key: fs.string("key"), ErrorContains: fs.string("error"),
			OlderThan: fs.duration("older-than"), AfterID: fs.int64("after-id"), Limit: fs.int("limit"),
		})
		if err != nil {
			return err
		}
		out := make([]recordJSON, 0, len(recs))
		for _, r := range recs {
			out = append(out, toRecordJSON(r, false))
		}
		return e.emit(out, func(w io.Writer) {
			fmt.Fprintln(w, "ID\tKEY\tTOPIC\tATTEMPTS\tCREATED\tDEAD SINCE\tERROR")
			for _, r := range recs {
				fmt.Fprintf(w, "%d\t%s\t%s\t%d\t%s\t%s\t%s\n", r.Record.ID, safetext.Quote(r.Record.Key), safetext.Quote(r.Record.Topic), r.Record.Attempts,
					formatTime(r.Record.CreatedAt), formatTime(r.DeadAt), oneLine(r.LastError, 80))
			}
		})
	},
}

var cmdDeadShow = &command{
	name:    "dead show",
	args:    "ID",
	summary: "show one record in full: status, payload, metadata, error, attempts (exit 4 when not found)",
	details: "Works for a record in any state. A payload that is not UTF-8 text is shown in base64.",
	example: "txoutbox dead show 4711 --json",
	run: func(ctx context.Context, e *env) error {
		id, err := e.idArg()
		if err != nil {
			return err
		}
		b, err := e.open(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = b.close() }()
		r, err := b.op.Record(ctx, id)
		if errors.Is(err, storage.ErrRecordNotFound) {
			return notFoundError{err}
		}
		if err != nil {
			return err
		}
		j := toRecordJSON(r, true)
		return e.emit(j, func(w io.Writer) {
			fmt.Fprintf(w, "id\t%d\n", j.ID)
			fmt.Fprintf(w, "uuid\t%s\n", safetext.Quote(j.UUID))
			fmt.Fprintf(w, "status\t%s\n", j.Status)
			fmt.Fprintf(w, "topic\t%s\n", safetext.Quote(j.Topic))
			fmt.Fprintf(w, "key\t%s\n", safetext.Quote(j.Key))
			fmt.Fprintf(w, "attempts\t%d\n", j.Attempts)
			fmt.Fprintf(w, "created\t%s\n", formatTime(r.Record.CreatedAt))
			if !r.DeadAt.IsZero() {
				fmt.Fprintf(w, "dead since\t%s\n", formatTime(r.DeadAt))
			}
			if r.Status == storage.StatusSkipped {
				fmt.Fprintf(w, "skipped\t%s: %s\n", formatTime(r.SkippedAt), safetext.Escape(r.SkipReason))
			}
			fmt.Fprintf(w, "error\t%s\n", cmp.Or(safetext.Escape(r.LastError), "-"))
			for _, k := range sortedKeys(r.Record.Metadata) {
				fmt.Fprintf(w, "metadata %s\t%s\n", safetext.Quote(k), safetext.Escape(r.Record.Metadata[k]))
			}
			fmt.Fprintf(w, "payload (%s)\t%s\n", j.PayloadEncoding, safetext.Escape(j.Payload))
		})
	},
}

type recordJSON struct {
	ID              int64             `json:"id"`
	UUID            string            `json:"uuid"`
	Status          string            `json:"status"`
	Topic           string            `json:"topic"`
	Key             string            `json:"key"`
	Attempts        int               `json:"attempts"`
	CreatedAt       time.Time         `json:"created_at"`
	DeadAt          *time.Time        `json:"dead_at,omitempty"`
	LastError       string            `json:"last_error,omitempty"`
	Metadata        map[string]string `json:"metadata,omitempty"`
	Payload         string            `json:"payload,omitempty"`
	PayloadEncoding string            `json:"payload_encoding,omitempty"`
	SkippedAt       *time.Time        `json:"skipped_at,omitempty"`
	SkipReason      string            `json:"skip_reason,omitempty"`
}

func toRecordJSON(r storage.RecordInfo, payload bool) recordJSON {
	j := recordJSON{ID: r.Record.ID, UUID: r.Record.UUID, Status: string(r.Status), Topic: r.Record.Topic, Key: r.Record.Key,
		Attempts: r.Record.Attempts, CreatedAt: r.Record.CreatedAt.UTC(), DeadAt: timePtr(r.DeadAt), LastError: r.LastError,
		Metadata: r.Record.Metadata, SkippedAt: timePtr(r.SkippedAt), SkipReason: r.SkipReason}
	if payload {
		if utf8.Valid(r.Record.Payload) {
			j.Payload, j.PayloadEncoding = string(r.Record.Payload), "text"
		} else {
			j.Payload, j.PayloadEncoding = base64.StdEncoding.EncodeToString(r.Record.Payload), "base64"
		}
	}
	return j
}

// ---- redrive, skip, purge ----

var cmdRedrive = &command{
	name:    "redrive",
	summary: "put dead records back to pending (by --id, --key, --topic or --all), in id order per key",
	details: "Exactly one of --id, --key, --topic, --all. Re-driven records keep their ids, so each\nkey's records are delivered again in id order. Idempotent: only records dead now change.",
	example: "txoutbox redrive --key order-1042 --dry-run",
	flags: func(fs *flag.FlagSet) {
		fs.Var(&idList{}, "id", "re-drive this record (repeat, or comma-separated ids)")
		fs.String("key", "", "re-drive every dead record of this ordering key")
		fs.String("topic", "", "re-drive every dead record of this topic")
		fs.Bool("all", false, "re-drive every dead record")
		fs.Bool("dry-run", false, "list what would be re-driven, change nothing")
	},
	run: func(ctx context.Context, e *env) error {
		fs := e.flagSet()
		p := storage.RedriveParams{IDs: *fs.Lookup("id").Value.(*idList), Key: fs.string("key"), Topic: fs.string("topic"), All: fs.bool("all")}
		if err := p.Validate(); err != nil {
			return usageError{"redrive: set exactly one of --id, --key, --topic or --all"}
		}
		b, err := e.open(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = b.close() }()
		if fs.bool("dry-run") {
			ids, err := redriveCandidates(ctx, b.op, p)
			if err != nil {
				return err
			}
			return e.emit(map[string]any{"dry_run": true, "count": len(ids), "ids": ids}, func(w io.Writer) {
				fmt.Fprintf(w, "would re-drive %d dead record(s)", len(ids))
				if len(ids) > 0 {
					fmt.Fprintf(w, ": %s", joinIDs(ids))
				}
				fmt.Fprintln(w)
			})
		}
		n, err := b.op.Redrive(ctx, p)
		if err != nil {
			return err
		}
		return e.emit(map[string]any{"dry_run": false, "count": n}, func(w io.Writer) {
			fmt.Fprintf(w, "re-drove %d dead record(s)\n", n)
		})
	},
}

// redriveCandidates lists the dead records p selects, in id order.
func redriveCandidates(ctx context.Context, op storage.Operator, p storage.RedriveParams) ([]int64, error) {
	ids := []int64{}
	if len(p.IDs) > 0 {
		for _, id := range p.IDs {
			r, err := op.Record(ctx, id)
			if errors.Is(err, storage.ErrRecordNotFound) {
				continue
			}
			if err != nil {
				return nil, err
			}
			if r.Status == storage.StatusDead && !slices.Contains(ids, id) {
				ids = append(ids, id)
			}
		}
		return ids, nil
	}
	var after int64
	for {
		page, err := op.ListDead(ctx, storage.ListDeadParams{Topic: p.Topic, Key: p.Key, AfterID: after, Limit: 1000})
		if err != nil {
			return nil, err
		}
		for _, r := range page {
			ids = append(ids, r.Record.ID)
			after = r.Record.ID
		}
		if len(page) < 1000 {
			return ids, nil
		}
	}
}

var cmdSkip = &command{
	name:    "skip",
	args:    "ID",
	summary: "give up on a dead record so its key moves on, with an audit record (exit 4 when not found or not dead)",
	details: "The record is kept as skipped, with the reason and the time: it is never delivered and\nno longer holds back its key. Skipping a skipped record changes nothing.",
	example: "txoutbox skip 4711 --reason 'payload for a deleted customer, see OPS-123'",
	flags: func(fs *flag.FlagSet) {
		fs.String("reason", "", "why (required): kept as the audit record")
	},
	run: func(ctx context.Context, e *env) error {
		id, err := e.idArg()
		if err != nil {
			return err
		}
		reason := e.flagSet().string("reason")
		if strings.TrimSpace(reason) == "" {
			return usageError{"skip: --reason is required (it is kept as the audit record)"}
		}
		b, err := e.open(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = b.close() }()
		err = b.op.Skip(ctx, storage.SkipParams{ID: id, Reason: reason})
		if errors.Is(err, storage.ErrRecordNotFound) || errors.Is(err, storage.ErrNotDead) {
			return notFoundError{err}
		}
		if err != nil {
			return err
		}
		return e.emit(map[string]any{"skipped": id, "reason": reason}, func(w io.Writer) {
			fmt.Fprintf(w, "skipped record %d\n", id)
		})
	},
}

var cmdPurge = &command{
	name:    "purge",
	summary: "delete delivered records older than --older-than, in short batches",
	details: "Pending, dead and skipped records are never purged.",
	example: "txoutbox purge --older-than 168h",
	flags: func(fs *flag.FlagSet) {
		fs.Duration("older-than", 0, "delete records delivered more than this long ago (required, e.g. 168h)")
	},
	run: func(ctx context.Context, e *env) error {
		d := e.flagSet().duration("older-than")
		if d <= 0 {
			return usageError{"purge: --older-than is required and must be > 0 (e.g. 168h)"}
		}
		b, err := e.open(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = b.close() }()
		n, err := b.op.Purge(ctx, d)
		if err != nil {
			return err
		}
		return e.emit(map[string]int64{"purged": n}, func(w io.Writer) {
			fmt.Fprintf(w, "purged %d delivered record(s)\n", n)
		})
	},
}

// ---- doctor ----

var cmdDoctor = &command{
	name:       "doctor",
	summary:    "check the schema version and drift, indexes, settings, and the URL (exit 3 on a problem)",
	details:    "Drift: a table, column or index the migrations make that is missing, or an index\ndefined otherwise (found and expected are shown). SQLite: schema version, drift, WAL\njournal mode, busy timeout. PostgreSQL: schema version, drift, the notify trigger (of\n--notify-channel), the privileges a forwarder needs, and whether LISTEN works: a round\ntrip of a notification, which a transaction-mode pooler (PgBouncer, Supavisor) drops;\nthe URL is also checked for the usual pooler hosts and ports. MySQL: schema version,\ndrift, privileges, server version, binary log format.",
	example:    "txoutbox doctor --json",
	withNotify: true,
	run: func(ctx context.Context, e *env) error {
		findings := urlFindings(e.opts.url)
		e.opts.skipSchemaCheck = true
		b, err := e.open(ctx)
		if err != nil {
			findings = append(findings, storage.Finding{Check: "connection", Severity: storage.SeverityProblem, Message: err.Error()})
		} else {
			defer func() { _ = b.close() }()
			if b.diag != nil {
				more, derr := b.diag.Diagnose(ctx)
				if derr != nil {
					return derr
				}
				findings = append(findings, more...)
			}
		}
		type findingJSON struct {
			Check    string `json:"check"`
			Severity string `json:"severity"`
			Message  string `json:"message"`
		}
		out := make([]findingJSON, 0, len(findings))
		problems := 0
		for _, f := range findings {
			out = append(out, findingJSON{f.Check, string(f.Severity), f.Message})
			if f.Severity == storage.SeverityProblem {
				problems++
			}
		}
		if werr := e.emit(out, func(w io.Writer) {
			fmt.Fprintln(w, "CHECK\tRESULT\tDETAIL")
			for _, f := range findings {
				fmt.Fprintf(w, "%s\t%s\t%s\n", f.Check, f.Severity, safetext.Escape(f.Message))
			}
		}); werr != nil {
			return werr
		}
		if err != nil {
			return err
		}
		if problems > 0 {
			return attentionError{fmt.Sprintf("doctor found %d problem(s)", problems)}
		}
		return nil
	},
}

// ---- helpers ----

// flagValues gives typed access to the parsed flags of the running command.
type flagValues struct{ *flag.FlagSet }

func (e *env) flagSet() flagValues { return flagValues{e.fs} }

func (f flagValues) string(name string) string { return f.Lookup(name).Value.String() }
func (f flagValues) bool(name string) bool     { return f.Lookup(name).Value.(flag.Getter).Get().(bool) }
func (f flagValues) int(name string) int       { return f.Lookup(name).Value.(flag.Getter).Get().(int) }
func (f flagValues) int64(name string) int64   { return f.Lookup(name).Value.(flag.Getter).Get().(int64) }
func (f flagValues) duration(name string) time.Duration {
	return f.Lookup(name).Value.(flag.Getter).Get().(time.Duration)
}

func (e *env) idArg() (int64, error) {
	if len(e.args) != 1 {
		return 0, usageError{"want exactly one record ID"}
	}
	id, err := strconv.ParseInt(e.args[0], 10, 64)
	if err != nil || id <= 0 {
		return 0, usageError{fmt.Sprintf("record ID %q: want a positive integer", e.args[0])}
	}
	return id, nil
}

// idList is a repeatable, comma-separated --id flag.
type idList []int64

func (l *idList) String() string { return joinIDs(*l) }

func (l *idList) Set(v string) error {
	for _, s := range strings.Split(v, ",") {
		id, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
		if err != nil || id <= 0 {
			return fmt.Errorf("id %q: want a positive integer", s)
		}
		*l = append(*l, id)
	}
	return nil
}

func joinIDs(ids []int64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, ",")
}

func formatTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	u := t.UTC()
	return &u
}

// oneLine flattens s to one line, cut to max runes (0: no cut), with its
// control characters escaped (safetext.Escape).
func oneLine(s string, max int) string {
	s = strings.Join(strings.Fields(s), " ")
	if s == "" {
		return "-"
	}
	if r := []rune(s); max > 0 && len(r) > max {
		s = string(r[:max-1]) + "…"
	}
	return safetext.Escape(s)
}

func sortedKeys(m map[string]string) []string { return slices.Sorted(maps.Keys(m)) }
