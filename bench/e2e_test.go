package bench

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/tooling/benche2e"
)

// BenchmarkE2E runs the `kvflow bench e2e` presets in this process (the
// command's --in-process; its default runs `kvflow serve` processes, which
// a test binary cannot exec): one prefill and one decode instance on
// loopback (real TCP engines, real ZMQ side channels), each workload driven
// twice per iteration on the same
// workers — kvflow's pipeline (every request loaded at once, or on the
// mixed schedule) and the serial baseline (load, wait for done, next) —
// with 16 requests per run verified byte by byte. The caches are capped at
// 1 GiB per benchmark, so the Llama-3-8B-like presets move fewer than 32
// layers (the layers metric; op sizes are the full model's). Metrics are
// the last iteration's: kvflow_GB/s, serial_GB/s, kvflow_req/s,
// serial_req/s, p50_ms/p99_ms of each mode, short_p50_ms (mixed: the
// 1-block requests' median wait) and ratio_* = kvflow / serial.
//
//	go test -run '^$' -bench E2E -benchtime 1x ./bench/
func BenchmarkE2E(b *testing.B) {
	cases := []struct {
		name     string
		tp       [2]int
		requests int
	}{
		{benche2e.Long, [2]int{1, 1}, 0}, {benche2e.Long, [2]int{4, 2}, 0},
		{benche2e.Batch, [2]int{1, 1}, 0}, {benche2e.Batch, [2]int{4, 2}, 0},
		{benche2e.Burst, [2]int{1, 1}, 0}, {benche2e.Burst, [2]int{4, 2}, 0},
		{benche2e.Mixed, [2]int{1, 1}, 0},
		{benche2e.Small, [2]int{1, 1}, 0},
	}
	for _, c := range cases {
		b.Run(fmt.Sprintf("%s/tp%d-%d", c.name, c.tp[0], c.tp[1]), func(b *testing.B) {
			w, err := benche2e.Preset(c.name)
			if err != nil {
				b.Fatal(err)
			}
			w.PrefillTP, w.DecodeTP = c.tp[0], c.tp[1]
			var rep *benche2e.Report
			for b.Loop() {
				rep, err = benche2e.Bench(context.Background(), benche2e.Options{Workload: w, MaxMem: 1 << 30, Verify: 16,
					RawBytes: 256 << 20, Timeout: 2 * time.Minute})
				if err != nil {
					b.Fatal(err)
				}
				for _, r := range rep.Runs {
					if r.Failed > 0 || r.BadBytes > 0 {
						b.Fatalf("%s: %d failed, %d bad bytes: %s", r.Mode, r.Failed, r.BadBytes, r.FirstErr)
					}
				}
			}
			b.ReportMetric(float64(rep.Workload.Layers), "layers")
			b.ReportMetric(rep.RawTCP1, "rawtcp_GB/s")
			for _, r := range rep.Runs {
				b.ReportMetric(r.GBps, r.Mode+"_GB/s")
				b.ReportMetric(r.ReqPerSec, r.Mode+"_req/s")
				b.ReportMetric(float64(r.All.P50)/1e6, r.Mode+"_p50_ms")
				b.ReportMetric(float64(r.All.P99)/1e6, r.Mode+"_p99_ms")
				if r.Short != nil {
					b.ReportMetric(float64(r.Short.P50)/1e6, r.Mode+"_short_p50_ms")
				}
			}
			for k, v := range rep.Ratios {
				b.ReportMetric(v, "ratio_"+k)
			}
		})
	}
}
