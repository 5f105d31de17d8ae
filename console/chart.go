package console

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// The chart is an inline SVG drawn on the server: no script draws it and
// nothing is fetched for it.
const (
	chartW = 520
	chartH = 110
)

// chart is one series ready for the template.
type chart struct {
	Title  string
	Now    string // the latest value, formatted
	Max    string // the value of the top line, formatted
	Span   string // the time the x axis spans, e.g. "10m"
	Lines  []string
	Dots   []dot // lone points, which a polyline would not show
	W, H   int
	Stroke string
	Empty  bool
}

type dot struct{ X, Y string }

type point struct {
	at time.Time
	v  float64
}

// charts returns the throughput and lag charts of the samples, oldest
// first, spanning window up to now.
func charts(ss []sample, window time.Duration, interval time.Duration, now time.Time) (throughput, lag chart) {
	var rate, age [][]point // runs of points without a gap
	var rateRun, ageRun []point
	var prev *sample
	for i := range ss {
		s := &ss[i]
		if !s.ok {
			rate, rateRun = appendRun(rate, rateRun)
			age, ageRun = appendRun(age, ageRun)
			prev = nil
			continue
		}
		if prev != nil && s.at.Sub(prev.at) > 3*interval { // the sampler slept: a gap
			rate, rateRun = appendRun(rate, rateRun)
			age, ageRun = appendRun(age, ageRun)
		}
		ageRun = append(ageRun, point{s.at, s.stats.OldestPendingAge.Seconds()})
		if prev != nil && s.at.Sub(prev.at) <= 3*interval && s.stats.Delivered >= prev.stats.Delivered {
			dt := s.at.Sub(prev.at).Seconds()
			rateRun = append(rateRun, point{s.at, float64(s.stats.Delivered-prev.stats.Delivered) / dt})
		} else if prev != nil { // purged in between: no rate for this step
			rate, rateRun = appendRun(rate, rateRun)
		}
		prev = s
	}
	rate, _ = appendRun(rate, rateRun)
	age, _ = appendRun(age, ageRun)
	throughput = draw("Throughput (delivered/s)", rate, window, now, "#2563eb", formatRate)
	lag = draw("Lag (oldest pending age)", age, window, now, "#d97706", formatSeconds)
	return throughput, lag
}

func appendRun(runs [][]point, run []point) ([][]point, []point) {
	if len(run) > 0 {
		runs = append(runs, run)
	}
	return runs, nil
}

func draw(title string, runs [][]point, window time.Duration, now time.Time, stroke string, format func(float64) string) chart {
	c := chart{Title: title, W: chartW, H: chartH, Stroke: stroke, Span: formatSpan(window)}
	top, last, n := 0.0, 0.0, 0
	for _, run := range runs {
		for _, p := range run {
			top = max(top, p.v)
			last = p.v
			n++
		}
	}
	if n == 0 {
		c.Empty, c.Now, c.Max = true, "–", format(0)
		return c
	}
	top = niceCeil(top)
	c.Now, c.Max = format(last), format(top)
	pad := 4.0
	x := func(at time.Time) float64 {
		f := 1 - now.Sub(at).Seconds()/window.Seconds()
		return pad + math.Max(0, math.Min(1, f))*(chartW-2*pad)
	}
	y := func(v float64) float64 { return pad + (1-v/top)*(chartH-2*pad) }
	for _, run := range runs {
		if len(run) == 1 {
			c.Dots = append(c.Dots, dot{fmtF(x(run[0].at)), fmtF(y(run[0].v))})
			continue
		}
		var b strings.Builder
		lastX := math.Inf(-1)
		for i, p := range run {
			px := x(p.at)
			if px-lastX < 1 && i != len(run)-1 { // at most a point a pixel: the SVG stays small with many samples
				continue
			}
			lastX = px
			if b.Len() > 0 {
				b.WriteByte(' ')
			}
			b.WriteString(fmtF(px) + "," + fmtF(y(p.v)))
		}
		c.Lines = append(c.Lines, b.String())
	}
	return c
}

func fmtF(f float64) string { return strconv.FormatFloat(f, 'f', 1, 64) }

// niceCeil rounds v up to 1, 2 or 5 times a power of ten, so the top line
// reads well; at least 1.
func niceCeil(v float64) float64 {
	if v <= 1 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

func formatRate(v float64) string {
	if v >= 100 || v == math.Trunc(v) {
		return strconv.FormatFloat(v, 'f', 0, 64) + "/s"
	}
	return strconv.FormatFloat(v, 'f', 1, 64) + "/s"
}

func formatSeconds(v float64) string {
	return formatDuration(time.Duration(v * float64(time.Second)))
}

func formatSpan(d time.Duration) string {
	if d >= time.Minute && d%time.Minute == 0 {
		return fmt.Sprintf("%dm", int(d.Minutes()))
	}
	return d.Round(time.Second).String()
}

// formatDuration is a short human duration: 850ms, 42s, 3m12s, 5h3m, 2d4h.
func formatDuration(d time.Duration) string {
	switch {
	case d <= 0:
		return "0s"
	case d < time.Second:
		return fmt.Sprintf("%dms", d.Milliseconds())
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
}
