package main

import (
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvflow/kvflow/internal/demo"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("demo")
	presets := demo.Presets()
	var names []string
	for n := range presets {
		names = append(names, n)
	}
	sort.Strings(names)
	preset := fs.String("preset", "llama", "model shape: "+strings.Join(names, ", "))
	requests := fs.Int("requests", 64, "requests to pull")
	minBlocks := fs.Int("min-blocks", 1, "fewest blocks per request")
	maxBlocks := fs.Int("max-blocks", 8, "most blocks per request")
	prefillTP := fs.Int("prefill-tp", 4, "prefill instance TP size (workers)")
	decodeTP := fs.Int("decode-tp", 2, "decode instance TP size (workers)")
	layers := fs.Int("layers", 0, "override the preset's layers")
	heads := fs.Int("kv-heads", 0, "override the preset's KV heads")
	headDim := fs.Int("head-dim", 0, "override the preset's head dim")
	blockSize := fs.Int("block-size", 0, "override the preset's block size (tokens)")
	numBlocks := fs.Int("num-blocks", 0, "override the blocks per cache (per worker)")
	dtype := fs.String("dtype", "", "override the preset's dtype")
	seed := fs.Uint64("seed", 1, "seed of the request sizes and ids")
	timeout := fs.Duration("timeout", 2*time.Minute, "fail if the demo takes longer")
	workdir := fs.String("workdir", "", "keep configs, logs and sockets here (default: a temp dir, removed)")
	logLevel := fs.String("worker-log-level", "info", "log level of the worker processes (logs in the work dir)")
	teBackend := fs.String("te-backend", "", "every worker's node.te_backend: tcp (default) or shm (same-host reads from the mapped prefill cache files; the demo then also checks no batch went over the network)")
	if err := parseFlags(fs, args, stdout); err != nil {
		return err
	}
	m, ok := presets[*preset]
	if !ok {
		return usagef("--preset %q: want one of %s", *preset, strings.Join(names, ", "))
	}
	for _, o := range []struct {
		v   int
		dst *int
	}{{*layers, &m.NumLayers}, {*heads, &m.NumKVHeads}, {*headDim, &m.HeadDim}, {*blockSize, &m.BlockSize}, {*numBlocks, &m.NumBlocks}} {
		if o.v != 0 {
			*o.dst = o.v
		}
	}
	if *dtype != "" {
		m.DType = *dtype
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	var progress io.Writer
	if isTerminal(stderr) {
		progress = stderr
	}
	fmt.Fprintf(stdout, "kvflow demo: prefill TP %d → decode TP %d on loopback, %s (%d layers, %d KV heads, block %d, %s), %d requests of %d–%d blocks\n",
		*prefillTP, *decodeTP, *preset, m.NumLayers, m.NumKVHeads, m.BlockSize, m.DType, *requests, *minBlocks, *maxBlocks)
	s, err := demo.Run(ctx, demo.Options{
		Exe: exe, Requests: *requests, MinBlocks: *minBlocks, MaxBlocks: *maxBlocks,
		PrefillTP: *prefillTP, DecodeTP: *decodeTP, Model: m, Seed: *seed, Timeout: *timeout,
		Workdir: *workdir, Progress: progress, Out: stdout, LogLevel: *logLevel, TEBackend: *teBackend,
	})
	if s != nil {
		printSummary(stdout, s)
	}
	if err != nil {
		if strings.Contains(err.Error(), "want requests") || strings.Contains(err.Error(), "exceeds num_blocks") || strings.Contains(err.Error(), "worker config") {
			return usageError{err}
		}
		return err
	}
	return nil
}

func printSummary(w io.Writer, s *demo.Summary) {
	tw := tabwriter.NewWriter(w, 2, 0, 2, ' ', 0)
	rate := func(bytes float64, d time.Duration) string {
		if d <= 0 {
			return "-"
		}
		return fmt.Sprintf("%.2f GB/s", bytes/d.Seconds()/1e9)
	}
	q := func(p float64) time.Duration { return demo.Quantile(s.Latencies, p).Round(10 * time.Microsecond) }
	fmt.Fprintf(tw, "\nrequests\t%d (done %d, failed %d)\n", s.Requests, s.Done, s.Failed)
	fmt.Fprintf(tw, "bytes verified\t%.2f GiB (%d mismatching)\n", float64(s.Bytes)/(1<<30), s.BadBytes)
	fmt.Fprintf(tw, "wall time\t%v, of which this driver filled prefill blocks %v and checked every landed byte %v (one goroutine)\n",
		s.Wall.Round(time.Millisecond), s.Fill.Round(time.Millisecond), s.Check.Round(time.Millisecond))
	fmt.Fprintf(tw, "end to end\t%s into decode caches over the wall time (driver's filling and checking included; see kvflow bench e2e)\n",
		rate(float64(s.Bytes), s.Wall))
	fmt.Fprintf(tw, "transfer\t%s per request while reading (decode workers: kvflow_read_bytes_total over the read stage's time summed over requests; concurrent requests add up)\n",
		rate(s.ReadBytes, time.Duration(s.ReadSeconds*float64(time.Second))))
	fmt.Fprintf(tw, "request latency\tp50 %v  p99 %v (driver's view: load handed over to done seen by its finished poll; includes queueing behind requests in flight and its filling and checking between polls)\n",
		q(0.5), q(0.99))
	fmt.Fprintf(tw, "worker latency\tp50 %s  p99 %s (decode workers' kvflow_decode_request_duration_seconds: load to end, no driver time)\n",
		secs(s.WorkerP50), secs(s.WorkerP99))
	if s.ShmBatches+s.NetBatches > 0 {
		fmt.Fprintf(tw, "te_backend shm\t%.0f read batches copied from mapped same-host cache files, %.0f over the network, %.0f claims that did not hold\n",
			s.ShmBatches, s.NetBatches, s.ShmFallbacks)
	}
	tw.Flush()
	if len(s.Stages) > 0 {
		fmt.Fprintln(w, "\nper-stage latency (decode workers' kvflow_stage_duration_seconds):")
		tw = tabwriter.NewWriter(w, 2, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "  stage\titems\tp50\tp99")
		for _, st := range s.Stages {
			fmt.Fprintf(tw, "  %s\t%.0f\t%s\t%s\n", st.Stage, st.Count, secs(st.P50), secs(st.P99))
		}
		tw.Flush()
	}
	for _, f := range s.Failures {
		fmt.Fprintln(w, "failure:", f)
	}
	if s.OK() {
		fmt.Fprintln(w, "\nOK: every request done, every byte matched")
	} else {
		fmt.Fprintln(w, "\nFAILED")
	}
}

func secs(v float64) string {
	if math.IsNaN(v) {
		return "-"
	}
	return time.Duration(v * float64(time.Second)).Round(time.Microsecond).String()
}
