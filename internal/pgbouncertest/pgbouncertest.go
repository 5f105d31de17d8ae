// Package pgbouncertest runs Debian's PgBouncer as a process of a test, in
// transaction mode, in front of the test's PostgreSQL server, so that the
// doctor's pooler check is tested against the real thing.
package pgbouncertest

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Binary is where Debian's pgbouncer package installs PgBouncer.
const Binary = "/usr/sbin/pgbouncer"

// Start runs PgBouncer with pool_mode=transaction on a free port of
// 127.0.0.1, forwarding database db to host:port of serverURL with trust
// authentication, and returns serverURL pointed at it. PgBouncer is stopped
// when the test ends. Without the binary the test is skipped, or fails
// with CI=true (.ci/run installs the package). PgBouncer refuses to run as
// root: as root it is started with -u nobody.
func Start(t testing.TB, serverURL string) string {
	t.Helper()
	if _, err := os.Stat(Binary); err != nil {
		msg := fmt.Sprintf("PgBouncer not installed (%v): apt-get install -y pgbouncer", err)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	u, err := url.Parse(serverURL)
	if err != nil {
		t.Fatal(err)
	}
	db := u.Path[1:]
	userName := u.User.Username()
	var lc net.ListenConfig
	l, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()

	dir, err := os.MkdirTemp("", "pgbouncer")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	// Readable by nobody, when it runs as nobody.
	if err := os.Chmod(dir, 0o755); err != nil { //nolint:gosec // a throw-away config without secrets
		t.Fatal(err)
	}
	ini := fmt.Sprintf(`[databases]
%s = host=%s port=%s dbname=%s user=%s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
max_client_conn = 100
default_pool_size = 4
ignore_startup_parameters = extra_float_digits,search_path,application_name
logfile = %s
`, db, u.Hostname(), u.Port(), db, userName, port, filepath.Join(dir, "users.txt"), filepath.Join(dir, "pgbouncer.log"))
	for name, text := range map[string]string{"pgbouncer.ini": ini, "users.txt": fmt.Sprintf("%q \"\"\n", userName), "pgbouncer.log": ""} {
		f := filepath.Join(dir, name)
		if err := os.WriteFile(f, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		// Writable by nobody (the log), past the umask.
		if err := os.Chmod(f, 0o666); err != nil { //nolint:gosec // see above
			t.Fatal(err)
		}
	}
	args := []string{filepath.Join(dir, "pgbouncer.ini")}
	if me, err := user.Current(); err == nil && me.Uid == "0" {
		args = append([]string{"-u", "nobody"}, args...)
	}
	cmd := exec.CommandContext(context.Background(), Binary, args...) //nolint:gosec // the fixed binary, on a config file the test wrote
	var stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("start pgbouncer: %v", err)
	}
	exited := make(chan struct{})
	var waitErr error
	go func() { waitErr = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		d := net.Dialer{Timeout: time.Second}
		c, err := d.DialContext(context.Background(), "tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err == nil {
			_ = c.Close()
			break
		}
		select {
		case <-exited:
			log, _ := os.ReadFile(filepath.Join(dir, "pgbouncer.log")) //nolint:gosec // the test's own temporary directory
			t.Fatalf("pgbouncer exited: %v\n%s%s", waitErr, stderr.String(), log)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("pgbouncer not listening on port %d after 10s", port)
		}
		time.Sleep(50 * time.Millisecond)
	}
	u.Host = fmt.Sprintf("127.0.0.1:%d", port)
	return u.String()
}
