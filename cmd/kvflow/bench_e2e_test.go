package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/tooling/benche2e"
	"github.com/kvflow/kvflow/internal/tooling/netem"
)

// serveChildren lists the pids of this process's children running
// `kvflow serve` (this test binary re-executed, see TestMain).
func serveChildren(t *testing.T) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces, so cut at ')'.
		rest := string(stat[bytes.LastIndexByte(stat, ')')+1:])
		f := strings.Fields(rest)
		if len(f) < 2 || f[1] != strconv.Itoa(os.Getpid()) {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if bytes.Contains(cmdline, []byte("\x00serve\x00")) {
			out = append(out, pid)
		}
	}
	return out
}

func alive(pid int) bool {
	_, err := os.Stat(filepath.Join("/proc", strconv.Itoa(pid)))
	return err == nil
}

// bench e2e in its default mode: the workers are `kvflow serve` processes
// driven through their control sockets, both modes on the same workers,
// every byte checked; none is left running.
func TestBenchE2EProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	code, out, errOut := runCmd("bench", "e2e", "--workload", "small", "--requests", "8", "--blocks", "3", "--layers", "2",
		"--prefill-tp", "2", "--decode-tp", "1", "--verify", "-1", "--raw-mib", "1", "--rounds", "2", "--json")
	if code != exitOK {
		t.Fatalf("exit %d\n%s\n%s", code, out, errOut)
	}
	var res benche2e.Result
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if len(res.Reports) != 1 || len(res.Reports[0].Runs) != 4 {
		t.Fatalf("reports: %+v", res.Reports)
	}
	rep := res.Reports[0]
	// Two rounds of both modes, a raw stream around each round.
	if rep.Rounds != 2 || len(rep.RawSamples) != 3 || rep.OfRaw <= 0 || len(rep.Ratios) == 0 {
		t.Errorf("rounds %d, raw samples %v, of raw %v, ratios %v", rep.Rounds, rep.RawSamples, rep.OfRaw, rep.Ratios)
	}
	for i, r := range rep.Runs {
		if want := []string{"kvflow", "serial"}[i%2]; r.Mode != want || r.Round != i/2 {
			t.Errorf("run %d: %s round %d, want %s round %d", i, r.Mode, r.Round, want, i/2)
		}
	}
	if !strings.Contains(rep.Workers, "processes") {
		t.Errorf("workers: %q", rep.Workers)
	}
	for _, r := range rep.Runs {
		if r.Failed != 0 || r.BadBytes != 0 || r.Verified != 8 || r.Bytes == 0 || len(r.Stages) == 0 {
			t.Errorf("%s: %+v", r.Mode, r)
		}
	}
	if pids := serveChildren(t); len(pids) != 0 {
		t.Errorf("workers left running: %v", pids)
	}
}

// Ctrl-C (ctx cancelled) while a run is under way stops every worker.
func TestBenchE2ECancelStopsWorkers(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	var out, errb bytes.Buffer
	go func() {
		// Long enough that the cancel lands while it runs.
		done <- benche2e.Run(ctx, []string{"--workload", "batch", "--requests", "2000", "--blocks", "1", "--layers", "1",
			"--prefill-tp", "2", "--decode-tp", "2", "--mode", "serial,serial,serial", "--raw-mib", "0", "--timeout", "2m"}, &out, &errb)
	}()
	var seen []int
	for len(seen) < 4 {
		select {
		case err := <-done:
			t.Fatalf("returned before the workers were seen: %v\n%s\n%s", err, out.String(), errb.String())
		case <-time.After(20 * time.Millisecond):
		}
		seen = serveChildren(t)
	}
	time.Sleep(300 * time.Millisecond) // into the run
	cancel()
	if err := <-done; err == nil {
		t.Fatalf("cancelled run returned nil\n%s", out.String())
	}
	for _, pid := range seen {
		if alive(pid) {
			t.Errorf("worker %d still running after the cancelled run returned", pid)
		}
	}
	if pids := serveChildren(t); len(pids) != 0 {
		t.Errorf("workers left running: %v", pids)
	}
}

// --netem: prefill and decode workers in their network namespaces, every
// byte between them through the emulated link; skipped where namespaces
// are unavailable (not root, no ip(8)).
func TestBenchE2ENetem(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	if err := netem.Available(); err != nil {
		t.Skip(err)
	}
	for _, mode := range []string{"auto", "relay"} {
		t.Run(mode, func(t *testing.T) {
			code, out, errOut := runCmd("bench", "e2e", "--netem", "delay 1ms", "--netem-mode", mode, "--workload", "small", "--requests", "8", "--blocks", "2",
				"--layers", "2", "--verify", "-1", "--raw-mib", "1", "--rounds", "1", "--json")
			if code != exitOK {
				t.Fatalf("exit %d\n%s\n%s", code, out, errOut)
			}
			var res benche2e.Result
			if err := json.Unmarshal([]byte(out), &res); err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			if res.Netem != "delay 1ms" || res.NetemMode == "" || len(res.Reports) != 1 || !strings.Contains(res.Reports[0].Workers, "netns") {
				t.Fatalf("netem %q mode %q reports %+v", res.Netem, res.NetemMode, res.Reports)
			}
			t.Logf("--netem-mode %s: %s", mode, res.NetemMode)
			for _, r := range res.Reports[0].Runs {
				if r.Failed != 0 || r.BadBytes != 0 || r.Verified != 8 || len(r.Stages) == 0 {
					t.Errorf("%s: %+v", r.Mode, r)
				}
			}
			if pids := serveChildren(t); len(pids) != 0 {
				t.Errorf("workers left running: %v", pids)
			}
		})
	}
}
