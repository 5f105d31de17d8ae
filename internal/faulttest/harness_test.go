package faulttest

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

func databaseURL() string {
	return cmp.Or(os.Getenv("TEST_DATABASE_URL"), defaultDatabaseURL)
}

// openPool opens a pool on TEST_DATABASE_URL named appName. It skips the test
// when the server does not answer, or fails it with CI=true.
func openPool(t *testing.T, appName string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(databaseURL())
	if err != nil {
		t.Fatalf("parse TEST_DATABASE_URL: %v", err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = appName
	cfg.ConnConfig.ConnectTimeout = 3 * time.Second
	cfg.MaxConns = maxConns
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		if err = pool.Ping(ctx); err != nil {
			pool.Close()
		}
	}
	if err != nil {
		msg := fmt.Sprintf("PostgreSQL not reachable at TEST_DATABASE_URL (%v); start it with: pg_ctlcluster --skip-systemctl-redirect 15 main start", err)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	t.Cleanup(pool.Close)
	return pool
}

// buildWorker builds cmd/txoutbox-fault into the test's temp dir.
func buildWorker(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "txoutbox-fault")
	cmd := exec.Command("go", "build", "-o", bin, "github.com/txoutbox/txoutbox/cmd/txoutbox-fault")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build cmd/txoutbox-fault: %v\n%s", err, out)
	}
	return bin
}

// received is one delivery the target recorded.
type received struct {
	Delivery
	At time.Time
}

// Target modes.
const (
	modeNormal = iota
	modeFail   // answer 500 without recording
	modeHang   // hold the request until the caller gives up; never record
)

// target is the HTTP endpoint the worker processes publish to. It records
// every delivery it accepts in arrival order and can be switched to fail or
// hang; it can also SIGKILL a worker while that worker's publish is in flight.
type target struct {
	mu         sync.Mutex
	mode       int
	hangDone   chan struct{} // closed when hang mode ends
	got        []received
	killOnNext string              // worker to kill at its next delivery
	killed     chan string         // reports mid-publish kills
	kill       func(worker string) // SIGKILLs and reaps a worker

	server *http.Server
	url    string
}

func startTarget(t *testing.T) *target {
	t.Helper()
	tg := &target{killed: make(chan string, 16)}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tg.url = "http://" + ln.Addr().String() + "/publish"
	tg.server = &http.Server{Handler: tg, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = tg.server.Serve(ln) }()
	t.Cleanup(func() {
		tg.setMode(modeNormal)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = tg.server.Shutdown(ctx)
	})
	return tg
}

func (tg *target) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var d Delivery
	if err := json.NewDecoder(r.Body).Decode(&d); err != nil {
		http.Error(w, "bad delivery: "+err.Error(), http.StatusBadRequest)
		return
	}
	tg.mu.Lock()
	mode, hangDone := tg.mode, tg.hangDone
	tg.mu.Unlock()
	switch mode {
	case modeFail:
		http.Error(w, "injected failure", http.StatusInternalServerError)
		return
	case modeHang:
		select {
		case <-r.Context().Done():
		case <-hangDone:
			http.Error(w, "hang over", http.StatusServiceUnavailable)
		}
		return
	}
	tg.mu.Lock()
	tg.got = append(tg.got, received{Delivery: d, At: time.Now()})
	victim := tg.killOnNext != "" && tg.killOnNext == d.Worker
	if victim {
		tg.killOnNext = ""
	}
	tg.mu.Unlock()
	if victim {
		// Recorded but never acknowledged: the worker dies mid-publish, so
		// this record must be redelivered after its lease expires.
		tg.kill(d.Worker)
		tg.killed <- d.Worker
		http.Error(w, "killed", http.StatusInternalServerError)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (tg *target) setMode(m int) {
	tg.mu.Lock()
	defer tg.mu.Unlock()
	if tg.mode == modeHang && m != modeHang {
		close(tg.hangDone)
	}
	if m == modeHang && tg.mode != modeHang {
		tg.hangDone = make(chan struct{})
	}
	tg.mode = m
}

func (tg *target) armKill(worker string) {
	tg.mu.Lock()
	tg.killOnNext = worker
	tg.mu.Unlock()
}

func (tg *target) disarmKill() {
	tg.mu.Lock()
	tg.killOnNext = ""
	tg.mu.Unlock()
}

func (tg *target) deliveries() []received {
	tg.mu.Lock()
	defer tg.mu.Unlock()
	return append([]received(nil), tg.got...)
}

// firstAfter returns the arrival time of the first delivery after t.
// Arrival times only grow: they are taken under the lock that appends.
func (tg *target) firstAfter(t time.Time) (time.Time, bool) {
	tg.mu.Lock()
	defer tg.mu.Unlock()
	i := sort.Search(len(tg.got), func(i int) bool { return tg.got[i].At.After(t) })
	if i == len(tg.got) {
		return time.Time{}, false
	}
	return tg.got[i].At, true
}

// worker is one txoutbox-fault forwarder process.
type worker struct {
	id      string
	cmd     *exec.Cmd
	logPath string
	started time.Time
	done    chan struct{} // closed when the process has exited
	exitAt  time.Time     // set before done is closed
	// expected is set before the suite signals the process, so an exit it
	// did not cause is reported as a crash.
	mu       sync.Mutex
	expected string
}

func (w *worker) expect(why string) {
	w.mu.Lock()
	w.expected = why
	w.mu.Unlock()
}

func (w *worker) expectedExit() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.expected
}

func (w *worker) exited() bool {
	select {
	case <-w.done:
		return true
	default:
		return false
	}
}

// workerArgs configure the processes one suite starts.
type workerArgs struct {
	bin, db, table, channel, target, logDir string
	extra                                   []string
}

func startWorker(t *testing.T, a workerArgs, id string) *worker {
	t.Helper()
	logPath := filepath.Join(a.logDir, id+".log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	args := append([]string{"forwarder", "-table", a.table, "-worker", id, "-target", a.target}, a.extra...)
	if os.Getenv("TXOUTBOX_FAULT_DEBUG") == "1" {
		args = append(args, "-debug")
	}
	if a.channel != "" {
		args = append(args, "-channel", a.channel)
	}
	cmd := exec.Command(a.bin, args...)
	cmd.Env = append(os.Environ(), "TXOUTBOX_FAULT_DB="+a.db)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		logFile.Close()
		t.Fatalf("start worker %s: %v", id, err)
	}
	w := &worker{id: id, cmd: cmd, logPath: logPath, started: time.Now(), done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		w.exitAt = time.Now()
		logFile.Close()
		close(w.done)
	}()
	t.Cleanup(func() {
		if !w.exited() {
			w.expect("cleanup")
			_ = cmd.Process.Signal(syscall.SIGKILL)
			<-w.done
		}
	})
	return w
}

// sigkill kills w and waits until it is reaped.
func (w *worker) sigkill(why string) error {
	w.expect(why)
	if err := w.cmd.Process.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("SIGKILL %s: %w", w.id, err)
	}
	select {
	case <-w.done:
		return nil
	case <-time.After(10 * time.Second):
		return fmt.Errorf("worker %s still running 10s after SIGKILL", w.id)
	}
}

// sigterm stops w gracefully and returns how long it took and its exit code.
func (w *worker) sigterm(timeout time.Duration) (time.Duration, int, error) {
	w.expect("sigterm")
	start := time.Now()
	if err := w.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return 0, -1, fmt.Errorf("SIGTERM %s: %w", w.id, err)
	}
	select {
	case <-w.done:
		return time.Since(start), w.cmd.ProcessState.ExitCode(), nil
	case <-time.After(timeout):
		return time.Since(start), -1, fmt.Errorf("worker %s did not exit within %s of SIGTERM", w.id, timeout)
	}
}

// logLines returns the lines of w's log that contain substr.
func (w *worker) logLines(substr string) []string {
	f, err := os.Open(w.logPath)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if strings.Contains(sc.Text(), substr) {
			out = append(out, sc.Text())
		}
	}
	return out
}

// tail returns the last n lines of w's log, for failure messages.
func (w *worker) tail(n int) string {
	lines := w.logLines("")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// logTime reads the time of a log line: slog's time=... or the worker's at=...
func logTime(line string) (time.Time, bool) {
	for _, f := range strings.Fields(line) {
		for _, prefix := range []string{"time=", "at="} {
			if v, ok := strings.CutPrefix(f, prefix); ok {
				if ts, err := time.Parse(time.RFC3339Nano, v); err == nil {
					return ts, true
				}
			}
		}
	}
	return time.Time{}, false
}

// logField reads key=value from a log line.
func logField(line, key string) string {
	for _, f := range strings.Fields(line) {
		if v, ok := strings.CutPrefix(f, key+"="); ok {
			return v
		}
	}
	return ""
}

// isLocalDatabase reports whether the URL points at this machine, the only
// place the suite may restart PostgreSQL.
func isLocalDatabase(dsn string) bool {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return false
	}
	switch cfg.ConnConfig.Host {
	case "127.0.0.1", "localhost", "::1":
		return true
	}
	return strings.HasPrefix(cfg.ConnConfig.Host, "/")
}

// pgCluster returns the version and name of the local cluster to restart:
// $TXOUTBOX_FAULT_PG_CLUSTER ("15 main") or the newest in /etc/postgresql.
func pgCluster() (version, name string, err error) {
	if v := os.Getenv("TXOUTBOX_FAULT_PG_CLUSTER"); v != "" {
		parts := strings.Fields(v)
		if len(parts) != 2 {
			return "", "", fmt.Errorf("TXOUTBOX_FAULT_PG_CLUSTER=%q: want \"VERSION NAME\"", v)
		}
		return parts[0], parts[1], nil
	}
	entries, err := os.ReadDir("/etc/postgresql")
	if err != nil {
		return "", "", fmt.Errorf("find the PostgreSQL cluster: %w", err)
	}
	for _, e := range entries {
		if e.IsDir() && (version == "" || len(e.Name()) > len(version) || (len(e.Name()) == len(version) && e.Name() > version)) {
			version = e.Name()
		}
	}
	if version == "" {
		return "", "", errors.New("no cluster in /etc/postgresql")
	}
	return version, "main", nil
}

// redactURL drops the password of a URL for messages.
func redactURL(dsn string) string {
	u, err := url.Parse(dsn)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}
