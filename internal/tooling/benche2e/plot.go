package benche2e

import (
	"errors"
	"fmt"
	"io"
	"os"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgsvg"
)

// WritePlot draws res (Plot) to an SVG file at path.
func WritePlot(path string, res *Result) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("bench e2e: --plot: %w", err)
	}
	if err := Plot(f, res); err != nil {
		f.Close()
		return fmt.Errorf("bench e2e: --plot: %w", err)
	}
	return f.Close()
}

// Plot draws res as SVG: the first row is throughput per workload (GB/s:
// kvflow, serial and the raw TCP ceiling of the same run; requests/s:
// kvflow and serial), then one panel per workload with each stage's p50
// and p99 (decode workers' histograms) in each mode. With repeated runs of
// a mode (rounds), its median run is drawn (Report.Typical, as the tables).
func Plot(w io.Writer, res *Result) error {
	if len(res.Reports) == 0 {
		return errors.New("nothing to plot")
	}
	labels := make([]string, len(res.Reports))
	for i, rep := range res.Reports {
		labels[i] = label(rep.Workload)
	}
	title := "kvflow bench e2e"
	if res.Netem != "" {
		title += fmt.Sprintf(" (netem %q)", res.Netem)
	}
	gb, err := groupedBars(title+": throughput, GB/s", "GB/s", labels, []series{
		{"kvflow", each(res, func(r *Report) float64 { return runOf(r, ModePipeline).GBps })},
		{"serial", each(res, func(r *Report) float64 { return runOf(r, ModeSerial).GBps })},
		{"raw TCP (1 conn)", each(res, func(r *Report) float64 { return r.RawTCP1 })},
	})
	if err != nil {
		return err
	}
	rq, err := groupedBars("requests/s", "req/s", labels, []series{
		{"kvflow", each(res, func(r *Report) float64 { return runOf(r, ModePipeline).ReqPerSec })},
		{"serial", each(res, func(r *Report) float64 { return runOf(r, ModeSerial).ReqPerSec })},
	})
	if err != nil {
		return err
	}
	const cols = 2
	rows := 1 + (len(res.Reports)+cols-1)/cols
	grid := make([][]*plot.Plot, rows)
	for r := range grid {
		grid[r] = make([]*plot.Plot, cols)
	}
	grid[0][0], grid[0][1] = gb, rq
	for i, rep := range res.Reports {
		p, err := stagePlot(rep)
		if err != nil {
			return err
		}
		grid[1+i/cols][i%cols] = p
	}
	c := vgsvg.New(14*vg.Inch, vg.Length(rows)*3.6*vg.Inch)
	dc := draw.New(c)
	tiles := draw.Tiles{Rows: rows, Cols: cols, PadX: vg.Inch / 3, PadY: vg.Inch / 3,
		PadTop: vg.Inch / 6, PadBottom: vg.Inch / 6, PadLeft: vg.Inch / 6, PadRight: vg.Inch / 6}
	canvases := plot.Align(grid, tiles, dc)
	for r := range grid {
		for k := range grid[r] {
			if grid[r][k] != nil {
				grid[r][k].Draw(canvases[r][k])
			}
		}
	}
	_, err = c.WriteTo(w)
	return err
}

func label(w Workload) string { return fmt.Sprintf("%s tp%d-%d", w.Name, w.PrefillTP, w.DecodeTP) }

type series struct {
	name string
	vals plotter.Values
}

func each(res *Result, f func(*Report) float64) plotter.Values {
	out := make(plotter.Values, len(res.Reports))
	for i, r := range res.Reports {
		out[i] = f(r)
	}
	return out
}

// runOf is mode's typical run in rep (a zero run if it has none).
func runOf(rep *Report, mode string) RunReport {
	if r := rep.Typical(mode); r != nil {
		return *r
	}
	return RunReport{Mode: mode}
}

// groupedBars is one bar per series side by side at each label.
func groupedBars(title, ylabel string, labels []string, ss []series) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = ylabel
	p.Y.Min = 0
	p.Legend.Top = true
	width := vg.Points(min(14, 220/float64(len(labels)*len(ss))))
	// Headroom above the tallest bar for the legend.
	top := 0.0
	for _, s := range ss {
		for _, v := range s.vals {
			top = max(top, v)
		}
	}
	if top > 0 {
		p.Y.Max = top * (1.1 + 0.08*float64(len(ss)))
	}
	for i, s := range ss {
		b, err := plotter.NewBarChart(s.vals, width)
		if err != nil {
			return nil, err
		}
		b.LineStyle.Width = 0
		b.Color = plotutil.Color(i)
		b.Offset = vg.Length(float64(i)-float64(len(ss)-1)/2) * width
		p.Add(b)
		p.Legend.Add(s.name, b)
	}
	p.NominalX(labels...)
	return p, nil
}

// stagePlot is rep's per-stage p50 and p99 in each mode, milliseconds.
func stagePlot(rep *Report) (*plot.Plot, error) {
	var stages []string
	seen := map[string]bool{}
	for _, r := range rep.Runs {
		for _, s := range r.Stages {
			if !seen[s.Stage] {
				seen[s.Stage] = true
				stages = append(stages, s.Stage)
			}
		}
	}
	var ss []series
	for _, mode := range []string{ModePipeline, ModeSerial} {
		r := runOf(rep, mode)
		if len(r.Stages) == 0 {
			continue
		}
		by := map[string]StageLatency{}
		for _, s := range r.Stages {
			by[s.Stage] = s
		}
		p50, p99 := make(plotter.Values, len(stages)), make(plotter.Values, len(stages))
		for i, st := range stages {
			p50[i], p99[i] = by[st].P50*1e3, by[st].P99*1e3
		}
		ss = append(ss, series{mode + " p50", p50}, series{mode + " p99", p99})
	}
	if len(stages) == 0 {
		stages, ss = []string{"(no stage metrics)"}, []series{{"none", plotter.Values{0}}}
	}
	return groupedBars(label(rep.Workload)+": per-stage latency (decode workers' metrics)", "ms", stages, ss)
}
