//go:build mooncake && cgo

package node

// Tests with Mooncake's real transfer engine (node.te_backend mooncake,
// its tcp transport) against kvflow's own tcp engine and itself, every
// byte verified. Built only with -tags mooncake against a Mooncake build
// (make test-mooncake); skipped when MOONCAKE_PREFIX is unset. Mooncake's
// listeners bind every address of the host, so each test re-runs itself
// in a fresh network namespace with only loopback up (unshare -n).

import (
	"bufio"
	"bytes"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvflow/kvflow/hw/mooncake/mooncakec"
	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/internal/tooling/testkit"
	"github.com/kvflow/kvflow/internal/tooling/verify"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// netnsEnv marks a test process already running in its own network
// namespace.
const netnsEnv = "KVFLOW_TEST_NETNS"

// inMooncakeNetns reports whether the calling top-level test should run
// here: true inside the private network namespace; otherwise it runs the
// test again in one (unshare -n, loopback up), reports its outcome and
// returns false. It skips when MOONCAKE_PREFIX is unset or a network
// namespace cannot be made (not root).
func inMooncakeNetns(t *testing.T) bool {
	t.Helper()
	if os.Getenv("MOONCAKE_PREFIX") == "" {
		t.Skip("MOONCAKE_PREFIX unset: the tests with Mooncake's engine run where ../shared/tools/mooncake-build.sh ran (make test-mooncake)")
	}
	if os.Getenv(netnsEnv) == "1" {
		return true
	}
	if out, err := exec.Command("unshare", "-n", "true").CombinedOutput(); err != nil {
		t.Skipf("Mooncake's listeners bind every address, so these tests run in a private network namespace, and unshare -n failed (root needed): %v %s",
			err, strings.TrimSpace(string(out)))
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skipf("bringing loopback up in the test's network namespace needs ip(8) (iproute2): %v", err)
	}
	timeout := 5 * time.Minute
	if d, ok := t.Deadline(); ok {
		timeout = time.Until(d) - 5*time.Second
	}
	cmd := exec.Command("unshare", "-n", "sh", "-c", `ip link set lo up && exec "$@"`, "sh",
		os.Args[0], "-test.run=^"+t.Name()+"$", "-test.count=1", "-test.v", "-test.timeout="+timeout.String())
	cmd.Env = append(os.Environ(), netnsEnv+"=1")
	out, err := cmd.CombinedOutput()
	t.Logf("in a private network namespace:\n%s", out)
	if err != nil {
		t.Fatalf("%s in its network namespace: %v", t.Name(), err)
	}
	if bytes.Contains(out, []byte("--- SKIP: "+t.Name())) {
		t.Skip("skipped in its network namespace")
	}
	return false
}

// TestMooncakeEndToEnd: kvflow's decode pulling through Mooncake's engine
// from kvflow's tcp engine, the other way round, and Mooncake's engine on
// both sides; stitched (tp_num_need_pulls > 1: the stitch kernel after a
// Mooncake decode's reads, fused into a tcp decode's), MLA, and decode TP
// above prefill TP (one read per row from a Mooncake prefill or by a
// Mooncake decode). runEndToEnd checks every byte.
func TestMooncakeEndToEnd(t *testing.T) {
	if !inMooncakeNetns(t) {
		return
	}
	mc := config.BackendMooncake
	for _, tc := range []topo{
		{name: "cgo-decode-from-tcp-tp1-to-1", prefillTP: 1, decodeTP: 1, model: gqa(3), decodeTE: mc},
		{name: "cgo-decode-from-tcp-tp4-to-2", prefillTP: 4, decodeTP: 2, model: gqa(2), decodeTE: mc, prefixHit: true},
		{name: "tcp-decode-from-cgo-tp1-to-1", prefillTP: 1, decodeTP: 1, model: gqa(3), prefillTE: mc},
		{name: "tcp-decode-from-cgo-tp4-to-2-fused", prefillTP: 4, decodeTP: 2, model: gqa(2), prefillTE: mc},
		{name: "tcp-decode-from-cgo-tp1-to-2", prefillTP: 1, decodeTP: 2, model: gqa(2), prefillTE: mc},
		{name: "cgo-cgo-tp1-to-1", prefillTP: 1, decodeTP: 1, model: gqa(3), prefillTE: mc, decodeTE: mc},
		{name: "cgo-cgo-tp2-to-1", prefillTP: 2, decodeTP: 1, model: gqa(2), prefillTE: mc, decodeTE: mc},
		{name: "cgo-cgo-mla-tp2-to-1", prefillTP: 2, decodeTP: 1, model: mla(), prefillTE: mc, decodeTE: mc},
		{name: "cgo-cgo-tp1-to-2", prefillTP: 1, decodeTP: 2, model: gqa(2), prefillTE: mc, decodeTE: mc},
	} {
		t.Run(tc.name, func(t *testing.T) { runEndToEnd(t, tc) })
	}
}

// TestMooncakeCapabilitiesAndFallbacks: the node finds what Mooncake's
// engine cannot do once, at start, and says so at warn: a prefill with
// read.grants auto serves without grants, a decode reads without strided
// rows (the stitch kernel transposes) and reconciles Mooncake's per-op
// byte counts.
func TestMooncakeCapabilitiesAndFallbacks(t *testing.T) {
	if !inMooncakeNetns(t) {
		return
	}
	for _, role := range []string{"prefill", "decode"} {
		t.Run(role, func(t *testing.T) {
			cfg := baseConfig(topo{prefillTP: 2, decodeTP: 1, model: gqa(2), prefillTE: config.BackendMooncake, decodeTE: config.BackendMooncake}, role, 21000)
			cfg.Read.Grants = config.GrantsAuto
			var logs logBuffer
			n, err := Start(cfg, Deps{Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
			if err != nil {
				t.Fatal(err)
			}
			defer n.Close(t.Context())
			if _, ok := n.Engine.(*mooncakec.CgoEngine); !ok {
				t.Fatalf("engine %T", n.Engine)
			}
			caps := read.Engine(n.Engine).Capabilities()
			if caps.LocalStride || caps.Gather || !caps.Ledger || caps.Classify == nil {
				t.Errorf("read capabilities %+v: want no strided or gathered reads, a ledger", caps)
			}
			if PeerBuffers(n.Engine) != nil {
				t.Error("peer buffers from an engine that cannot list them")
			}
			want := map[string][]string{
				"prefill": {"setting=read.grants", "node.limits"},
				"decode":  {"setting=read.fused_stitch", "setting=node.te_backend", "ledger"},
			}[role]
			got := logs.String()
			for _, w := range want {
				if !strings.Contains(got, "transfer backend falls back") || !strings.Contains(got, w) {
					t.Errorf("no warning with %q in:\n%s", w, got)
				}
			}
			if strings.Contains(got, "read.grants=off") {
				t.Errorf("the read.grants=off warning for grants the operator left on:\n%s", got)
			}
		})
	}
}

// TestMooncakePrefillRestart: a prefill worker restarts between two
// requests; a decode reading through Mooncake's engine re-fetches the
// metadata and reads again, from a new transfer-engine port (a new
// segment) or the same one (a tcp prefill with a fixed node.te_port: the
// segment Mooncake cached under that name is re-fetched after the failed
// batch). Both requests end done, byte for byte. A prefill on Mooncake's
// engine always comes back on a new port (Mooncake picks it).
func TestMooncakePrefillRestart(t *testing.T) {
	if !inMooncakeNetns(t) {
		return
	}
	mc := config.BackendMooncake
	for _, tc := range []struct {
		name       string
		prefillTE  string
		sameTEPort bool
	}{
		{"tcp-prefill-new-port", "", false},
		{"tcp-prefill-same-port", "", true},
		{"cgo-prefill-new-port", mc, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := startCluster(t, topo{prefillTP: 1, decodeTP: 1, model: gqa(2), prefillTE: tc.prefillTE, decodeTE: mc}, patientRefetch)
			if r := pull(t, c, c.prefill[0], "before", []int{1, 2}, []int{3, 4}, true); r.Err != nil {
				t.Fatalf("request before the restart: %v", r.Err)
			}
			checkBytes(t, c, "before", []int{1, 2}, []int{3, 4})
			p2 := restartPrefill(t, c, 0, tc.sameTEPort)
			r := pull(t, c, p2, "after", []int{5, 6, 7}, []int{8, 9, 10}, true)
			if r.Err != nil {
				t.Fatalf("request after the restart: %v", r.Err)
			}
			checkBytes(t, c, "after", []int{5, 6, 7}, []int{8, 9, 10})
			reg := c.regs[c.decode[0]]
			if n := counter(t, reg, "kvflow_read_retries_total", map[string]string{"result": "done"}); n != 1 {
				t.Errorf("%v reads retried and done, want 1", n)
			}
			r = pull(t, c, p2, "next", []int{11}, []int{12}, true)
			if r.Err != nil {
				t.Fatalf("request after the retry: %v", r.Err)
			}
			checkBytes(t, c, "next", []int{11}, []int{12})
			if n := counter(t, reg, "kvflow_read_retries_total", nil); n != 1 {
				t.Errorf("%v retries in all, want 1", n)
			}
		})
	}
}

// TestMooncakeDecodeFromSeedPrefill: a kvflow decode on Mooncake's engine
// pulls from the seed's prefill worker side running on Mooncake's Python
// engine (testdata/seedprefill.py: the seed's registration and side-channel
// loop; protocol tcp). The prefill's cache is a kvflow cache file the test
// fills and the Python process maps, so every byte is checked against the
// pattern; each request's DONE_RECVING reaches the seed's loop.
func TestMooncakeDecodeFromSeedPrefill(t *testing.T) {
	if !inMooncakeNetns(t) {
		return
	}
	py := os.Getenv("SEED_PYTHON")
	if py == "" {
		py = "/usr/bin/python3"
	}
	mpy := os.Getenv("MOONCAKE_PY")
	if mpy == "" {
		t.Skip("MOONCAKE_PY unset: the directory of Mooncake's Python module (mooncake-build.sh's python/)")
	}
	env := append(os.Environ(), "PYTHONPATH="+mpy)
	check := exec.Command(py, "-c", "import zmq, msgpack, numpy, mooncake.engine")
	check.Env = env
	if out, err := check.CombinedOutput(); err != nil {
		t.Skipf("the seed's prefill needs %s with python3-zmq, python3-msgpack, python3-numpy and Mooncake's module: %v %s", py, err, out)
	}
	tp := topo{prefillTP: 1, decodeTP: 1, model: gqa(3), decodeTE: config.BackendMooncake}
	pcfg := baseConfig(tp, "prefill", 20000)
	shape, err := pcfg.Shape()
	if err != nil {
		t.Fatal(err)
	}
	layout, err := npu.NewLayout(shape)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "seed-prefill.cache")
	cache, err := npu.CreateShm(path, layout, npu.HostOptions{NoHugePages: true, NoLock: true})
	if err != nil {
		t.Fatal(err)
	}
	defer cache.Close()
	type req struct {
		id            string
		local, remote []int
	}
	reqs := []req{{"seed-a", []int{1, 2, 3}, []int{7, 8, 9}}, {"seed-b", []int{4}, []int{20}}, {"seed-c", []int{10, 11}, []int{30, 2}}}
	for _, r := range reqs {
		verify.FillBlocks(cache, shape.NumLayers, layout.NumParts(), 0, r.remote, plan.StringToInt64Hash(r.id))
	}

	cmd := exec.Command(py, "testdata/seedprefill.py", path, "P")
	cmd.Env = env
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr logBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 64)
	exited := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		exited <- cmd.Wait()
	}()
	defer func() {
		stdin.Close() // the peer exits when stdin closes
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			t.Errorf("seed prefill (pid %d) did not exit; killing it", cmd.Process.Pid)
			cmd.Process.Kill()
			<-exited
		}
	}()
	next := func() string {
		t.Helper()
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("seed prefill exited; stderr:\n%s", stderr.String())
			}
			return l
		case <-time.After(30 * time.Second):
			t.Fatalf("seed prefill silent for 30 s; stderr:\n%s", stderr.String())
		}
		return ""
	}
	ready := next()
	port, err := strconv.Atoi(strings.TrimPrefix(ready, "READY "))
	if err != nil {
		t.Fatalf("seed prefill said %q; stderr:\n%s", ready, stderr.String())
	}

	results := make(chan decode.Result, len(reqs))
	d, err := Start(baseConfig(tp, "decode", testkit.RandomPort()), Deps{OnFinish: func(r decode.Result) { results <- r }})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close(t.Context())
	params := func(r req) plan.Request {
		return plan.Request{ID: r.id, LocalBlockIDs: r.local, RemoteBlockIDs: r.remote, RemoteHost: "127.0.0.1",
			RemotePort: port, RemoteEngineID: "P", RemotePCPSize: 1, RemoteDCPSize: 1}
	}
	for _, r := range reqs {
		errs := d.Decode.Load(t.Context(), []decode.LoadRequest{{RequestID: r.id, LocalBlockIDs: r.local,
			Params: decode.KVTransferParams{RemoteBlockIDs: r.remote, RemoteEngineID: "P", RemoteHost: "127.0.0.1",
				RemotePort: port, RemotePCPSize: 1, RemoteDCPSize: 1}}})
		if errs[0] != nil {
			t.Fatal(errs[0])
		}
	}
	for range reqs {
		select {
		case res := <-results:
			if res.Err != nil {
				t.Errorf("request %s failed: %v", res.RequestID, res.Err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("requests did not finish")
		}
	}
	rows := make([]int, layout.NumParts())
	for p := range rows {
		rows[p] = layout.BlockLen(p) / shape.BlockSize
	}
	for _, r := range reqs {
		pl, err := plan.PlanRequest(d.Config.Topology(), d.Config.Self(), params(r))
		if err != nil {
			t.Fatal(err)
		}
		if bad, err := verify.Check(d.Device, pl, rows, plan.StringToInt64Hash(r.id)); bad != 0 {
			t.Errorf("request %s: %d bad bytes: %v", r.id, bad, err)
		}
	}
	// The seed's loop got one DONE_RECVING per request.
	dones := map[string]bool{}
	for len(dones) < len(reqs) {
		l := next()
		id, ok := strings.CutPrefix(l, "DONE ")
		if !ok {
			t.Fatalf("seed prefill said %q", l)
		}
		dones[strings.Trim(id, `"`)] = true
	}
	for _, r := range reqs {
		if !dones[r.id] {
			t.Errorf("no DONE for %s (got %v)", r.id, dones)
		}
	}
}

// TestMooncakeCurveSideChannel: with auth.mode curve (auth.data_plane left
// empty) a prefill on Mooncake's engine keeps its side channel CURVE-
// authenticated and serves its data port open (the fallback), so a kvflow
// decode with the keys, on the tcp engine or Mooncake's, reads byte for
// byte; a decode without the prefill's key gets no metadata.
func TestMooncakeCurveSideChannel(t *testing.T) {
	if !inMooncakeNetns(t) {
		return
	}
	dir := t.TempDir()
	keys := func(name string) (sec, pub string) {
		sec, pub = filepath.Join(dir, name+".key"), filepath.Join(dir, name+".pub")
		if _, err := os.Stat(sec); err == nil {
			return sec, pub
		}
		if _, err := sidechannel.WriteKeyPair(sec, pub); err != nil {
			t.Fatal(err)
		}
		return sec, pub
	}
	pSec, pPub := keys("prefill")
	dSec, dPub := keys("decode")
	_, otherPub := keys("other")
	for _, tc := range []struct {
		name, decodeTE, serverKey string
		ok                        bool
	}{
		{"tcp-decode", "", pPub, true},
		{"cgo-decode", config.BackendMooncake, pPub, true},
		{"cgo-decode-wrong-server-key", config.BackendMooncake, otherPub, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := startCluster(t, topo{prefillTP: 1, decodeTP: 1, model: gqa(2), prefillTE: config.BackendMooncake, decodeTE: tc.decodeTE,
				mutate: func(role string, cfg *config.Config) {
					if role == "prefill" {
						cfg.Auth = config.Auth{Mode: config.AuthCurve, SecretKeyFile: pSec, PublicKeyFile: pPub}
					} else {
						cfg.Auth = config.Auth{Mode: config.AuthCurve, SecretKeyFile: dSec, PublicKeyFile: dPub, ServerPublicKeyFile: tc.serverKey}
					}
				}})
			r := pull(t, c, c.prefill[0], "curve", []int{1, 2}, []int{3, 4}, true)
			if !tc.ok {
				if r.Err == nil {
					t.Fatal("a decode with the wrong server key read from a curve prefill")
				}
				t.Logf("refused: %v", r.Err)
				return
			}
			if r.Err != nil {
				t.Fatal(r.Err)
			}
			checkBytes(t, c, "curve", []int{1, 2}, []int{3, 4})
		})
	}
}

// logBuffer is a bytes.Buffer safe for a slog handler's concurrent writes.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
