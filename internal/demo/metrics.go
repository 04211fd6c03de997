package demo

import (
	"context"

	"github.com/kvflow/kvflow/internal/stagehist"
)

// stageLatencies sums the decode workers' kvflow_stage_duration_seconds
// histograms by stage and reads p50 and p99 off them.
func (d *driver) stageLatencies(ctx context.Context) []StageLatency {
	set := stagehist.Set{}
	for _, w := range d.decode {
		mfs, err := w.Scrape(ctx)
		if err != nil {
			continue
		}
		set.Add(mfs)
	}
	var out []StageLatency
	for _, l := range set.Since(nil) {
		out = append(out, StageLatency{Stage: l.Stage, P50: l.P50, P99: l.P99, Count: l.Items})
	}
	return out
}
