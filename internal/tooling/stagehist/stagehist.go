// Package stagehist reads per-stage latency quantiles off gathered
// kvflow_stage_duration_seconds histograms: it sums the histograms of
// several workers by stage, subtracts an earlier snapshot, and
// interpolates quantiles inside buckets as PromQL's histogram_quantile
// does. The demo and `kvflow bench e2e` print its results. It never
// gathers or scrapes by itself.
package stagehist

import (
	"math"
	"slices"
	"sort"

	dto "github.com/prometheus/client_model/go"
)

// Metric is the histogram it reads.
const Metric = "kvflow_stage_duration_seconds"

// Hist is one stage's cumulative buckets, summed over workers.
type Hist struct {
	Upper []float64
	Cum   []float64
	Count float64 // timed samples (fast stages are sampled: see pipeline)
	Items float64 // items the stage processed (kvflow_stage_items_total, not skipped)
}

// Set is histograms by stage.
type Set map[string]*Hist

// Add sums the stage histograms found in families into s.
func (s Set) Add(families []*dto.MetricFamily) {
	for _, mf := range families {
		if mf.GetName() != Metric {
			continue
		}
		for _, m := range mf.GetMetric() {
			s.add(m)
		}
	}
	for _, mf := range families {
		if mf.GetName() != "kvflow_stage_items_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var stage, outcome string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "stage":
					stage = l.GetValue()
				case "outcome":
					outcome = l.GetValue()
				}
			}
			if h := s[stage]; h != nil && outcome != "skipped" {
				h.Items += m.GetCounter().GetValue()
			}
		}
	}
}

func (s Set) add(m *dto.Metric) {
	stage := ""
	for _, l := range m.GetLabel() {
		if l.GetName() == "stage" {
			stage = l.GetValue()
		}
	}
	h := m.GetHistogram()
	b := s[stage]
	if b == nil {
		b = &Hist{}
		for _, bk := range h.GetBucket() {
			b.Upper = append(b.Upper, bk.GetUpperBound())
			b.Cum = append(b.Cum, 0)
		}
		s[stage] = b
	}
	for i, bk := range h.GetBucket() {
		if i < len(b.Cum) {
			b.Cum[i] += float64(bk.GetCumulativeCount())
		}
	}
	b.Count += float64(h.GetSampleCount())
}

// Latency is one stage's summary.
type Latency struct {
	Stage    string
	P50, P99 float64 // seconds; NaN without samples
	Count    float64 // timed samples
	Items    float64 // items processed
}

var order = map[string]int{"plan": 0, "handshake": 1, "read": 2, "stitch": 3, "notify": 4}

// Since summarises s minus before (nil: s itself), stages in pipeline order.
func (s Set) Since(before Set) []Latency {
	var names []string
	for n := range s {
		names = append(names, n)
	}
	sort.Slice(names, func(i, j int) bool {
		if order[names[i]] != order[names[j]] {
			return order[names[i]] < order[names[j]]
		}
		return names[i] < names[j]
	})
	var out []Latency
	for _, n := range names {
		a := s[n]
		d := &Hist{Upper: a.Upper, Cum: slices.Clone(a.Cum), Count: a.Count, Items: a.Items}
		if b := before[n]; b != nil {
			for i := range d.Cum {
				if i < len(b.Cum) {
					d.Cum[i] -= b.Cum[i]
				}
			}
			d.Count -= b.Count
			d.Items -= b.Items
		}
		out = append(out, Latency{Stage: n, Count: d.Count, Items: d.Items, P50: d.Quantile(0.5), P99: d.Quantile(0.99)})
	}
	return out
}

// Quantile interpolates linearly inside the bucket holding q (NaN when
// empty; the last finite bound when q falls in the +Inf bucket).
func (h *Hist) Quantile(q float64) float64 {
	if h.Count <= 0 {
		return math.NaN()
	}
	target := q * h.Count
	lower, prev := 0.0, 0.0
	for i, up := range h.Upper {
		if h.Cum[i] >= target {
			if h.Cum[i] == prev {
				return up
			}
			return lower + (up-lower)*(target-prev)/(h.Cum[i]-prev)
		}
		lower, prev = up, h.Cum[i]
	}
	return lower
}
