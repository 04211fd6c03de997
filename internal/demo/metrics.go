package demo

import (
	"fmt"
	"math"
	"net/http"
	"sort"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// scrape fetches one worker's metric families.
func scrape(addr string) (map[string]*dto.MetricFamily, error) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("metrics %s: %s", addr, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	return p.TextToMetricFamilies(resp.Body)
}

type buckets struct {
	upper []float64
	cum   []float64
	count float64
}

// stageLatencies merges the decode workers' kvflow_stage_duration_seconds
// histograms by stage and reads p50 and p99 off them (linear inside a
// bucket, as PromQL's histogram_quantile does).
func (d *driver) stageLatencies() []StageLatency {
	merged := map[string]*buckets{}
	var order []string
	for _, w := range d.decode {
		mfs, err := scrape(w.metrics)
		if err != nil {
			continue
		}
		mf := mfs["kvflow_stage_duration_seconds"]
		if mf == nil {
			continue
		}
		for _, m := range mf.GetMetric() {
			stage := ""
			for _, l := range m.GetLabel() {
				if l.GetName() == "stage" {
					stage = l.GetValue()
				}
			}
			h := m.GetHistogram()
			b := merged[stage]
			if b == nil {
				b = &buckets{}
				for _, bk := range h.GetBucket() {
					b.upper = append(b.upper, bk.GetUpperBound())
					b.cum = append(b.cum, 0)
				}
				merged[stage] = b
				order = append(order, stage)
			}
			for i, bk := range h.GetBucket() {
				if i < len(b.cum) {
					b.cum[i] += float64(bk.GetCumulativeCount())
				}
			}
			b.count += float64(h.GetSampleCount())
		}
	}
	rank := map[string]int{"plan": 0, "handshake": 1, "read": 2, "stitch": 3, "notify": 4}
	sort.SliceStable(order, func(i, j int) bool { return rank[order[i]] < rank[order[j]] })
	var out []StageLatency
	for _, st := range order {
		b := merged[st]
		out = append(out, StageLatency{Stage: st, P50: b.quantile(0.5), P99: b.quantile(0.99), Count: b.count})
	}
	return out
}

func (b *buckets) quantile(q float64) float64 {
	if b.count == 0 {
		return math.NaN()
	}
	target := q * b.count
	lower, prev := 0.0, 0.0
	for i, up := range b.upper {
		if b.cum[i] >= target {
			if b.cum[i] == prev {
				return up
			}
			return lower + (up-lower)*(target-prev)/(b.cum[i]-prev)
		}
		lower, prev = up, b.cum[i]
	}
	return lower // beyond the last finite bucket
}
