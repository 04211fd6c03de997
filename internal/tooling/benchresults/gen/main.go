// Command gen is `make bench`: it runs the stage benchmarks and `kvflow
// bench e2e` (all workloads; small with --netem "delay 1ms" where network
// namespaces work), then writes bench/RESULTS.md (and bench/e2e.svg) from
// what they printed. Run it from the repository root:
//
//	go run ./internal/tooling/benchresults/gen [-out bench/RESULTS.md] [-benchtime 1s]
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/kvflow/kvflow/internal/tooling/benche2e"
	"github.com/kvflow/kvflow/internal/tooling/benchresults"
	"github.com/kvflow/kvflow/internal/tooling/netem"
)

// The packages with stage benchmarks. BenchmarkE2E (bench/) is skipped:
// `kvflow bench e2e` runs the same workloads with the workers as processes.
var stagePkgs = []string{"./bench/", "./pipeline/", "./hw/npu/", "./hw/mooncake/", "./stages/plan/"}

func main() {
	out := flag.String("out", "bench/RESULTS.md", "the file to write")
	plot := flag.String("plot", "bench/e2e.svg", "the SVG plot to write next to it (\"\" none)")
	benchtime := flag.String("benchtime", "1s", "-benchtime of the stage benchmarks")
	workload := flag.String("workload", benche2e.All, "--workload of the end-to-end run")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *out, *plot, *benchtime, *workload); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, out, plot, benchtime, workload string) error {
	start := time.Now()
	// Someone may add to the file while this runs: what they wrote is kept
	// next to it rather than lost (see the end).
	before, _ := os.ReadFile(out)
	goBin := os.Getenv("GO")
	if goBin == "" {
		goBin = "go"
	}
	tmp, err := os.MkdirTemp("", "kvflow-make-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	kvflow := filepath.Join(tmp, "kvflow")
	in := benchresults.Input{Machine: machine(ctx, goBin), Workload: workload}
	// Run records the command as the reader would type it.
	runCmd := func(shown string, stdout io.Writer, name string, args ...string) error {
		in.Commands = append(in.Commands, shown)
		fmt.Fprintf(os.Stderr, "+ %s\n", shown)
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Stdout, cmd.Stderr = stdout, os.Stderr
		cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
		cmd.WaitDelay = 30 * time.Second
		return cmd.Run()
	}
	if err := runCmd(goBin+" build -o bin/kvflow ./cmd/kvflow", os.Stderr, goBin, "build", "-o", kvflow, "./cmd/kvflow"); err != nil {
		return err
	}

	var stages bytes.Buffer
	args := append([]string{"test", "-run", "^$", "-bench", ".", "-skip", "E2E", "-benchmem", "-count", "1", "-benchtime", benchtime}, stagePkgs...)
	if err := runCmd(goBin+" "+shell(args), io.MultiWriter(&stages, os.Stderr), goBin, args...); err != nil {
		return fmt.Errorf("stage benchmarks: %w", err)
	}
	if in.Stages, err = benchresults.ParseBench(&stages); err != nil {
		return err
	}

	e2e := func(extra ...string) (*benche2e.Result, error) {
		args := append([]string{"bench", "e2e", "--workload", workload, "--json"}, extra...)
		var buf bytes.Buffer
		err := runCmd("bin/kvflow "+shell(args), &buf, kvflow, args...)
		var res benche2e.Result
		if jerr := json.Unmarshal(buf.Bytes(), &res); jerr != nil {
			if err == nil {
				err = jerr
			}
			return nil, fmt.Errorf("bench e2e %v: %w", extra, err)
		}
		// Failed requests exit 1 with the JSON printed: RESULTS.md says so.
		return &res, nil
	}
	if in.E2E, err = e2e(); err != nil {
		return err
	}
	if err := netem.Available(); err != nil {
		in.NetemSkip = err.Error()
		in.Commands = append(in.Commands, "# skipped: bin/kvflow bench e2e --workload small --json --netem 'delay 1ms' ("+err.Error()+")")
	} else {
		saved := workload
		workload = benche2e.Small
		in.Netem, err = e2e("--netem", "delay 1ms")
		workload = saved
		if err != nil {
			in.Netem, in.NetemSkip = nil, err.Error()
		}
	}
	if plot != "" {
		all := *in.E2E
		all.Reports = append([]*benche2e.Report(nil), in.E2E.Reports...)
		if err := benche2e.WritePlot(plot, &all); err != nil {
			return err
		}
		rel, err := filepath.Rel(filepath.Dir(out), plot)
		if err != nil {
			rel = plot
		}
		in.Plot = rel
	}
	in.Wall = time.Since(start)
	var md bytes.Buffer
	if err := benchresults.Render(&md, in); err != nil {
		return err
	}
	if now, err := os.ReadFile(out); err == nil && !bytes.Equal(now, before) {
		kept := out + ".during-bench"
		if err := os.WriteFile(kept, now, 0o644); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "bench: %s changed while the benchmarks ran; what it held is in %s (carry it to HISTORY.md)\n", out, kept)
	}
	if err := os.WriteFile(out, md.Bytes(), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "wrote %s in %v\n", out, in.Wall.Round(time.Second))
	return nil
}

// shell quotes args the way a reader can paste them.
func shell(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		if a == "" || strings.ContainsAny(a, " '\"$^*?[]()|&;<>\\") {
			a = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
		q[i] = a
	}
	return strings.Join(q, " ")
}

func machine(ctx context.Context, goBin string) benchresults.Machine {
	m := benchresults.Machine{CPUs: runtime.NumCPU(), Date: time.Now(), GoVersion: runtime.Version()}
	if b, err := exec.CommandContext(ctx, goBin, "version").Output(); err == nil {
		m.GoVersion = strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = "Linux " + strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				var kb float64
				fmt.Sscan(strings.TrimSuffix(strings.TrimSpace(v), " kB"), &kb)
				m.MemTotal = fmt.Sprintf("%.1f GiB", kb/(1<<20))
			}
		}
	}
	return m
}
