// Package examples_test runs every program in examples/ as a user would: built
// with the go command and run to completion against the local services.
package examples_test

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// Each example commits a few events, waits for them on the other side and
// exits 0 by itself; quickstart and metrics need no server at all.
var programs = []struct {
	name  string
	args  []string
	needs []string // services, as host:port
}{
	{"quickstart", nil, nil},
	{"metrics", []string{"-once", "-addr", "127.0.0.1:0"}, nil},
	{"postgres", nil, []string{postgres, rabbitmq}},
	{"kafka", nil, []string{postgres}}, // Kafka runs in process (kfake)
	{"amqp", nil, []string{postgres, rabbitmq}},
	{"inbox", nil, []string{postgres, rabbitmq}},
	{"nats", nil, []string{postgres, nats}},
	{"cqrs", nil, []string{postgres}},
	{"swap", nil, []string{postgres}},
}

const (
	postgres = "127.0.0.1:5432"
	rabbitmq = "127.0.0.1:5672"
	nats     = "127.0.0.1:4222"
)

var startCommand = map[string]string{
	postgres: "pg_ctlcluster --skip-systemctl-redirect 15 main start",
	rabbitmq: "rabbitmq-server -detached",
	nats:     "start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server",
}

// need skips (or, with CI=true, fails) when a service is not listening.
func need(t *testing.T, addrs []string) {
	for _, addr := range addrs {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			continue
		}
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s is not reachable (%v); start it with `%s`", addr, err, startCommand[addr])
		}
		t.Skipf("%s is not reachable (%v); start it with `%s`", addr, err, startCommand[addr])
	}
}

func TestExamplesRun(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs every example")
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to build the examples: %v", err)
	}
	bin := t.TempDir()
	for _, p := range programs {
		t.Run(p.name, func(t *testing.T) {
			need(t, p.needs)
			exe := filepath.Join(bin, p.name)
			build := exec.Command(goBin, "build", "-o", exe, "./examples/"+p.name)
			build.Dir = filepath.Join("..", "..")
			if out, err := build.CombinedOutput(); err != nil {
				t.Fatalf("go build ./examples/%s: %v\n%s", p.name, err, out)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, exe, p.args...)
			cmd.Env = os.Environ()
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("examples/%s exited with %v:\n%s", p.name, err, out)
			}
			if len(out) == 0 {
				t.Fatalf("examples/%s printed nothing", p.name)
			}
			t.Logf("examples/%s:\n%s", p.name, out)
		})
	}
}
