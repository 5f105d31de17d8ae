package main

import (
	"errors"
	"fmt"
	"image/color"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// The plots (-plot DIR) are drawn with gonum.org/v1/plot and written as
// SVG. Each is written only when its scenario ran.

// The colour of each relay, the same in every plot.
var relayColor = map[string]color.Color{
	"txoutbox":  color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	"Watermill": color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
	"floor":     color.RGBA{R: 0x7f, G: 0x7f, B: 0x7f, A: 0xff},
}

// curve is one plotted progress curve: group names the plot it belongs to
// ("drain": drain-progress.svg, "outage": recovery.svg), name its legend.
type curve struct {
	group, name string
	pts         []point
}

// addCurve keeps the progress curve of a run for the plots.
func (b *bench) addCurve(group, name string, oc outcome) {
	if len(oc.curve) > 1 {
		b.curves = append(b.curves, curve{group, name, oc.curve})
	}
}

// AddRecoveryCurve is the hook for the outage scenario: a curve of the
// fraction of a backlog delivered against the seconds since the timing
// began, drawn in recovery.svg beside the other curves added with it (for
// instance the normal drain of the same backlog and the drain after the
// outage).
func (b *bench) AddRecoveryCurve(name string, oc outcome) { b.addCurve("outage", name, oc) }

// writePlots writes the SVG plots of what ran into dir and returns their
// paths.
func (b *bench) writePlots(dir string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil { //nolint:gosec // plots for the docs, readable like any file of the repository
		return nil, err
	}
	var files []string
	var errs []error
	save := func(name string, p *plot.Plot, w, h vg.Length) {
		if p == nil {
			return
		}
		path := filepath.Join(dir, name)
		if err := p.Save(w, h, path); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
			return
		}
		files = append(files, path)
	}
	for _, t := range []struct{ file, title string }{
		{"throughput.svg", "Throughput, no broker latency (msgs/s)"},
		{"throughput-broker-latency.svg", "Throughput, 1 ms broker latency per Publish call (msgs/s)"},
	} {
		p, n := b.throughputPlot(t.file, t.title)
		save(t.file, p, 8*vg.Inch, vg.Length(1.2+0.32*float64(n))*vg.Inch)
	}
	save("latency.svg", b.latencyPlot(), 7*vg.Inch, 4.5*vg.Inch)
	save("drain-progress.svg", b.curvePlot("drain", "Draining a backlog: fraction delivered over time"), 7*vg.Inch, 4.5*vg.Inch)
	save("recovery.svg", b.curvePlot("outage", "Recovery after a broker outage: fraction of the backlog delivered"), 7*vg.Inch, 4.5*vg.Inch)
	save("notify.svg", b.notifyPlot(), 7*vg.Inch, 4.5*vg.Inch)
	save("notify-rate.svg", b.notifyRatePlot(), 7*vg.Inch, 4.5*vg.Inch)
	return files, errors.Join(errs...)
}

// plotLabel is the category label of a row in the throughput plots, and
// the plot it goes in ("" for none).
func plotLabel(r row) (file, label string) {
	if r.table != "" || r.txoV <= 0 && r.wmV <= 0 && r.floorV <= 0 {
		return "", ""
	}
	settings, _, _ := strings.Cut(r.settings, ";")
	settings, _, _ = strings.Cut(settings, ",")
	settings, _, _ = strings.Cut(settings, " (")
	var keep []string
	latency := false
	for f := range strings.FieldsSeq(settings) {
		k, v, ok := strings.Cut(f, "=")
		switch {
		case !ok:
		case k == "latency":
			latency = v != "0s" && v != "0"
			if latency {
				keep = append(keep, v)
			}
		case k == "batch", k == "fwd", k == "conc", k == "strict", k == "producers":
			keep = append(keep, f)
		}
	}
	file = "throughput.svg"
	if latency {
		file = "throughput-broker-latency.svg"
	}
	return file, strings.TrimSpace(r.scenario + " " + strings.Join(keep, " "))
}

// throughputPlot draws, for each row of the main table that has rates and
// belongs in file, txoutbox's, Watermill's and the floor's as horizontal
// bars; n is the number of rows drawn.
func (b *bench) throughputPlot(file, title string) (*plot.Plot, int) {
	var labels []string
	vals := map[string]plotter.Values{}
	for _, r := range b.rows {
		f, label := plotLabel(r)
		if f != file {
			continue
		}
		labels = append(labels, label)
		vals["txoutbox"] = append(vals["txoutbox"], r.txoV)
		vals["Watermill"] = append(vals["Watermill"], r.wmV)
		vals["floor"] = append(vals["floor"], r.floorV)
	}
	if len(labels) == 0 {
		return nil, 0
	}
	// The first row on top.
	slices.Reverse(labels)
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "msgs/s"
	p.Legend.Top = true
	var series []string
	for _, name := range []string{"txoutbox", "Watermill", "floor"} {
		if slices.ContainsFunc(vals[name], func(v float64) bool { return v > 0 }) {
			series = append(series, name)
		}
	}
	w := vg.Points(7)
	for i, name := range series {
		v := slices.Clone(vals[name])
		slices.Reverse(v)
		bars, err := plotter.NewBarChart(v, w)
		if err != nil {
			continue
		}
		bars.Horizontal = true
		bars.LineStyle.Width = 0
		bars.Color = relayColor[name]
		bars.Offset = w * vg.Length(len(series)-1-2*i) / 2
		p.Add(bars)
		p.Legend.Add(name, bars)
	}
	p.NominalY(labels...)
	p.Add(plotter.NewGrid())
	p.X.Min = 0
	p.X.Max *= 1.3 // room for the legend beside the longest bar
	return p, len(labels)
}

// latencyPlot draws the distribution of the latency scenario's latencies
// per relay (all runs pooled): the fraction of messages delivered within x.
func (b *bench) latencyPlot() *plot.Plot {
	if len(b.latSamples) == 0 {
		return nil
	}
	p := plot.New()
	p.Title.Text = fmt.Sprintf("Latency distribution at %d msgs/s offered (send stamp to delivery)", b.o.rate)
	p.X.Label.Text = "ms (log scale)"
	p.Y.Label.Text = "fraction of messages delivered within"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Legend.Left, p.Legend.Top = true, true
	for _, name := range []string{"txoutbox", "Watermill"} {
		lats := slices.Clone(b.latSamples[name])
		if len(lats) == 0 {
			continue
		}
		slices.Sort(lats)
		// At most 500 points, evenly spaced in rank.
		step := max(len(lats)/500, 1)
		var xy plotter.XYs
		for i := 0; i < len(lats); i += step {
			xy = append(xy, plotter.XY{X: max(float64(lats[i])/float64(time.Millisecond), 0.01), Y: float64(i+1) / float64(len(lats))})
		}
		xy = append(xy, plotter.XY{X: max(float64(lats[len(lats)-1])/float64(time.Millisecond), 0.01), Y: 1})
		l, err := plotter.NewLine(xy)
		if err != nil {
			continue
		}
		l.Color = relayColor[name]
		l.Width = vg.Points(1.5)
		p.Add(l)
		p.Legend.Add(name, l)
	}
	p.Add(plotter.NewGrid())
	return p
}

// curvePlot draws the progress curves of group, or returns nil if there are
// none.
func (b *bench) curvePlot(group, title string) *plot.Plot {
	var cs []curve
	for _, c := range b.curves {
		if c.group == group {
			cs = append(cs, c)
		}
	}
	if len(cs) == 0 {
		return nil
	}
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "seconds"
	p.Y.Label.Text = "fraction delivered"
	p.Legend.Left, p.Legend.Top = false, false
	p.Legend.XOffs = -vg.Points(4)
	p.Legend.YOffs = vg.Points(4)
	p.Y.Min, p.Y.Max = 0, 1
	for i, c := range cs {
		xy := make(plotter.XYs, len(c.pts))
		for j, pt := range c.pts {
			xy[j] = plotter.XY{X: pt.x, Y: pt.y}
		}
		l, err := plotter.NewLine(xy)
		if err != nil {
			continue
		}
		l.Color = cmpColor(c.name, i)
		l.Width = vg.Points(1.5)
		p.Add(l)
		p.Legend.Add(c.name, l)
	}
	p.Add(plotter.NewGrid())
	return p
}

// cmpColor is a relay's colour, or one of a few others for other names.
func cmpColor(name string, i int) color.Color {
	if c, ok := relayColor[name]; ok {
		return c
	}
	others := []color.Color{
		color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
		color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
		color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
	}
	return others[i%len(others)]
}

// notifyPlot draws the producers' commit latency against the offered rate,
// with and without the NOTIFY trigger.
func (b *bench) notifyPlot() *plot.Plot {
	if len(b.notifyPts) == 0 {
		return nil
	}
	p := plot.New()
	p.Title.Text = "Producers' commit latency with and without the NOTIFY trigger"
	p.X.Label.Text = "offered commits/s (log scale)"
	p.Y.Label.Text = "ms, BEGIN to COMMIT returned"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Legend.Left, p.Legend.Top = true, true
	for _, s := range []struct {
		name string
		get  func(notifyPoint) time.Duration
		clr  color.Color
		dash bool
	}{
		{"p99 with NOTIFY", func(n notifyPoint) time.Duration { return n.with.p99 }, relayColor["txoutbox"], false},
		{"p99 without", func(n notifyPoint) time.Duration { return n.without.p99 }, relayColor["floor"], false},
		{"p50 with NOTIFY", func(n notifyPoint) time.Duration { return n.with.p50 }, relayColor["txoutbox"], true},
		{"p50 without", func(n notifyPoint) time.Duration { return n.without.p50 }, relayColor["floor"], true},
	} {
		var xy plotter.XYs
		for _, n := range b.notifyPts {
			if v := s.get(n); v > 0 {
				xy = append(xy, plotter.XY{X: float64(n.rate), Y: float64(v) / float64(time.Millisecond)})
			}
		}
		if len(xy) == 0 {
			continue
		}
		l, pts, err := plotter.NewLinePoints(xy)
		if err != nil {
			continue
		}
		l.Color, pts.Color = s.clr, s.clr
		pts.Shape = draw.CircleGlyph{}
		if s.dash {
			l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		}
		p.Add(l, pts)
		p.Legend.Add(s.name, l, pts)
	}
	p.Add(plotter.NewGrid())
	return p
}

// notifyRatePlot draws the commits/s the producers achieved against the
// rate offered, with and without the NOTIFY trigger.
func (b *bench) notifyRatePlot() *plot.Plot {
	if len(b.notifyPts) == 0 {
		return nil
	}
	p := plot.New()
	p.Title.Text = "Commits/s the producers achieved, with and without the NOTIFY trigger"
	p.X.Label.Text = "offered commits/s (log scale)"
	p.Y.Label.Text = "achieved commits/s (log scale)"
	p.X.Scale, p.Y.Scale = plot.LogScale{}, plot.LogScale{}
	p.X.Tick.Marker, p.Y.Tick.Marker = plot.LogTicks{Prec: -1}, plot.LogTicks{Prec: -1}
	p.Legend.Left, p.Legend.Top = true, true
	var offered plotter.XYs
	for _, n := range b.notifyPts {
		offered = append(offered, plotter.XY{X: float64(n.rate), Y: float64(n.rate)})
	}
	for _, s := range []struct {
		name string
		get  func(notifyPoint) float64
		clr  color.Color
	}{
		{"with NOTIFY", func(n notifyPoint) float64 { return n.with.achieved }, relayColor["txoutbox"]},
		{"without", func(n notifyPoint) float64 { return n.without.achieved }, relayColor["floor"]},
	} {
		var xy plotter.XYs
		for _, n := range b.notifyPts {
			if v := s.get(n); v > 0 {
				xy = append(xy, plotter.XY{X: float64(n.rate), Y: v})
			}
		}
		if len(xy) == 0 {
			continue
		}
		l, pts, err := plotter.NewLinePoints(xy)
		if err != nil {
			continue
		}
		l.Color, pts.Color = s.clr, s.clr
		pts.Shape = draw.CircleGlyph{}
		p.Add(l, pts)
		p.Legend.Add(s.name, l, pts)
	}
	if l, err := plotter.NewLine(offered); err == nil {
		l.Dashes = []vg.Length{vg.Points(2), vg.Points(3)}
		p.Add(l)
		p.Legend.Add("offered", l)
	}
	p.Add(plotter.NewGrid())
	return p
}
