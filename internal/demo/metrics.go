package demo

import (
	"fmt"
	"net/http"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvflow/kvflow/internal/stagehist"
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

// stageLatencies sums the decode workers' kvflow_stage_duration_seconds
// histograms by stage and reads p50 and p99 off them.
func (d *driver) stageLatencies() []StageLatency {
	set := stagehist.Set{}
	for _, w := range d.decode {
		mfs, err := scrape(w.metrics)
		if err != nil {
			continue
		}
		fams := make([]*dto.MetricFamily, 0, len(mfs))
		for _, mf := range mfs {
			fams = append(fams, mf)
		}
		set.Add(fams)
	}
	var out []StageLatency
	for _, l := range set.Since(nil) {
		out = append(out, StageLatency{Stage: l.Stage, P50: l.P50, P99: l.P99, Count: l.Items})
	}
	return out
}
