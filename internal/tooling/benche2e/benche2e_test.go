package benche2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/cli/clierr"
	"github.com/kvflow/kvflow/internal/config"
)

func TestBadInputIsUsageErrorBeforeStarting(t *testing.T) {
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"unknown workload", []string{"--workload", "huge"}, `unknown workload "huge"`},
		{"zero requests", []string{"--workload", "batch", "--requests", "0"}, "--requests 0"},
		{"zero blocks", []string{"--workload", "long", "--blocks", "0"}, "--blocks 0"},
		{"bad mode", []string{"--mode", "fast"}, "--mode"},
		{"too big", []string{"--workload", "long", "--layers", "32"}, "do not fit"},
		{"too big auto", []string{"--workload", "batch", "--requests", "100000"}, "do not fit"},
		{"bad tp pair", []string{"--workload", "batch", "--prefill-tp", "3", "--decode-tp", "1"}, "batch TP 3 → 1"},
		{"positional", []string{"extra"}, "unexpected arguments"},
		{"zero concurrency small", []string{"--workload", "small", "--requests", "0"}, "--requests 0"},
		{"zero short", []string{"--workload", "mixed", "--short", "0"}, "--short 0"},
		{"zero rounds", []string{"--rounds", "0"}, "--rounds 0"},
		{"zero interval", []string{"--workload", "mixed", "--interval", "0s"}, "--interval"},
		{"too big mixed", []string{"--workload", "mixed", "--max-mem-gib", "0.01", "--layers", "4"}, "do not fit"},
		{"netem in-process", []string{"--in-process", "--netem", "delay 1ms"}, "--netem"},
		{"exe in-process", []string{"--in-process", "--exe", "/bin/true"}, "--exe"},
		{"bad exe", []string{"--exe", "/nonexistent/kvflow"}, "not an executable"},
		{"bad plot", []string{"--plot", "out.png"}, "--plot"},
		{"bad mem", []string{"--max-mem-gib", "0"}, "--max-mem-gib"},
		{"bad netem", []string{"--netem", "delay 1ms; reboot"}, "--netem"},
		{"bad netem mode", []string{"--netem", "delay 1ms", "--netem-mode", "fast"}, "--netem-mode"},
		{"bad te backend", []string{"--te-backend", "rdma"}, "--te-backend"},
	}
	if !config.MooncakeBuilt {
		cases = append(cases, struct {
			name string
			args []string
			want string
		}{"mooncake not built", []string{"--te-backend", "mooncake", "--workload", "long"}, "built without it"})
	}
	// A stand-in for the kvflow binary that leaves a mark if anything
	// launches it.
	dir := t.TempDir()
	mark := filepath.Join(dir, "launched")
	fake := filepath.Join(dir, "kvflow")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\ntouch "+mark+"\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			args := tc.args
			if !slices.Contains(args, "--exe") && !slices.Contains(args, "--in-process") {
				args = append([]string{"--exe", fake}, args...)
			}
			err := Run(context.Background(), args, &out, &errb)
			if !clierr.IsUsage(err) {
				t.Fatalf("err = %v, want a usage error", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want it to mention %q", err, tc.want)
			}
			if out.Len() != 0 {
				t.Errorf("printed %q before failing", out.String())
			}
			if _, err := os.Stat(mark); err == nil {
				t.Errorf("a worker was launched before the check")
			}
		})
	}
}

func TestSizeAutoLayers(t *testing.T) {
	w, err := Preset(Long)
	if err != nil {
		t.Fatal(err)
	}
	total, err := w.Size(3 << 30)
	if err != nil {
		t.Fatal(err)
	}
	// 8 × 128 decode + 128 prefill blocks of 512 KiB per layer.
	if w.Layers != 5 || total != 5*1152*512<<10 {
		t.Errorf("layers %d total %d", w.Layers, total)
	}
	if _, err := (&Workload{}).Size(1 << 30); err == nil {
		t.Error("empty workload sized")
	}
}

func TestSampleIdx(t *testing.T) {
	if got := sampleIdx(10, 3); len(got) != 3 || got[0] != 0 || got[2] != 6 {
		t.Errorf("sampleIdx(10, 3) = %v", got)
	}
	if got := sampleIdx(4, -1); len(got) != 4 {
		t.Errorf("sampleIdx(4, -1) = %v", got)
	}
}

// TestTinyRun drives a small stitched workload (TP 2 → 1) through both
// modes and checks every byte; and the same with decode TP above prefill
// TP (2 → 4: head slices, kvflow ↔ kvflow).
func TestTinyRun(t *testing.T) {
	for _, tp := range [][2]string{{"2", "1"}, {"2", "4"}} {
		t.Run(tp[0]+"-to-"+tp[1], func(t *testing.T) { tinyRun(t, tp[0], tp[1]) })
	}
}

func tinyRun(t *testing.T, ptp, dtp string) {
	var out, errb bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := Run(ctx, []string{"--in-process", "--workload", "small", "--requests", "6", "--blocks", "3", "--layers", "2",
		"--prefill-tp", ptp, "--decode-tp", dtp, "--verify", "-1", "--raw-mib", "1", "--rounds", "1", "--json"}, &out, &errb)
	if err != nil {
		t.Fatalf("%v\nstderr: %s", err, errb.String())
	}
	var res Result
	if err := json.Unmarshal(out.Bytes(), &res); err != nil {
		t.Fatal(err)
	}
	if len(res.Reports) != 1 || len(res.Reports[0].Runs) != 2 {
		t.Fatalf("reports: %+v", res.Reports)
	}
	for _, r := range res.Reports[0].Runs {
		if r.Failed != 0 || r.BadBytes != 0 || r.Verified != 6 || r.Bytes == 0 {
			t.Errorf("%s: %+v", r.Mode, r)
		}
	}
	if _, ok := res.Reports[0].Ratios["requests_per_s"]; !ok {
		t.Error("no ratio")
	}
	if errors.Is(err, ErrFailed) {
		t.Error("failed")
	}
}

func TestListenPorts(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ports, err := listenPorts(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(ports, ln.Addr().(*net.TCPAddr).Port) {
		t.Errorf("ports %v lack %v", ports, ln.Addr())
	}
}

func TestMedian(t *testing.T) {
	for _, c := range []struct {
		in   []float64
		want float64
	}{
		{[]float64{3}, 3},
		{[]float64{4.8, 3.0, 3.5}, 3.5},
		{[]float64{1, 4, 2, 3}, 2.5},
	} {
		in := append([]float64(nil), c.in...)
		if got := median(c.in); got != c.want {
			t.Errorf("median(%v) = %v, want %v", c.in, got, c.want)
		}
		for i := range in {
			if in[i] != c.in[i] {
				t.Errorf("median reordered its input: %v", c.in)
			}
		}
	}
}

// Ratios are formed within each round (kvflow against the same round's
// serial run and raw ceiling) and the report keeps their median, so one
// slow phase of the machine moves one round, not the figure.
func TestRoundRatios(t *testing.T) {
	run := func(mode string, round int, gbps float64, short time.Duration) RunReport {
		l := Latency{P50: short, P99: 2 * short}
		return RunReport{Mode: mode, Round: round, GBps: gbps, ReqPerSec: gbps * 10, Wall: time.Duration(float64(time.Second) / gbps),
			All: l, Short: &l, Long: &l}
	}
	rep := &Report{Rounds: 3, RawSamples: []float64{4, 2, 4, 4},
		Runs: []RunReport{
			run(ModePipeline, 0, 3, 10*time.Millisecond), run(ModeSerial, 0, 1, 100*time.Millisecond),
			// a slow phase: everything at half speed, the ceiling too
			run(ModePipeline, 1, 1.5, 20*time.Millisecond), run(ModeSerial, 1, 1, 100*time.Millisecond),
			run(ModePipeline, 2, 4, 10*time.Millisecond), run(ModeSerial, 2, 2, 50*time.Millisecond),
		}}
	rep.ratios()
	// ceilings 3, 3, 4: of raw 1, 0.5, 1 -> median 1
	if rep.OfRaw != 1 || !slices.Equal(rep.OfRawRounds, []float64{1, 0.5, 1}) {
		t.Errorf("of raw = %v (rounds %v), want 1 (1, 0.5, 1)", rep.OfRaw, rep.OfRawRounds)
	}
	if got := rep.RoundRatios["gb_per_s"]; !slices.Equal(got, []float64{3, 1.5, 2}) {
		t.Errorf("rounds' GB/s ratios = %v, want [3 1.5 2]", got)
	}
	// kvflow/serial GB/s 3, 1.5, 2 -> 2; 1-block p99 0.1, 0.2, 0.2 -> 0.2
	for k, want := range map[string]float64{"gb_per_s": 2, "requests_per_s": 2, "short_latency_p99": 0.2, "latency_p50": 0.2, "long_latency_p50": 0.2} {
		if got := rep.Ratios[k]; math.Abs(got-want) > 1e-9 {
			t.Errorf("%s = %v, want %v", k, got, want)
		}
	}
	// Typical: the median run by wall time.
	if r := rep.Typical(ModePipeline); r == nil || r.GBps != 3 {
		t.Errorf("typical kvflow run: %+v", r)
	}
	if r := rep.Typical(ModeSerial); r == nil || r.Round == 2 {
		t.Errorf("typical serial run: %+v", r)
	}
	if r := rep.Typical("other"); r != nil {
		t.Errorf("typical of a mode without runs: %+v", r)
	}
}

// Edge cases of the rounds: a ratio a round cannot form (a zero
// denominator) is left out of the median rather than sorted in as NaN; no
// raw streams means no kvflow/raw figure; a failed stream (0) leaves its
// rounds the other stream as ceiling; the report still encodes as JSON.
func TestRoundRatiosEdges(t *testing.T) {
	run := func(mode string, round int, gbps float64, p99 time.Duration) RunReport {
		return RunReport{Mode: mode, Round: round, GBps: gbps, ReqPerSec: gbps, Wall: time.Second, All: Latency{P50: p99, P99: p99}}
	}
	rep := &Report{Rounds: 3, RawSamples: []float64{2, 0, 4, 4},
		Runs: []RunReport{
			run(ModePipeline, 0, 2, time.Millisecond), run(ModeSerial, 0, 1, 0), // serial latency 0: no latency ratio
			run(ModePipeline, 1, 4, time.Millisecond), run(ModeSerial, 1, 1, 10*time.Millisecond),
			run(ModePipeline, 2, 4, time.Millisecond), run(ModeSerial, 2, 2, 10*time.Millisecond),
		}}
	rep.ratios()
	if got := rep.RoundRatios["latency_p99"]; !slices.Equal(got, []float64{0.1, 0.1}) {
		t.Errorf("latency rounds %v, want [0.1 0.1] (round 1 left out)", got)
	}
	// ceilings: round 0 only stream 0 (2), round 1 only stream 2 (4), round 2 (4+4)/2
	if !slices.Equal(rep.OfRawRounds, []float64{1, 1, 1}) || rep.OfRaw != 1 {
		t.Errorf("of raw %v (rounds %v), want 1", rep.OfRaw, rep.OfRawRounds)
	}
	if _, err := json.Marshal(rep); err != nil {
		t.Errorf("report does not encode: %v", err)
	}
	none := &Report{Rounds: 2, Runs: []RunReport{run(ModePipeline, 0, 2, 1), run(ModeSerial, 0, 1, 1), run(ModePipeline, 1, 2, 1), run(ModeSerial, 1, 1, 1)}}
	none.ratios()
	if none.OfRaw != 0 || len(none.OfRawRounds) != 0 || none.Ratios["gb_per_s"] != 2 {
		t.Errorf("without raw streams: of raw %v %v, ratios %v", none.OfRaw, none.OfRawRounds, none.Ratios)
	}
}

// TestSlowPeerRun: the slowpeer workload runs alone then kvflow; every
// healthy request ends done and verified, every stalled-rank request
// fails, and the healthy-latency ratios are reported.
func TestSlowPeerRun(t *testing.T) {
	var out, errb bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	err := Run(ctx, []string{"--in-process", "--workload", "slowpeer", "--requests", "16", "--layers", "2",
		"--verify", "-1", "--raw-mib", "0", "--rounds", "1", "--json"}, &out, &errb)
	if err != nil {
		t.Fatalf("%v\nstderr: %s", err, errb.String())
	}
	var res Result
	if err := json.Unmarshal(out.Bytes(), &res); err != nil {
		t.Fatal(err)
	}
	rep := res.Reports[0]
	if len(rep.Runs) != 2 || rep.Runs[0].Mode != ModeAlone || rep.Runs[1].Mode != ModePipeline {
		t.Fatalf("runs: %+v", rep.Runs)
	}
	for _, r := range rep.Runs {
		if r.Requests != 16 || r.Failed != 0 || r.BadBytes != 0 || r.Verified != 16 {
			t.Errorf("%s: %+v", r.Mode, r)
		}
	}
	if s := rep.Runs[1].Slow; s == nil || s.Count != 32 || rep.Runs[1].SlowFailed != 32 {
		t.Errorf("stalled rank: %+v, %d failed", s, rep.Runs[1].SlowFailed)
	}
	for _, k := range []string{"healthy_latency_p50", "healthy_latency_p99"} {
		if _, ok := rep.Ratios[k]; !ok {
			t.Errorf("no %s in %v", k, rep.Ratios)
		}
	}
	t.Logf("healthy latency with the stalled rank / alone: p50 %.2fx, p99 %.2fx", rep.Ratios["healthy_latency_p50"], rep.Ratios["healthy_latency_p99"])
}
