package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/tooling/workers"
)

// The test binary doubles as the kvflow binary: the demo re-executes
// os.Executable() as `kvflow serve`, and so do the process tests.
func TestMain(m *testing.M) {
	if os.Getenv("KVFLOW_AS_MAIN") == "1" {
		main()
		return
	}
	os.Setenv("KVFLOW_AS_MAIN", "1") // children of this process run main
	code := m.Run()
	os.Exit(code)
}

func runCmd(args ...string) (code int, stdout, stderr string) {
	var o, e bytes.Buffer
	code = run(context.Background(), args, &o, &e)
	return code, o.String(), e.String()
}

func TestUsage(t *testing.T) {
	cases := []struct {
		args []string
		code int
		want string
	}{
		{nil, exitUsage, "usage: kvflow"},
		{[]string{"help"}, exitOK, "commands:"},
		{[]string{"nope"}, exitUsage, `unknown command "nope"`},
		{[]string{"version"}, exitOK, "kvflow"},
		{[]string{"version", "-h"}, exitOK, "usage: kvflow version\n\n(no flags)"},
		{[]string{"serve"}, exitUsage, "kv_transfer_config.kv_role"},
		{[]string{"serve"}, exitUsage, "no --config given: start from deploy/examples/prefill.json"},
		{[]string{"serve", "--tp-rank", "x"}, exitUsage, "tp-rank"},
		{[]string{"serve", "--config", "/nonexistent.json"}, exitUsage, "nonexistent"},
		{[]string{"serve", "extra-arg", "--print-config"}, exitUsage, "unexpected arguments"},
		{[]string{"serve", "--config", "../../deploy/examples/prefill.json", "--read-grants", "off", "--print-config"}, exitUsage,
			`unexpected arguments ["off" "--print-config"]: --read-grants takes no separate value; write --read-grants=off`},
		{[]string{"plan", "--config", "../../deploy/examples/decode.json", "--read-grants", "off"}, exitUsage, "write --read-grants=off"},
		{[]string{"serve", "--config", "../../deploy/examples/decode.json", "--te-backend", "mooncake", "--print-config"},
			mooncakePrintExit(), mooncakePrintWant()},
		{[]string{"serve", "--config", "../../deploy/examples/prefill.json", "--num-blocks", "-3", "--print-config"}, exitUsage,
			"invalid configuration:\nmodel.num_blocks: must be >= 1, got -3"},
		{[]string{"serve", "--config", "../../deploy/examples/prefill.json", "--kv-transfer-config", `{"kv_role":"kv_producer"}`, "--role", "decode", "--print-config"},
			exitUsage, `kv_transfer_config.kv_role: conflicting values: --kv-transfer-config gives "kv_producer", --role gives "kv_consumer"`},
		{[]string{"probe"}, exitUsage, "--remote"},
		{[]string{"probe", "-h"}, exitOK, "the prefill frees that request's blocks"},
		{[]string{"bench"}, exitUsage, "subcommand"},
		{[]string{"bench", "xx"}, exitUsage, "unknown subcommand"},
		{[]string{"demo", "--requests", "0"}, exitUsage, "requests"},
		{[]string{"demo", "--preset", "gpt9"}, exitUsage, "preset"},
		{[]string{"plan", "--request-id", "r"}, exitUsage, "invalid configuration"},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			code, out, errOut := runCmd(tc.args...)
			if code != tc.code || !strings.Contains(out+errOut, tc.want) {
				t.Errorf("exit %d (want %d), output %q does not contain %q", code, tc.code, out+errOut, tc.want)
			}
		})
	}
}

func TestPrintConfig(t *testing.T) {
	code, out, errOut := runCmd("serve", "--config", "../../internal/config/testdata/example-decode.json", "--tp-rank", "0", "--print-config")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	cfg, err := config.FromJSON([]byte(out))
	if err != nil {
		t.Fatalf("printed config does not load: %v", err)
	}
	if cfg.Rank.TP != 0 || cfg.KVTransfer.EngineID != "decode-0" {
		t.Errorf("flag did not override the file: %+v", cfg.Rank)
	}
}

// A small demo, end to end, in processes: what `make demo` runs.
func TestDemoSmall(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	code, out, errOut := runCmd("demo", "--requests", "12", "--max-blocks", "4", "--layers", "4", "--num-blocks", "16",
		"--block-size", "16", "--timeout", "90s")
	if code != exitOK || !strings.Contains(out, "OK: every request done, every byte matched") {
		t.Fatalf("demo exit %d\n%s\n%s", code, out, errOut)
	}
	// Each figure says what it includes; the transfer rate and the
	// workers' own latency are printed apart from the driver's work.
	for _, re := range []string{
		`(?m)^wall time +\d.*, of which this driver filled prefill blocks \S+ and checked every landed byte \S+`,
		`(?m)^end to end +[0-9.]+ GB/s into decode caches over the wall time \(driver's filling and checking included`,
		`(?m)^transfer +[0-9.]+ GB/s per request while reading \(decode workers: kvflow_read_bytes_total`,
		`(?m)^request latency +p50 \S+ +p99 \S+ \(driver's view: .*includes queueing`,
		`(?m)^worker latency +p50 [0-9.]+(µs|ms|s) +p99 [0-9.]+(µs|ms|s) \(decode workers' kvflow_decode_request_duration_seconds`,
	} {
		if !regexp.MustCompile(re).MatchString(out) {
			t.Errorf("demo summary lacks %s:\n%s", re, out)
		}
	}
}

// The small demo with node.te_backend shm (issue 21): every byte matched,
// every read batch copied from the mapped prefill cache files.
func TestDemoSmallShm(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	code, out, errOut := runCmd("demo", "--te-backend", "shm", "--requests", "12", "--max-blocks", "4", "--layers", "4", "--num-blocks", "16",
		"--block-size", "16", "--timeout", "90s")
	if code != exitOK || !strings.Contains(out, "OK: every request done, every byte matched") {
		t.Fatalf("demo exit %d\n%s\n%s", code, out, errOut)
	}
	if !regexp.MustCompile(`(?m)^te_backend shm +[1-9]\d* read batches copied from mapped same-host cache files, 0 over the network, 0 claims`).MatchString(out) {
		t.Errorf("demo summary lacks the shm line:\n%s", out)
	}
}

// SIGTERM to a serving worker under load: intake stops, the drain deadline
// passes, the requests still in flight end as failed and are collected
// through the control socket, and the process exits 0.
func TestServeSIGTERM(t *testing.T) {
	dir := t.TempDir()
	// A prefill side channel that accepts and never answers: requests stay
	// in the handshake stage until shutdown cancels them.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	cfg := config.Example(config.Decode)
	cfg.Model.NumBlocks, cfg.Model.NumLayers, cfg.Model.BlockSize = 8, 2, 16
	// A port checked free now (a port derived from the pid collided with
	// ephemeral ports of other tests' connections: exit 2, "address in use").
	kvPort, err := workers.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	cfg.KVTransfer.KVPort = config.Port(kvPort)
	cfg.Node.Control = "ipc://" + filepath.Join(dir, "d.sock")
	cfg.Cache.NoHugePages = true
	cfg.Handshake.Timeout, cfg.Handshake.Attempts = config.Duration(20*time.Second), 1
	cfg.Shutdown.DrainTimeout = config.Duration(time.Second)
	cfg.Node.Pprof = true
	cfgPath := filepath.Join(dir, "d.json")
	f, _ := os.Create(cfgPath)
	cfg.Print(f)
	f.Close()
	exe, _ := os.Executable()
	cmd := exec.Command(exe, "serve", "--config", cfgPath, "--log-format", "json")
	var stderr lockedBuffer
	cmd.Stderr = &stderr
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			ready <- sc.Text()
		}
		done <- cmd.Wait()
	}()
	select {
	case line := <-ready:
		if !strings.HasPrefix(line, "kvflow ready") {
			t.Fatalf("first line %q", line)
		}
		checkHTTP(t, line)
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		t.Fatalf("not ready: %s", stderr.String())
	}
	zctx, _ := zmq.NewContext()
	defer zctx.Term()
	sock, _ := zctx.NewSocket(zmq.REQ)
	defer func() { sock.SetLinger(0); sock.Close() }()
	sock.SetRcvtimeo(5 * time.Second)
	sock.Connect(cfg.Node.Control)
	call := func(msg map[string]any) map[string]any {
		b, _ := msgpack.Marshal(msg)
		if _, err := sock.SendBytes(b, 0); err != nil {
			t.Fatalf("control send: %v", err)
		}
		rb, err := sock.RecvBytes(0)
		if err != nil {
			t.Fatalf("control recv: %v", err)
		}
		var r map[string]any
		msgpack.Unmarshal(rb, &r)
		return r
	}
	port := ln.Addr().(*net.TCPAddr).Port
	var reqs []map[string]any
	for i := range 5 {
		reqs = append(reqs, map[string]any{"request_id": fmt.Sprint("r", i), "local_block_ids": []int{i},
			"kv_transfer_params": map[string]any{"remote_block_ids": []int{i}, "remote_engine_id": "P",
				"remote_host": "127.0.0.1", "remote_port": port}})
	}
	if r := call(map[string]any{"op": "load", "requests": reqs}); r["ok"] != true {
		t.Fatalf("load: %v", r)
	}
	start := time.Now()
	cmd.Process.Signal(syscall.SIGTERM)
	ended := map[string]bool{}
	for len(ended) < 5 && time.Since(start) < 10*time.Second {
		r := call(map[string]any{"op": "finished"})
		if fs, ok := r["failed_recving"].([]any); ok {
			for _, f := range fs {
				ended[f.(map[string]any)["request_id"].(string)] = true
			}
		}
		if ds, ok := r["done_recving"].([]any); ok && len(ds) > 0 {
			t.Errorf("requests reported done without their bytes: %v", ds)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if len(ended) != 5 {
		t.Fatalf("%d of 5 in-flight requests reported after SIGTERM", len(ended))
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("exit: %v\n%s", err, stderr.String())
		}
	case <-time.After(15 * time.Second):
		cmd.Process.Kill()
		t.Fatal("no exit after SIGTERM")
	}
	t.Logf("all 5 requests failed and collected, exit 0 after %v", time.Since(start))
}

// checkHTTP fetches the worker's HTTP endpoints named by its ready line
// (metrics=host:port): /healthz, /readyz, /metrics and, with node.pprof,
// the profiler's index.
func checkHTTP(t *testing.T, ready string) {
	t.Helper()
	_, addr, ok := strings.Cut(ready, "metrics=")
	if !ok {
		t.Fatalf("ready line %q names no metrics address", ready)
	}
	addr = strings.Fields(addr)[0]
	for path, want := range map[string]string{
		"/healthz":      "ok",
		"/readyz":       "ready",
		"/metrics":      "kvflow_stage_queue_capacity",
		"/debug/pprof/": "goroutine",
	} {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), want) {
			t.Errorf("GET %s: %s, body without %q", path, resp.Status, want)
		}
	}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// A side-channel port already in use is a usage error (exit 2) and leaves
// nothing running.
func TestServePortInUse(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	dir := t.TempDir()
	code, _, errOut := runCmd("serve", "--config", "../../internal/config/testdata/example-prefill.json",
		"--kv-port", fmt.Sprint(port), "--tp-rank", "0", "--side-channel-host", "127.0.0.1", "--te-host", "127.0.0.1",
		"--metrics-addr", "", "--cache", "anonymous", "--num-blocks", "4", "--control", "ipc://"+filepath.Join(dir, "c.sock"))
	if code != exitUsage || !strings.Contains(strings.ToLower(errOut), "in use") {
		t.Fatalf("exit %d: %s", code, errOut)
	}
}

// The exit codes the README's table documents: 0 success, 1 a runtime
// failure, 2 the command line or the configuration (a port in use
// included: the same command cannot succeed until the operator acts).
func TestExitCodes(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	busyAddr := busy.Addr().String()
	busyPort := fmt.Sprint(busy.Addr().(*net.TCPAddr).Port)
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedAddr := closed.Addr().String()
	closed.Close()
	dir := t.TempDir()
	// Below the ephemeral range (a port from a closed :0 listener is in it,
	// free for any outgoing connection to take before serve binds it).
	fp, err := workers.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	freePort := fmt.Sprint(fp)
	// A prefill worker of the example with its per-machine names moved
	// into the test's directory and free ports.
	prefill := func(extra ...string) []string {
		return append([]string{"serve", "--config", "../../deploy/examples/prefill.json", "--kv-port", freePort,
			"--metrics-addr", "127.0.0.1:0", "--cache-path", filepath.Join(dir, "cache"), "--no-lock", "--no-huge-pages",
			"--control", "ipc://" + filepath.Join(dir, "c.sock")}, extra...)
	}
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"version", []string{"version"}, exitOK, "kvflow"},
		{"help", []string{"serve", "-h"}, exitOK, ""},
		{"bad flag value", []string{"serve", "--tp-rank", "x"}, exitUsage, "tp-rank"},
		{"invalid config", prefill("--num-blocks", "0", "--print-config"), exitUsage, "model.num_blocks"},
		{"metrics port in use", prefill("--metrics-addr", busyAddr), exitUsage, "node.metrics_addr " + busyAddr},
		{"side channel port in use", prefill("--kv-port", busyPort), exitUsage, "in use"},
		{"transfer engine port in use", prefill("--te-port", busyPort), exitUsage, "in use"},
		{"transfer engine data port in use", prefill("--te-data-port", busyPort), exitUsage, "node.te_data_port " + busyPort},
		{"data port is the rpc port", prefill("--te-port", "17000", "--te-data-port", "17000", "--print-config"), exitUsage,
			"node.te_data_port: 17000 is also node.te_port"},
		{"side channel caps", prefill("--side-channel-max-conns", "8", "--side-channel-max-conns-per-peer", "9", "--print-config"), exitUsage,
			"node.limits.side_channel_max_conns_per_peer: 9 exceeds node.limits.side_channel_max_conns (8)"},
		{"peer unreachable (runtime)", []string{"probe", "--remote", closedAddr, "--timeout", "200ms"}, exitRuntime, "no reply"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errOut := runCmd(tc.args...)
			if code != tc.code || !strings.Contains(strings.ToLower(out+errOut), strings.ToLower(tc.want)) {
				t.Errorf("exit %d (want %d), output does not contain %q:\n%s%s", code, tc.code, tc.want, out, errOut)
			}
		})
	}
}

// The command line behaves: a bad flag value prints the error once and a
// pointer to --help (not the whole flag list); --help of every command goes
// to stdout and exits 0, one line per flag; bool flags render without an argument; version
// says what built the binary.
func TestCLIOutput(t *testing.T) {
	t.Run("bad flag value", func(t *testing.T) {
		for _, args := range [][]string{
			{"serve", "--tp-rank", "x"}, {"demo", "--requests", "x"}, {"probe", "--timeout", "x"},
			{"plan", "--tp-rank", "x"}, {"bench", "e2e", "--rounds", "x"}, {"bench", "te", "--nope"},
		} {
			code, out, errOut := runCmd(args...)
			lines := strings.Split(strings.TrimSpace(errOut), "\n")
			if code != exitUsage || out != "" || len(lines) != 2 || !strings.HasPrefix(lines[0], "kvflow "+args[0]+": ") ||
				!strings.HasPrefix(lines[1], "Run 'kvflow "+args[0]+" --help'") {
				t.Errorf("%q: exit %d, stdout %q, stderr:\n%s", args, code, out, errOut)
			}
		}
	})
	t.Run("help on stdout", func(t *testing.T) {
		for _, tc := range []struct {
			args []string
			want string
		}{
			{[]string{"--help"}, "usage: kvflow <command>"},
			{[]string{"serve", "--help"}, "  -tp-rank int "},
			{[]string{"serve", "-h"}, "  -engine-id string "},
			{[]string{"demo", "--help"}, "  -requests int "},
			{[]string{"probe", "--help"}, "  -remote HOST:PORT "},
			{[]string{"keygen", "--help"}, "  -secret FILE "},
			{[]string{"plan", "--help"}, "usage: kvflow plan"},
			{[]string{"bench", "--help"}, "usage: kvflow bench te|e2e"},
			{[]string{"bench", "te", "--help"}, "usage: kvflow bench te"},
			{[]string{"bench", "e2e", "--help"}, "  -in-process "},
			{[]string{"version", "--help"}, "usage: kvflow version"},
		} {
			code, out, errOut := runCmd(tc.args...)
			if code != exitOK || errOut != "" || !strings.Contains(out, tc.want) || strings.Contains(out, "panic") {
				t.Errorf("%q: exit %d, stderr %q, stdout lacks %q:\n%s", tc.args, code, errOut, tc.want, out)
			}
		}
	})
	t.Run("version", func(t *testing.T) {
		code, out, _ := runCmd("version")
		for _, re := range []string{`(?m)^kvflow \S+$`, `(?m)^module +github.com/kvflow/kvflow `, `(?m)^commit +\S+`,
			`(?m)^go +go1\.\d+`, `(?m)^build tags +\S+`, `(?m)^cgo +[01]$`, `(?m)^platform +\w+/\w+$`} {
			if code != exitOK || !regexp.MustCompile(re).MatchString(out) {
				t.Errorf("version output lacks %s:\n%s", re, out)
			}
		}
	})
}

// mooncakePrintExit and mooncakePrintWant are what serve --te-backend
// mooncake --print-config gives: in a binary built without -tags mooncake
// the refusal naming the tag, in one built with it the configuration led
// by the backend's fallbacks.
func mooncakePrintExit() int {
	if config.MooncakeBuilt {
		return exitOK
	}
	return exitUsage
}

func mooncakePrintWant() string {
	if config.MooncakeBuilt {
		return `"//node.te_backend mooncake falls back": [`
	}
	return `node.te_backend: "mooncake" needs a kvflow built with -tags mooncake against an installed Mooncake, and this binary was built without it`
}
