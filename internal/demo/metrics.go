package demo

import (
	"context"
	"math"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvflow/kvflow/internal/stagehist"
)

// workerMetrics reads, off the decode workers' /metrics, what the summary
// reports beside the driver's own measurements: per-stage p50/p99 (their
// kvflow_stage_duration_seconds summed by stage), the workers' own request
// latency (kvflow_decode_request_duration_seconds{outcome="done"}: load to
// end, none of the driver's time), and the bytes read with the time the
// read stage spent on them.
func (d *driver) workerMetrics(ctx context.Context, s *Summary) {
	set := stagehist.Set{}
	var lat stagehist.Hist
	for _, w := range d.decode {
		mfs, err := w.Scrape(ctx)
		if err != nil {
			continue
		}
		set.Add(mfs)
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				switch mf.GetName() {
				case "kvflow_shm_batches_total":
					if label(m, "path") == "shm" {
						s.ShmBatches += m.GetCounter().GetValue()
					} else {
						s.NetBatches += m.GetCounter().GetValue()
					}
				case "kvflow_shm_fallbacks_total":
					if label(m, "reason") != "other_host" {
						s.ShmFallbacks += m.GetCounter().GetValue()
					}
				case "kvflow_read_bytes_total":
					s.ReadBytes += m.GetCounter().GetValue()
				case stagehist.Metric:
					if label(m, "stage") == "read" {
						s.ReadSeconds += m.GetHistogram().GetSampleSum()
					}
				case "kvflow_decode_request_duration_seconds":
					if label(m, "outcome") == "done" {
						addHist(&lat, m.GetHistogram())
					}
				}
			}
		}
	}
	for _, l := range set.Since(nil) {
		s.Stages = append(s.Stages, StageLatency{Stage: l.Stage, P50: l.P50, P99: l.P99, Count: l.Items})
	}
	s.WorkerP50, s.WorkerP99 = math.NaN(), math.NaN()
	if lat.Count > 0 {
		s.WorkerP50, s.WorkerP99 = lat.Quantile(0.5), lat.Quantile(0.99)
	}
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// addHist sums the cumulative buckets of h into dst.
func addHist(dst *stagehist.Hist, h *dto.Histogram) {
	if dst.Upper == nil {
		for _, b := range h.GetBucket() {
			dst.Upper = append(dst.Upper, b.GetUpperBound())
			dst.Cum = append(dst.Cum, 0)
		}
	}
	for i, b := range h.GetBucket() {
		if i < len(dst.Cum) {
			dst.Cum[i] += float64(b.GetCumulativeCount())
		}
	}
	dst.Count += float64(h.GetSampleCount())
}
