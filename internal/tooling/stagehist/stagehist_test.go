package stagehist

import (
	"math"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestQuantileAndDelta(t *testing.T) {
	reg := prometheus.NewRegistry()
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: Metric, Buckets: []float64{1, 2, 4}}, []string{"stage"})
	reg.MustRegister(h)
	for range 10 {
		h.WithLabelValues("read").Observe(1.5) // all in (1, 2]
	}
	h.WithLabelValues("plan").Observe(0.5)
	mfs, _ := reg.Gather()
	before := Set{}
	before.Add(mfs)
	for range 10 {
		h.WithLabelValues("read").Observe(3) // (2, 4]
	}
	mfs, _ = reg.Gather()
	after := Set{}
	after.Add(mfs)
	all := after.Since(nil)
	if all[0].Stage != "plan" || all[1].Stage != "read" {
		t.Fatalf("order %v", all)
	}
	if got := all[1].P50; got != 2 {
		t.Errorf("p50 over both halves %v, want 2 (the bucket edge)", got)
	}
	d := after.Since(before)
	if d[1].Count != 10 || d[1].P50 != 3 {
		t.Errorf("delta %+v: want 10 samples, p50 3 (middle of (2,4])", d[1])
	}
	if !math.IsNaN(d[0].P50) {
		t.Errorf("empty delta p50 %v, want NaN", d[0].P50)
	}
}
