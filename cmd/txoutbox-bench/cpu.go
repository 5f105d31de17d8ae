package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// cpuMeter reads the CPU time used so far by the PostgreSQL server (when it
// runs on this machine) and by this process, so that a run can report what
// each relay cost the database and itself per message.
type cpuMeter struct {
	local bool // the database runs here: its processes are in /proc
}

func newCPUMeter(dbURL string) cpuMeter {
	cfg, err := pgx.ParseConfig(dbURL) // URLs and key=value strings alike
	if err != nil {
		return cpuMeter{}
	}
	switch h := cfg.Host; {
	case h == "localhost", h == "127.0.0.1", h == "::1", strings.HasPrefix(h, "/"): // a Unix socket
	default:
		return cpuMeter{}
	}
	_, ok := serverCPU()
	return cpuMeter{local: ok}
}

// cpuSample is one reading.
type cpuSample struct {
	server, self time.Duration
	ok           bool
}

func (m cpuMeter) sample() cpuSample {
	if !m.local {
		return cpuSample{}
	}
	srv, ok := serverCPU()
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return cpuSample{}
	}
	self := time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	return cpuSample{server: srv, self: self, ok: ok}
}

// minServerCPU is the least server CPU a reading is reported for: /proc
// counts in ticks of 10 ms, too coarse for shorter runs (the -quick ones).
const minServerCPU = 300 * time.Millisecond

// perMessage returns the server's and this process's CPU between a and b
// per message, in microseconds.
func perMessage(a, b cpuSample, n int) (server, self float64, ok bool) {
	if !a.ok || !b.ok || n <= 0 || b.server-a.server < minServerCPU {
		return 0, 0, false
	}
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) / float64(n) }
	return us(b.server - a.server), us(b.self - a.self), true
}

// serverCPU sums the CPU time of every process named postgres: user and
// system time, plus the time of their exited children (the postmaster reaps
// the backends that closed, so their time is counted too).
func serverCPU() (time.Duration, bool) {
	tick := 100.0 // USER_HZ: 100 on Linux
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var ticks float64
	found := false
	for _, p := range stats {
		b, err := os.ReadFile(p)
		if err != nil {
			continue // exited meanwhile
		}
		s := string(b)
		open, closing := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || closing < open || s[open+1:closing] != "postgres" {
			continue
		}
		// Fields after the command: state is field 3; utime, stime, cutime,
		// cstime are fields 14 to 17.
		f := strings.Fields(s[closing+1:])
		if len(f) < 15 {
			continue
		}
		for _, v := range f[11:15] {
			n, err := strconv.ParseFloat(v, 64)
			if err == nil {
				ticks += n
			}
		}
		found = true
	}
	return time.Duration(ticks / tick * float64(time.Second)), found
}
