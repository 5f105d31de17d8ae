package faulttest

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/postgres"
)

// secret is the password the security tests put into database URLs.
const secret = "Sup3r-S3cret-pw_4e1a"

// badURLs point at nothing (port 1 refuses connections) or do not parse;
// every one carries the secret.
var badURLs = []string{
	"postgres://fault_user:" + secret + "@127.0.0.1:1/test?sslmode=disable&connect_timeout=1",
	"host=127.0.0.1 port=1 user=fault_user password=" + secret + " dbname=test sslmode=disable connect_timeout=1",
	"postgres://fault_user@127.0.0.1:1/test?sslmode=disable&connect_timeout=1&password=" + secret,
	"postgres://fault_user:" + secret + "@127.0.0.1:notaport/test",
}

// TestNoPasswordInWorkerLogs starts the worker binary with database URLs that
// hold a password and lead nowhere, lets it fail for a while, stops it, and
// checks that its output has errors in it but never the password.
func TestNoPasswordInWorkerLogs(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the worker binary; skipped under -short")
	}
	bin := buildWorker(t)
	for i, dsn := range badURLs {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			var out bytes.Buffer
			cmd := exec.Command(bin, "forwarder", "-table", "outbox", "-channel", "outbox_ch", "-worker", "w1", "-target", "http://127.0.0.1:1/")
			cmd.Env = append(cmd.Environ(), "TXOUTBOX_FAULT_DB="+dsn)
			cmd.Stdout, cmd.Stderr = &out, &out
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			// Give the forwarder and the listener time to fail a few times.
			select {
			case <-done:
			case <-time.After(1500 * time.Millisecond):
				_ = cmd.Process.Signal(syscall.SIGTERM)
				select {
				case <-done:
				case <-time.After(10 * time.Second):
					_ = cmd.Process.Kill()
					<-done
					t.Fatal("worker did not stop within 10s of SIGTERM")
				}
			}
			log := out.String()
			if !strings.Contains(log, "error") && !strings.Contains(log, "invalid") {
				t.Fatalf("worker output holds no error at all, so the test proves nothing:\n%s", log)
			}
			if strings.Contains(log, secret) {
				t.Fatalf("worker output contains the password:\n%s", log)
			}
			t.Logf("%d bytes of output, password absent; first line: %s", len(log), strings.SplitN(log, "\n", 2)[0])
		})
	}
}

// TestNoPasswordInLibraryErrors uses the storage and the forwarder in this
// process, with no redaction of ours in between, over a pool whose URL holds
// a password and leads nowhere: the errors they return and log must not
// contain the password.
func TestNoPasswordInLibraryErrors(t *testing.T) {
	for i, dsn := range badURLs {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			cfg, err := pgxpool.ParseConfig(dsn)
			if err != nil {
				if strings.Contains(err.Error(), secret) {
					t.Fatalf("parse error contains the password: %v", err)
				}
				t.Logf("parse error, password absent: %v", err)
				return
			}
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			logs := &recordingLogger{}
			store, err := postgres.New(pool, postgres.Config{Table: "outbox", NotifyChannel: "outbox_ch", Logger: logs})
			if err != nil {
				t.Fatal(err)
			}
			var errs []error
			_, err = store.Claim(ctx, storage.ClaimParams{BatchSize: 1, Lease: time.Second, WorkerID: "w"})
			errs = append(errs, err)
			_, err = store.Stats(ctx)
			errs = append(errs, err)
			errs = append(errs, store.CreateSchema(ctx))

			// The listener logs its reconnects; the forwarder logs failed rounds.
			fwd, err := txoutbox.NewForwarder(store, nopTarget{}, txoutbox.ForwarderConfig{StorageErrorDelay: 50 * time.Millisecond}, logs)
			if err != nil {
				t.Fatal(err)
			}
			runCtx, stop := context.WithTimeout(ctx, 700*time.Millisecond)
			defer stop()
			var wg sync.WaitGroup
			wg.Go(func() { _ = store.Listen(runCtx, fwd.Wake) })
			errs = append(errs, fwd.Run(runCtx))
			wg.Wait()

			all := logs.text()
			for _, e := range errs {
				if e != nil {
					all += "\n" + e.Error()
				}
			}
			if !strings.Contains(all, "127.0.0.1") {
				t.Fatalf("no connection error was produced, so the test proves nothing:\n%s", all)
			}
			if strings.Contains(all, secret) {
				t.Fatalf("errors or logs contain the password:\n%s", all)
			}
		})
	}
}

type nopTarget struct{}

func (nopTarget) Publish(string, ...*message.Message) error { return nil }
func (nopTarget) Close() error                              { return nil }

// recordingLogger keeps every log line with its error and fields.
type recordingLogger struct {
	mu    sync.Mutex
	lines []string
}

func (l *recordingLogger) add(level, msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf("%s %s err=%v %v", level, msg, err, fields))
}

func (l *recordingLogger) Error(msg string, err error, f watermill.LogFields) {
	l.add("ERROR", msg, err, f)
}
func (l *recordingLogger) Info(msg string, f watermill.LogFields)           { l.add("INFO", msg, nil, f) }
func (l *recordingLogger) Debug(msg string, f watermill.LogFields)          { l.add("DEBUG", msg, nil, f) }
func (l *recordingLogger) Trace(msg string, f watermill.LogFields)          { l.add("TRACE", msg, nil, f) }
func (l *recordingLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *recordingLogger) text() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}
