// Command txoutbox is the operator's tool for a txoutbox outbox table:
// versioned migrations, status and held keys, dead letters, re-drive, skip,
// purge and doctor.
//
//	go install github.com/txoutbox/txoutbox/cmd/txoutbox@latest
//	export TXOUTBOX_DATABASE_URL=sqlite:///var/lib/app/app.db
//	txoutbox migrate up
//	txoutbox status
//
// The database URL comes from --database-url or TXOUTBOX_DATABASE_URL (better
// for a URL holding a password: it stays out of the process list), the table
// from --table (default outbox). A password in the URL never appears in any
// output or error. Every command takes --json for scripts and --help for its
// flags and an example.
//
// It operates PostgreSQL (postgres://user:password@host:5432/db?sslmode=...),
// SQLite (sqlite:///path/to.db, sqlite:path, file:path) and MySQL or MariaDB
// databases (mysql://user:password@host:3306/dbname, or the driver's DSN
// behind mysql:// as golang-migrate spells it:
// mysql://user:password@tcp(host:3306)/dbname).
//
// # Exit codes
//
//	0  success
//	1  error: the database could not be reached or read, the outbox table
//	   does not exist, its schema is not this build's (behind, or newer:
//	   migrate status too), a write failed, ...
//	2  usage: unknown command or flag, missing argument
//	3  attention: status found dead records or keys held by a failing or dead
//	   record (keys held by a record in flight are normal); doctor found a
//	   problem; migrate status found steps not applied
//	4  not found: dead show or skip of an id that is not there (or, for skip, not dead)
//
// Text from the table (keys, topics, errors, payloads) is escaped before it
// reaches the terminal: see docs/operations.md.
//
// See docs/operations.md for the full reference.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/txoutbox/txoutbox/internal/safetext"
)

// Exit codes; see the package documentation.
const (
	exitOK        = 0
	exitError     = 1
	exitUsage     = 2
	exitAttention = 3
	exitNotFound  = 4
)

// envDatabaseURL is the environment variable holding the database URL.
const envDatabaseURL = "TXOUTBOX_DATABASE_URL"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
	stop()
	os.Exit(code)
}

// usageError is a mistake in the command line: exit code 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// attentionError is a finding that needs an operator: exit code 3. The
// command has printed its output already.
type attentionError struct{ msg string }

func (e attentionError) Error() string { return e.msg }

// notFoundError: exit code 4.
type notFoundError struct{ err error }

func (e notFoundError) Error() string { return e.err.Error() }
func (e notFoundError) Unwrap() error { return e.err }

// run runs the command line args and returns the exit code. The errors of
// drivers and storages come redacted (redact): a password in a URL or DSN
// never reaches stdout or stderr.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	out, errOut := stdout, stderr
	err := dispatch(ctx, args, out, errOut, getenv)
	var (
		ue usageError
		ae attentionError
		nf notFoundError
	)
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, errHelp):
		return exitOK
	case errors.As(err, &ue):
		fmt.Fprintf(errOut, "txoutbox: %s\nRun 'txoutbox help' for usage.\n", safetext.Escape(err.Error()))
		return exitUsage
	case errors.As(err, &ae):
		fmt.Fprintf(errOut, "txoutbox: %s\n", safetext.Escape(err.Error()))
		return exitAttention
	case errors.As(err, &nf):
		fmt.Fprintf(errOut, "txoutbox: %s\n", safetext.Escape(err.Error()))
		return exitNotFound
	default:
		fmt.Fprintf(errOut, "txoutbox: %s\n", safetext.Escape(err.Error()))
		return exitError
	}
}
