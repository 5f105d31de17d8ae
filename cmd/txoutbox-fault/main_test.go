package main

import (
	"bytes"
	"strings"
	"testing"
)

func TestRedactorHidesEveryFormOfThePassword(t *testing.T) {
	for _, dsn := range []string{
		"postgres://u:p%40ss%2Fw0rd@127.0.0.1:5432/db",
		"postgres://u@127.0.0.1:5432/db?password=p@ss/w0rd",
		"host=127.0.0.1 user=u password=p@ss/w0rd dbname=db",
		"host=127.0.0.1 user=u password='p@ss/w0rd' dbname=db",
	} {
		var out bytes.Buffer
		r := newRedactor(&out, secretsOf(dsn))
		for _, line := range []string{"decoded p@ss/w0rd here\n", "escaped p%40ss%2Fw0rd here\n"} {
			if _, err := r.Write([]byte(line)); err != nil {
				t.Fatal(err)
			}
		}
		if strings.Contains(out.String(), "p@ss/w0rd") || strings.Contains(out.String(), "p%40ss%2Fw0rd") {
			t.Errorf("%s: password left in %q", dsn, out.String())
		}
		if !strings.Contains(out.String(), "xxxxx") {
			t.Errorf("%s: nothing redacted in %q", dsn, out.String())
		}
	}
}

func TestForwarderModeRefusesBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"forwarder", "-worker", "w", "-target", "http://127.0.0.1:1/"},                                 // no database
		{"forwarder", "-db", "postgres://127.0.0.1/x", "-target", "http://127.0.0.1:1/"},                // no worker
		{"forwarder", "-db", "postgres://127.0.0.1/x", "-worker", "w"},                                  // no target
		{"forwarder", "-db", "postgres://127.0.0.1/x", "-worker", "w", "-target", "t", "-table", "a;b"}, // hostile table
		{"nosuchmode"},
		{},
	} {
		t.Setenv("TXOUTBOX_FAULT_DB", "")
		var out bytes.Buffer
		if code := run(args, &out); code != 2 {
			t.Errorf("run(%q) = %d, want 2 (output %q)", args, code, out.String())
		}
	}
}
