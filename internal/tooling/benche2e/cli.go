package benche2e

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/kvflow/kvflow/internal/cli/clierr"
	"github.com/kvflow/kvflow/internal/cli/flaghelp"
	"github.com/kvflow/kvflow/internal/config"
)

// Result is what --json prints.
type Result struct {
	GoVersion string    `json:"go_version"`
	CPUs      int       `json:"cpus"`
	Started   time.Time `json:"started"`
	// Netem is the --netem spec ("" none) and NetemMode how the delay was
	// made.
	Netem     string    `json:"netem,omitempty"`
	NetemMode string    `json:"netem_mode,omitempty"`
	Reports   []*Report `json:"reports"`
}

// ErrFailed: some request failed or some verified byte differed.
var ErrFailed = errors.New("bench e2e: requests failed or bytes differ")

// Run is `kvflow bench e2e`: it runs the selected workloads in this
// process (prefill and decode workers on loopback, each with its own TCP
// transfer engine and ZMQ side channel), each twice (kvflow's pipeline,
// then the serial baseline on the same workers), and prints the figures.
// Usage problems are *clierr.UsageError and are reported before anything
// is allocated.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("bench e2e", flag.ContinueOnError)
	// Errors are returned (the caller prints them once); -h prints the
	// flags on stdout.
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	workload := fs.String("workload", All, "workload: "+strings.Join(Names(), ", ")+", "+SlowPeer+" (healthy-rank latency with a stalled prefill rank's requests among them vs alone; always modes alone,kvflow) or all (all: long, batch and burst at TP 1→1 and 4→2, mixed and small at 1→1)")
	requests := fs.Int("requests", 0, "requests (mixed: long requests); 0 = the preset's")
	blocks := fs.Int("blocks", 0, "blocks per request (small: at most; mixed: of the long requests); 0 = the preset's")
	ptp := fs.Int("prefill-tp", 0, "prefill TP size; 0 = the preset's (with --workload all: both 1 and 4)")
	dtp := fs.Int("decode-tp", 0, "decode TP size; 0 = the preset's (with --workload all: both 1 and 2)")
	layers := fs.Int("layers", 0, "layers to allocate and move; 0 = as many of the model's 32 as fit --max-mem-gib")
	maxMem := fs.Float64("max-mem-gib", 3, "cap on the KV caches of both sides together, GiB (checked before allocating)")
	short := fs.Int("short", 0, "mixed: number of 1-block requests; 0 = the preset's (64)")
	interval := fs.Duration("interval", 0, "mixed: arrival interval of the 1-block requests; 0 = the preset's (4ms)")
	nverify := fs.Int("verify", 32, "requests per run verified byte by byte (evenly spread); -1 = all")
	mode := fs.String("mode", "both", "both (= kvflow,serial), or the runs in order, e.g. serial,kvflow,serial,kvflow")
	rounds := fs.Int("rounds", 3, "rounds of the modes per workload, each after a raw TCP stream; ratios are the median of the rounds'")
	rawMiB := fs.Int("raw-mib", 1024, "MiB streamed for the raw TCP ceiling (0 skips it)")
	timeout := fs.Duration("timeout", 5*time.Minute, "bound on one run")
	asJSON := fs.Bool("json", false, "print JSON instead of tables")
	verbose := fs.Bool("v", false, "log the workers at info level (in-process: to stderr; processes: to their logs in the work dir)")
	inProcess := fs.Bool("in-process", false, "run the workers in this process (node.Start per rank) instead of as kvflow serve processes")
	exe := fs.String("exe", "", "`path` of the kvflow binary the workers run as \"kvflow serve\" (default: this executable; not with --in-process)")
	netemSpec := fs.String("netem", "", `shape the link between prefill and decode, e.g. "delay 1ms": each side in its own network namespace (root, iproute2; kernel netem, else a netfilter-queue delay (iptables), else a userspace delay relay); process mode only`)
	netemMode := fs.String("netem-mode", "auto", "how --netem delays: auto, kernel (tc netem), queue (iptables NFQUEUE, verdicts from this process) or relay (userspace delay relay)")
	plotPath := fs.String("plot", "", "also draw per-stage latency and throughput to this SVG file")
	teBackend := fs.String("te-backend", config.BackendTCP, "the workers' node.te_backend: tcp, or mooncake (Mooncake's engine over its tcp transport; a kvflow built with -tags mooncake)")
	if err := clierr.ParseFlags(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(stdout, "usage: kvflow bench e2e [flags]\n\n"+
				"Runs kvflow's pipeline and a serial baseline on the same prefill and decode workers (loopback) and prints the figures.\n\n"+
				"what to run:\n")
			flaghelp.Print(stdout, fs, "workload", "requests", "blocks", "short", "interval", "prefill-tp", "decode-tp", "layers", "max-mem-gib", "mode", "rounds", "raw-mib", "verify", "timeout")
			fmt.Fprint(stdout, "\nworkers:\n")
			flaghelp.Print(stdout, fs, "in-process", "exe", "te-backend", "netem", "netem-mode", "v")
			fmt.Fprint(stdout, "\noutput:\n")
			flaghelp.Print(stdout, fs, "json", "plot")
		}
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	var errs []error
	for _, f := range []struct {
		name string
		v    int
	}{{"requests", *requests}, {"blocks", *blocks}, {"prefill-tp", *ptp}, {"decode-tp", *dtp}, {"short", *short}} {
		if set[f.name] && f.v < 1 {
			errs = append(errs, fmt.Errorf("--%s %d: want >= 1", f.name, f.v))
		}
	}
	if set["interval"] && *interval <= 0 {
		errs = append(errs, fmt.Errorf("--interval %v: want > 0", *interval))
	}
	if *layers < 0 {
		errs = append(errs, fmt.Errorf("--layers %d: want >= 0", *layers))
	}
	if !(*maxMem > 0) {
		errs = append(errs, fmt.Errorf("--max-mem-gib %v: want > 0", *maxMem))
	}
	if *inProcess && *netemSpec != "" {
		errs = append(errs, errors.New("--netem: needs the workers as processes (drop --in-process)"))
	}
	netMode, merr := netemModeOf(*netemMode)
	if merr != nil {
		errs = append(errs, fmt.Errorf("--netem-mode: %w", merr))
	}
	if *netemSpec != "" {
		if err := checkNetem(*netemSpec); err != nil {
			errs = append(errs, fmt.Errorf("--netem: %w", err))
		}
	}
	if *inProcess && *exe != "" {
		errs = append(errs, errors.New("--exe: needs the workers as processes (drop --in-process)"))
	}
	if *exe != "" {
		if st, err := os.Stat(*exe); err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
			errs = append(errs, fmt.Errorf("--exe %q: not an executable file", *exe))
		}
	}
	if *plotPath != "" && !strings.HasSuffix(strings.ToLower(*plotPath), ".svg") {
		errs = append(errs, fmt.Errorf("--plot %q: want a .svg file", *plotPath))
	}
	if *rounds < 1 {
		errs = append(errs, fmt.Errorf("--rounds %d: want >= 1", *rounds))
	}
	switch *teBackend {
	case config.BackendTCP, config.BackendMooncake:
	default:
		errs = append(errs, fmt.Errorf("--te-backend %q: want %s or %s", *teBackend, config.BackendTCP, config.BackendMooncake))
	}
	if *rawMiB < 0 {
		errs = append(errs, fmt.Errorf("--raw-mib %d: want >= 0", *rawMiB))
	}
	var modes []string
	if *mode == "both" {
		modes = []string{ModePipeline, ModeSerial}
	} else {
		for _, m := range strings.Split(*mode, ",") {
			if m != ModePipeline && m != ModeSerial {
				errs = append(errs, fmt.Errorf("--mode %q: want both, or a comma-separated list of kvflow and serial", *mode))
				break
			}
			modes = append(modes, m)
		}
	}
	var names []string
	if *workload == All {
		names = Names()
	} else if _, err := Preset(*workload); err != nil {
		errs = append(errs, fmt.Errorf("--workload: %w", err))
	} else {
		names = []string{*workload}
	}
	if len(errs) > 0 {
		return clierr.Usage(errors.Join(errs...))
	}

	// Build and size every workload first: a bad shape fails before any
	// worker starts.
	var ws []Workload
	for _, n := range names {
		base, _ := Preset(n)
		tps := [][2]int{{base.PrefillTP, base.DecodeTP}}
		if *workload == All && (n == Long || n == Batch || n == Burst) {
			tps = append(tps, [2]int{4, 2})
		}
		if set["prefill-tp"] || set["decode-tp"] {
			tps = [][2]int{{base.PrefillTP, base.DecodeTP}}
			if set["prefill-tp"] {
				tps[0][0] = *ptp
			}
			if set["decode-tp"] {
				tps[0][1] = *dtp
			}
		}
		for _, tp := range tps {
			w := base
			w.PrefillTP, w.DecodeTP = tp[0], tp[1]
			if set["requests"] {
				w.Requests = *requests
			}
			if set["blocks"] {
				w.Blocks = *blocks
			}
			if n == Mixed && set["short"] {
				w.Short = *short
			}
			if n == Mixed && set["interval"] {
				w.Interval = *interval
			}
			w.Layers = *layers
			if *teBackend != config.BackendTCP {
				w.TEBackend = *teBackend
			}
			if _, err := w.Size(int64(*maxMem * (1 << 30))); err != nil {
				errs = append(errs, err)
				continue
			}
			if err := w.checkConfigs(); err != nil {
				errs = append(errs, fmt.Errorf("%s TP %d → %d: %w", n, w.PrefillTP, w.DecodeTP, err))
				continue
			}
			ws = append(ws, w)
		}
	}
	if len(errs) > 0 {
		return clierr.Usage(errors.Join(errs...))
	}

	log := slog.New(slog.DiscardHandler)
	if *verbose {
		log = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	var proc *Process
	if !*inProcess {
		proc = &Process{Exe: *exe, LogLevel: "warn"}
		if *verbose {
			proc.LogLevel = "info"
		}
		if proc.Exe == "" {
			p, err := os.Executable()
			if err != nil {
				return fmt.Errorf("bench e2e: the kvflow binary: %w (give --exe)", err)
			}
			proc.Exe = p
		}
	}
	res := Result{GoVersion: runtime.Version(), CPUs: runtime.NumCPU(), Started: time.Now(), Netem: *netemSpec}
	if *netemSpec != "" {
		n, err := setupNet(ctx, *netemSpec, netMode)
		if err != nil {
			return err
		}
		defer n.Close()
		proc.Net = n
		res.NetemMode = n.Describe()
	}
	if !*asJSON {
		how := "in-process workers on loopback"
		if proc != nil {
			how = "kvflow serve processes on loopback"
		}
		if proc != nil && proc.Net != nil {
			how = fmt.Sprintf("kvflow serve processes in network namespaces, netem %q: %s", *netemSpec, res.NetemMode)
		}
		fmt.Fprintf(stdout, "kvflow bench e2e: %s, %d CPUs, %s\n", res.GoVersion, res.CPUs, how)
	}
	failed := false
	for _, w := range ws {
		if err := ctx.Err(); err != nil {
			return err
		}
		rep, err := Bench(ctx, Options{Workload: w, MaxMem: int64(*maxMem * (1 << 30)), Verify: *nverify, Modes: modes, Rounds: *rounds,
			RawBytes: int64(*rawMiB) << 20, Timeout: *timeout, Logger: log, Process: proc})
		if err != nil {
			return err
		}
		for _, r := range rep.Runs {
			failed = failed || r.Failed > 0 || r.BadBytes > 0 || r.FirstErr != ""
		}
		res.Reports = append(res.Reports, rep)
		if !*asJSON {
			rep.WriteText(stdout)
		}
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(res); err != nil {
			return err
		}
	}
	if *plotPath != "" {
		if err := WritePlot(*plotPath, &res); err != nil {
			return err
		}
		if !*asJSON {
			fmt.Fprintf(stdout, "plot: %s\n", *plotPath)
		}
	}
	if failed {
		return ErrFailed
	}
	return nil
}
