package benche2e

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvflow/kvflow/internal/config"
)

// Describe is the workload's one-line shape.
func (w Workload) Describe() string {
	var b strings.Builder
	switch w.Name {
	case Mixed:
		fmt.Fprintf(&b, "%s: %d × %d-block requests at t=0 + %d × 1-block every %v", w.Name, w.Requests, w.Blocks, w.Short, w.Interval)
	case Small:
		fmt.Fprintf(&b, "%s: %d requests × 1-%d blocks", w.Name, w.Requests, w.Blocks)
	case SlowPeer:
		fmt.Fprintf(&b, "%s: %d × %d-block requests to a healthy prefill rank + %d to a stalled one among them (read.timeout %v)", w.Name, w.Requests, w.Blocks, w.Slow, SlowReadTimeout)
	default:
		fmt.Fprintf(&b, "%s: %d requests × %d blocks", w.Name, w.Requests, w.Blocks)
	}
	fmt.Fprintf(&b, ", TP %d → %d, %d KV heads × dim %d, block %d, bf16, %d of %d layers", w.PrefillTP, w.DecodeTP, w.KVHeads, w.HeadDim, w.BlockSize, w.Layers, w.ModelLayers)
	if w.Layers < w.ModelLayers {
		b.WriteString(" (fewer layers to fit the memory cap: per-op sizes are the full model's, requests carry fewer ops)")
	}
	if w.TEBackend != "" && w.TEBackend != config.BackendTCP {
		fmt.Fprintf(&b, ", te_backend %s", w.TEBackend)
		if w.TEBackend == config.BackendMooncake {
			b.WriteString(" (its tcp transport)")
		}
	}
	return b.String()
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2fms", float64(d)/1e6) }

// WriteText prints the report as tables.
func (rep *Report) WriteText(w io.Writer) {
	fmt.Fprintf(w, "== %s\n", rep.Workload.Describe())
	fmt.Fprintf(w, "   %s per block (all ranks of one side), %s of caches in all\n", gib(rep.BlockBytes), gib(rep.CacheBytes))
	if rep.Workers != "" {
		fmt.Fprintf(w, "   workers: %s\n", rep.Workers)
	}
	if rep.RawTCP1 > 0 {
		fmt.Fprintf(w, "   raw TCP loopback ceiling (same run): 1 conn %.2f GB/s (median of %s: one stream before each round, one after the last), 4 conns %.2f GB/s\n", rep.RawTCP1, gbList(rep.RawSamples), rep.RawTCP4)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\treq\tfailed\tGiB\twall\tGB/s\treq/s\tp50\tp99\tmax\tverified\tbad bytes\t")
	for _, r := range rep.Runs {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.2f\t%s\t%.2f\t%.0f\t%s\t%s\t%s\t%d\t%d\t\n", rep.runName(r), r.Requests, r.Failed, float64(r.Bytes)/(1<<30),
			ms(r.Wall), r.GBps, r.ReqPerSec, ms(r.All.P50), ms(r.All.P99), ms(r.All.Max), r.Verified, r.BadBytes)
		for _, c := range []struct {
			name string
			l    *Latency
		}{{"  long", r.Long}, {"  1-block", r.Short}, {"  stalled rank", r.Slow}} {
			if c.l != nil {
				fmt.Fprintf(tw, "%s\t%d\t\t\t\t\t\t%s\t%s\t%s\t\t\t\n", c.name, c.l.Count, ms(c.l.P50), ms(c.l.P99), ms(c.l.Max))
			}
		}
	}
	tw.Flush()
	if _, ok := rep.Ratios["gb_per_s"]; ok {
		fmt.Fprintf(w, "   kvflow/serial%s: GB/s %.2f×, req/s %.2f×, p50 latency %.2f×, p99 latency %.2f×",
			rep.medianOf(), rep.Ratios["gb_per_s"], rep.Ratios["requests_per_s"], rep.Ratios["latency_p50"], rep.Ratios["latency_p99"])
		if v, ok := rep.Ratios["short_latency_p50"]; ok {
			fmt.Fprintf(w, "; 1-block p50 %.3f×, p99 %.3f×", v, rep.Ratios["short_latency_p99"])
		}
		fmt.Fprintln(w)
	}
	if v, ok := rep.Ratios["healthy_latency_p50"]; ok {
		fmt.Fprintf(w, "   healthy requests with the stalled rank's / alone%s: p50 latency %.2f×, p99 latency %.2f×, req/s %.2f×\n",
			rep.medianOf(), v, rep.Ratios["healthy_latency_p99"], rep.Ratios["healthy_requests_per_s"])
	}
	for _, r := range rep.Runs {
		if r.Slow != nil {
			fmt.Fprintf(w, "   %s: %d of %d stalled-rank requests failed (expected: the rank never answers)\n", rep.runName(r), r.SlowFailed, r.Slow.Count)
		}
	}
	if rep.OfRaw > 0 {
		fmt.Fprintf(w, "   kvflow / raw TCP (1 conn)%s: %.2f×\n", rep.medianOf(), rep.OfRaw)
	}
	for _, r := range rep.Runs {
		if len(r.Stages) == 0 {
			continue
		}
		parts := make([]string, 0, len(r.Stages))
		for _, s := range r.Stages {
			parts = append(parts, fmt.Sprintf("%s %s/%s", s.Stage, ms(time.Duration(s.P50*1e9)), ms(time.Duration(s.P99*1e9))))
		}
		fmt.Fprintf(w, "   %s stage p50/p99: %s\n", rep.runName(r), strings.Join(parts, ", "))
	}
	for _, r := range rep.Runs {
		if r.FirstErr != "" {
			fmt.Fprintf(w, "   %s first error: %s\n", rep.runName(r), r.FirstErr)
		}
	}
}

// gbList is "3.10, 3.42, 2.98".
func gbList(v []float64) string {
	parts := make([]string, len(v))
	for i, x := range v {
		parts[i] = fmt.Sprintf("%.2f", x)
	}
	return strings.Join(parts, ", ")
}

// runName is r's mode, with its round when there are several.
func (rep *Report) runName(r RunReport) string {
	if rep.Rounds > 1 {
		return fmt.Sprintf("%s r%d", r.Mode, r.Round+1)
	}
	return r.Mode
}

// medianOf says which rounds a ratio summarises.
func (rep *Report) medianOf() string {
	if rep.Rounds > 1 {
		return fmt.Sprintf(" (median of %d rounds)", rep.Rounds)
	}
	return ""
}
