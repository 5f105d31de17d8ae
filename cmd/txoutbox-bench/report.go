package main

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
)

// row is one line of a result table.
type row struct {
	// table is the table the row belongs to: "" for the main one (txoutbox
	// against Watermill), tableNotify for the NOTIFY cost.
	table              string
	scenario, settings string
	txo, wm            string
	ratio              string // txoutbox against Watermill ("2.10x faster"), or a plain quotient
	floor              string // the floor relay's figure, where there is one
	ofFloor            string // txoutbox's figure as a fraction of the floor's
	txoDL, wmDL        string // duplicates/lost
	txoCPU, wmCPU      string // database and relay CPU per message
	// The figures as numbers, for the plots (msgs/s; 0 when there is none).
	txoV, wmV, floorV float64
}

const tableNotify = "notify"

// columns returns the header of a table and a row's cells in it.
func columns(table string) []string {
	if table == tableNotify {
		return []string{"scenario", "settings", "with NOTIFY trigger", "without trigger", "NOTIFY costs"}
	}
	return []string{"scenario", "settings", "txoutbox", "watermill", "txoutbox vs watermill", "floor", "txoutbox/floor", "dup/lost txo", "dup/lost wm", "cpu us/msg db+relay txo", "wm"}
}

func (r row) cells() []string {
	if r.table == tableNotify {
		return []string{r.scenario, r.settings, r.txo, r.wm, r.ratio}
	}
	d := func(s string) string { return cmp.Or(s, "-") }
	return []string{r.scenario, r.settings, d(r.txo), d(r.wm), d(r.ratio), d(r.floor), d(r.ofFloor), d(r.txoDL), d(r.wmDL), d(r.txoCPU), d(r.wmCPU)}
}

// add appends a row and prints it at once.
func (b *bench) add(rs ...row) {
	b.rows = append(b.rows, rs...)
	b.flush()
}

// flush prints the rows not printed yet, one line each, as they finish: a
// long run shows its results while it goes, and what finished is on the
// screen even if a later run stalls.
func (b *bench) flush() {
	for _, r := range b.rows[b.printed:] {
		head := columns(r.table)
		cells := r.cells()
		var parts []string
		for i := 2; i < len(cells); i++ {
			if cells[i] != "-" && cells[i] != "" {
				parts = append(parts, head[i]+" "+cells[i])
			}
		}
		fmt.Fprintf(b.out, "= %s %s: %s\n", r.scenario, r.settings, strings.Join(parts, "; "))
	}
	b.printed = len(b.rows)
}

// tables returns the rows grouped by table, the main table first.
func (b *bench) tables() [][]row {
	var main, notify []row
	for _, r := range b.rows {
		if r.table == tableNotify {
			notify = append(notify, r)
		} else {
			main = append(main, r)
		}
	}
	var out [][]row
	for _, t := range [][]row{main, notify} {
		if len(t) > 0 {
			out = append(out, t)
		}
	}
	return out
}

func (b *bench) printText(w io.Writer) {
	for _, t := range b.tables() {
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "\n"+strings.Join(columns(t[0].table), "\t"))
		for _, r := range t {
			fmt.Fprintln(tw, strings.Join(r.cells(), "\t"))
		}
		_ = tw.Flush()
	}
}

// caption says what a table's rows share.
func (b *bench) caption(table string) string {
	o := b.o
	runs := "one run each"
	if o.repeat > 1 {
		runs = fmt.Sprintf("medians of %d runs, the relays taking turns", o.repeat)
	}
	if table == tableNotify {
		return fmt.Sprintf("What the NOTIFY trigger costs producers: %d producer connections commit one message per transaction at the offered rate for %s after %s of warm-up, no forwarder running; commit = BEGIN to the return of COMMIT; CPU per commit in microseconds, PostgreSQL + the bench process; %s.",
			notifyProducers, o.duration, o.warmup, runs)
	}
	c := fmt.Sprintf("%d messages of %d bytes over %d keys, %d producers writing %d messages per transaction, poll %s; %s.",
		o.messages, o.payload, o.keys, o.producers, o.perTx, o.poll, runs)
	if o.scenarios["steady"] {
		c += fmt.Sprintf(" steady: the producers write flat out while the forwarders run (p99 lag after %s of warm-up).", o.warmup)
	}
	if o.scenarios["latency"] {
		c += fmt.Sprintf(" latency: %d msgs/s offered for %s after %s of warm-up, the relay rows timed from the return of the producer's Commit.", o.rate, o.duration, o.warmup)
	}
	return c
}

// printMarkdown writes the tables in Markdown, each cell escaped, each
// after its caption.
func (b *bench) printMarkdown(w io.Writer) {
	for i, t := range b.tables() {
		if i > 0 {
			fmt.Fprintln(w)
		}
		fmt.Fprintf(w, "%s\n\n", b.caption(t[0].table))
		head := columns(t[0].table)
		fmt.Fprintf(w, "| %s |\n|%s\n", strings.Join(head, " | "), strings.Repeat("---|", len(head)))
		for _, r := range t {
			cells := r.cells()
			for j, c := range cells {
				cells[j] = strings.ReplaceAll(c, "|", "\\|")
			}
			fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
		}
	}
}

// finishOutput prints the final tables and writes the plots and the report
// block that were asked for.
func (b *bench) finishOutput(ctx context.Context, total time.Duration) error {
	b.flush()
	if b.o.markdown {
		fmt.Fprintln(b.out)
		b.printMarkdown(b.out)
	} else {
		b.printText(b.out)
	}
	fmt.Fprintf(b.out, "total %s\n", total)
	var errs []error
	if b.o.plotDir != "" {
		files, err := b.writePlots(b.o.plotDir)
		if err != nil {
			errs = append(errs, fmt.Errorf("-plot: %w", err))
		}
		for _, f := range files {
			fmt.Fprintf(b.out, "plot %s\n", f)
		}
	}
	if b.o.reportFile != "" {
		var blk bytes.Buffer
		fmt.Fprintf(&blk, "Measured with `go run ./cmd/txoutbox-bench %s` (%s).\n\n", b.o.args, total)
		// Written even when the run was interrupted (ctx done).
		fmt.Fprintf(&blk, "Machine: %s.\n\n", b.machine(context.WithoutCancel(ctx)))
		b.printMarkdown(&blk)
		if err := replaceBlock(b.o.reportFile, b.o.db, blk.String()); err != nil {
			errs = append(errs, fmt.Errorf("-report: %w", err))
		} else {
			fmt.Fprintf(b.out, "report %s (block %s)\n", b.o.reportFile, b.o.db)
		}
	}
	return errors.Join(errs...)
}

// conditions is the header line: the workload every scenario shares.
func (b *bench) conditions() string {
	o := b.o
	return fmt.Sprintf("db=%s messages=%d keys=%d payload=%dB per-tx=%d producers=%d poll=%s delete-on-ack=%v repeat=%d",
		o.db, o.messages, o.keys, o.payload, o.perTx, o.producers, o.poll, o.deleteOnAck, o.repeat)
}

// replaceBlock replaces what stands between the markers of block name in
// the file (markers kept) with text.
func replaceBlock(file, name, text string) error {
	data, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	begin, end := "<!-- txoutbox-bench:"+name+" -->", "<!-- /txoutbox-bench:"+name+" -->"
	s := string(data)
	i, j := strings.Index(s, begin), strings.Index(s, end)
	if i < 0 || j < i {
		return fmt.Errorf("%s has no block %s ... %s", file, begin, end)
	}
	s = s[:i+len(begin)] + "\n" + text + s[j:]
	return os.WriteFile(file, []byte(s), 0o644) //nolint:gosec // a Markdown file of the repository
}

// machine describes where the figures come from: CPU, memory, database
// server and its durability settings, Go, and the commit measured.
func (b *bench) machine(ctx context.Context) string {
	var parts []string
	cpu := "unknown CPU"
	if data, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for l := range strings.Lines(string(data)) {
			if v, ok := strings.CutPrefix(l, "model name"); ok {
				cpu = strings.TrimSpace(strings.TrimLeft(v, "\t :"))
				break
			}
		}
	}
	parts = append(parts, fmt.Sprintf("%d x %s", runtime.NumCPU(), cpu))
	if data, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb int64
		if _, err := fmt.Sscanf(string(data), "MemTotal: %d kB", &kb); err == nil {
			parts = append(parts, fmt.Sprintf("%.0f GiB", float64(kb)/(1<<20)))
		}
	}
	parts = append(parts, b.serverInfo(ctx))
	parts = append(parts, runtime.Version()+" "+runtime.GOOS+"/"+runtime.GOARCH)
	if rev := buildRevision(); rev != "" {
		parts = append(parts, "commit "+rev)
	} else if out, err := exec.CommandContext(ctx, "git", "rev-parse", "--short", "HEAD").Output(); err == nil {
		rev := strings.TrimSpace(string(out))
		if st, err := exec.CommandContext(ctx, "git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(bytes.TrimSpace(st)) > 0 {
			rev += " with uncommitted changes"
		}
		parts = append(parts, "commit "+rev)
	}
	parts = append(parts, "database, bench and relays on the same machine")
	if b.loadStart != "" {
		// Other work on the machine depresses every figure: a quiet
		// machine has a load average well under its core count.
		parts = append(parts, fmt.Sprintf("load average %s at the start, %s at the end", b.loadStart, loadAverage()))
	}
	return strings.Join(parts, ", ")
}

func (b *bench) serverInfo(ctx context.Context) string {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if b.o.db == "mysql" {
		db, err := openMySQL(b.o.url, 1)
		if err != nil {
			return "MySQL (version unknown)"
		}
		defer db.Close()
		var v, flush, binlog string
		if err := db.QueryRowContext(ctx, "SELECT VERSION(), @@innodb_flush_log_at_trx_commit, @@log_bin").Scan(&v, &flush, &binlog); err != nil {
			return "MySQL (version unknown)"
		}
		return fmt.Sprintf("MySQL/MariaDB %s (innodb_flush_log_at_trx_commit=%s, log_bin=%s)", v, flush, binlog)
	}
	conn, err := pgx.Connect(ctx, b.o.url)
	if err != nil {
		return "PostgreSQL (version unknown)"
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var v, fsync, sc, sb string
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version'), current_setting('fsync'), current_setting('synchronous_commit'), current_setting('shared_buffers')").Scan(&v, &fsync, &sc, &sb); err != nil {
		return "PostgreSQL (version unknown)"
	}
	return fmt.Sprintf("PostgreSQL %s (fsync=%s, synchronous_commit=%s, shared_buffers=%s)", v, fsync, sc, sb)
}

// faster compares two throughputs, txoutbox's t and Watermill's w:
// "2.10x faster" when t is the higher, "1.14x slower" when it is the lower
// (w/t, so the figure always reads as how many times).
func faster(t, w float64) string {
	if t <= 0 || w <= 0 {
		return "-"
	}
	if t >= w {
		return fmt.Sprintf("%.2fx faster", t/w)
	}
	return fmt.Sprintf("%.2fx slower", w/t)
}

// fraction is a of b as a plain number ("0.55").
func fraction(a, b float64) string {
	if a <= 0 || b <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2f", a/b)
}

// loadAverage is the machine's one-minute load average ("" where /proc has
// none).
func loadAverage() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(data))
	if len(f) == 0 {
		return ""
	}
	return f[0]
}

// buildRevision is the commit the binary was built from, as go build
// stamps it ("" under go run, which does not).
func buildRevision() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	var rev, modified string
	for _, st := range info.Settings {
		switch st.Key {
		case "vcs.revision":
			rev = st.Value
		case "vcs.modified":
			modified = st.Value
		}
	}
	if len(rev) > 7 {
		rev = rev[:7]
	}
	if rev != "" && modified == "true" {
		rev += " with uncommitted changes"
	}
	return rev
}
