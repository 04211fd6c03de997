package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/tooling/verify"
	"github.com/kvflow/kvflow/internal/tooling/workers"
	"github.com/kvflow/kvflow/stages/plan"
)

// pdCluster is `kvflow serve` processes on loopback, driven as an engine
// drives them: prefill ranks of one instance (kv_port base) and one decode
// rank, shm caches attached here to fill and check.
type pdCluster struct {
	t       *testing.T
	set     *workers.Set
	dir     string
	shm     string
	base    int
	cmds    map[string]*exec.Cmd // by worker name: the exit status, once exited
	cmdsMu  sync.Mutex
	prefill map[int]*workers.Worker // by TP rank
	decode  *workers.Worker
}

// newPDCluster starts the prefill ranks launch of an instance of
// prefillTP ranks (the others are the caller's: a rank that is not started
// leaves its port free) and one decode rank of TP 1. tune adjusts each
// config.
func newPDCluster(t *testing.T, prefillTP int, launch []int, tune func(*config.Config)) *pdCluster {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	shm, err := workers.ShmDir("kvflow-drain-test-", dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(shm) })
	set, err := workers.NewSet(exe, dir)
	if err != nil {
		t.Fatal(err)
	}
	set.StopTimeout = 5 * time.Second
	t.Cleanup(set.Close)
	base, err := workers.FreePorts(prefillTP)
	if err != nil {
		t.Fatal(err)
	}
	c := &pdCluster{t: t, set: set, dir: dir, shm: shm, base: base, cmds: map[string]*exec.Cmd{}, prefill: map[int]*workers.Worker{}}
	for _, r := range launch {
		c.prefill[r] = c.launch(config.Prefill, r, prefillTP, base, tune)
	}
	dport, err := workers.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	c.decode = c.launch(config.Decode, 0, prefillTP, dport, tune)
	return c
}

func (c *pdCluster) launch(role config.Role, rank, prefillTP, kvPort int, tune func(*config.Config)) *workers.Worker {
	cfg := config.Example(role)
	kv := &cfg.KVTransfer
	kv.KVConnectorExtraConfig.Prefill = config.Parallel{TPSize: prefillTP, DPSize: 1, PPSize: 1}
	kv.KVConnectorExtraConfig.Decode = config.Parallel{TPSize: 1, DPSize: 1, PPSize: 1}
	kv.KVPort = config.Port(kvPort)
	cfg.Model = config.Model{NumLayers: 2, NumKVHeads: 8, HeadDim: 16, BlockSize: 16, DType: "bf16", NumBlocks: 128}
	cfg.Rank = config.Rank{TP: rank}
	name := fmt.Sprintf("%s%d", role, rank)
	cfg.Cache = config.Cache{Mode: config.CacheShm, Path: filepath.Join(c.shm, name+".kv"), NoHugePages: true, NoLock: true}
	cfg.Node.Control = "ipc://" + filepath.Join(c.dir, name+".sock")
	cfg.Node.MetricsAddr = "127.0.0.1:0"
	cfg.Log = config.Log{Level: "info", Format: "json"}
	if tune != nil {
		tune(&cfg)
	}
	w, err := c.set.Launch(context.Background(), workers.Spec{Name: name, Config: cfg,
		Command: func(exe string, args ...string) *exec.Cmd {
			cmd := exec.Command(exe, args...)
			c.cmdsMu.Lock()
			c.cmds[name] = cmd
			c.cmdsMu.Unlock()
			return cmd
		}})
	if err != nil {
		c.t.Fatal(err)
	}
	return w
}

// exitCode waits up to max for w to exit and returns its exit code.
func (c *pdCluster) exitCode(w *workers.Worker, max time.Duration) int {
	c.t.Helper()
	select {
	case <-w.Exited():
	case <-time.After(max):
		c.t.Fatalf("%s still running %v later; its log:\n%s", w.Name, max, workers.Tail(w.LogPath))
	}
	c.cmdsMu.Lock()
	defer c.cmdsMu.Unlock()
	return c.cmds[w.Name].ProcessState.ExitCode()
}

// testReq is one request: its blocks on both sides.
type testReq struct {
	id            string
	remote, local []int
}

func (c *pdCluster) requests(n, blocks int) []testReq {
	reqs := make([]testReq, n)
	for i := range reqs {
		r := testReq{id: fmt.Sprintf("req-%02d-%d", i, c.base)}
		for k := range blocks {
			r.remote = append(r.remote, i*blocks+k)
			r.local = append(r.local, 127-(i*blocks+k))
		}
		reqs[i] = r
	}
	return reqs
}

// fill "prefills" rs on every running prefill rank (the pattern of the
// request id, per rank, layer, part and block).
func (c *pdCluster) fill(rs []testReq) {
	for r, w := range c.prefill {
		l := w.Cache.Layout()
		rank := plan.DeviceIndex(w.Config.Topology().Prefill, w.Config.Self())
		if rank != r {
			c.t.Fatalf("device index %d of tp rank %d", rank, r)
		}
		for _, q := range rs {
			verify.FillBlocks(w.Cache, l.Shape().NumLayers, l.NumParts(), rank, q.remote, plan.StringToInt64Hash(q.id))
		}
	}
}

func (c *pdCluster) send(w *workers.Worker, rs []testReq) (workers.Reply, error) {
	var sends []map[string]any
	for _, q := range rs {
		sends = append(sends, map[string]any{"request_id": q.id, "delay_start_time": float64(time.Now().UnixNano()) / 1e9, "block_ids": q.remote})
	}
	return w.Ctl.Call(map[string]any{"op": "send", "requests": sends})
}

func (c *pdCluster) load(rs []testReq) {
	c.t.Helper()
	var loads []map[string]any
	for _, q := range rs {
		loads = append(loads, map[string]any{"request_id": q.id, "local_block_ids": q.local,
			"kv_transfer_params": map[string]any{"remote_block_ids": q.remote, "remote_engine_id": "prefill-0",
				"remote_host": "127.0.0.1", "remote_port": c.base, "remote_pcp_size": 1, "remote_dcp_size": 1}})
	}
	if _, err := c.decode.Ctl.Call(map[string]any{"op": "load", "requests": loads}); err != nil {
		c.t.Fatalf("load: %v", err)
	}
}

// check compares the decode's blocks of q with what the prefill ranks
// were filled with; it returns the first mismatch.
func (c *pdCluster) check(q testReq) error {
	pw := c.prefill[0]
	l := pw.Cache.Layout()
	rowBytes := make([]int, l.NumParts())
	for p := range rowBytes {
		rowBytes[p] = l.BlockLen(p) / pw.Config.Model.BlockSize
	}
	d := c.decode.Config
	pl, err := plan.PlanRequest(d.Topology(), d.Self(), plan.Request{ID: q.id, LocalBlockIDs: q.local, RemoteBlockIDs: q.remote,
		RemoteHost: "127.0.0.1", RemotePort: c.base, RemoteEngineID: "prefill-0", RemotePCPSize: 1, RemoteDCPSize: 1})
	if err != nil {
		return err
	}
	_, err = verify.Check(c.decode.Cache, pl, rowBytes, plan.StringToInt64Hash(q.id))
	return err
}

func httpStatus(addr, path string) int {
	cl := http.Client{Timeout: time.Second}
	resp, err := cl.Get("http://" + addr + path)
	if err != nil {
		return 0
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// TestPrefillDrain (#18 point 2): SIGTERM to a prefill worker holding 40
// requests. It goes not-ready on /readyz at once, refuses new sends on its
// control socket, and keeps serving GET_META, reads and DONEs until every
// held request was DONE'd; the decode gets all 40 with the right bytes —
// 20 of them loaded only after the SIGTERM, so their handshake and reads
// happen during the drain — the engine collects all 40 done_sending, and
// the prefill exits 0. Before the drain existed, the side channel and
// transfer engine closed at once and most requests failed.
func TestPrefillDrain(t *testing.T) {
	c := newPDCluster(t, 1, []int{0}, func(cfg *config.Config) {
		// Far above what the drain needs: the test must end by the held
		// requests, never by the deadline.
		cfg.Shutdown.DrainTimeout = config.Duration(60 * time.Second)
	})
	p := c.prefill[0]
	reqs := c.requests(40, 2)
	c.fill(reqs)
	if _, err := c.send(p, reqs); err != nil {
		t.Fatalf("send: %v", err)
	}
	// The engine's finished polls of the prefill go on through the drain
	// (on their own client), collecting done_sending until it exits.
	var freedMu sync.Mutex
	freed := map[string]bool{}
	pollDone := make(chan struct{})
	poller := c.set.Client(p, time.Second)
	go func() {
		defer close(pollDone)
		for {
			select {
			case <-p.Exited():
				return
			default:
			}
			if rep, err := poller.Call(map[string]any{"op": "finished"}); err == nil {
				freedMu.Lock()
				for _, id := range rep.DoneSending {
					freed[id] = true
				}
				freedMu.Unlock()
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()

	c.load(reqs[:20])
	if err := syscall.Kill(p.Pid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// Not ready at once (polled: the signal is asynchronous).
	deadline := time.Now().Add(10 * time.Second)
	for httpStatus(p.Metrics, "/readyz") != http.StatusServiceUnavailable {
		if time.Now().After(deadline) {
			t.Fatal("/readyz still not 503 10 s after SIGTERM")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// Draining: a new send is refused with a clear error. (A worker that
	// already exited — no drain — fails the checks below.)
	for draining := false; !draining; {
		rep, err := p.Ctl.Call(map[string]any{"op": "status"})
		if err != nil {
			t.Logf("prefill gone after SIGTERM: %v", err)
			break
		}
		draining, _ = rep.Status["draining"].(bool)
		if !draining {
			if time.Now().After(deadline) {
				t.Fatalf("prefill not draining 10 s after SIGTERM: %v", rep.Status)
			}
			time.Sleep(5 * time.Millisecond)
			continue
		}
		extra := c.requests(41, 1)[40:]
		extra[0].id = "after-sigterm"
		if _, err := c.send(p, extra); err == nil || !strings.Contains(err.Error(), "draining") {
			t.Errorf("send while draining: %v, want a refusal naming the drain", err)
		}
	}
	c.load(reqs[20:])

	// All 40 done on the decode, every byte right.
	ended := map[string]string{} // id → "" (done) or the failure
	deadline = time.Now().Add(60 * time.Second)
	for len(ended) < len(reqs) && time.Now().Before(deadline) {
		rep, err := c.decode.Ctl.Call(map[string]any{"op": "finished"})
		if err != nil {
			t.Fatalf("decode finished: %v", err)
		}
		for _, id := range rep.DoneRecving {
			ended[id] = ""
		}
		for _, f := range rep.FailedRecving {
			ended[f.RequestID] = "failed: " + f.Reason
		}
		time.Sleep(10 * time.Millisecond)
	}
	var failed []string
	for _, q := range reqs {
		res, ok := ended[q.id]
		switch {
		case !ok:
			failed = append(failed, q.id+": never reported")
		case res != "":
			failed = append(failed, q.id+": "+res)
		default:
			if err := c.check(q); err != nil {
				failed = append(failed, q.id+": wrong bytes: "+err.Error())
			}
		}
	}
	if len(failed) > 0 {
		t.Fatalf("%d of %d requests not done with their bytes:\n%s\nprefill log:\n%s", len(failed), len(reqs),
			strings.Join(failed, "\n"), workers.Tail(p.LogPath))
	}
	if code := c.exitCode(p, 30*time.Second); code != 0 {
		t.Fatalf("prefill exit code %d; its log:\n%s", code, workers.Tail(p.LogPath))
	}
	<-pollDone
	freedMu.Lock()
	defer freedMu.Unlock()
	var missing []string
	for _, q := range reqs {
		if !freed[q.id] {
			missing = append(missing, q.id)
		}
	}
	if len(missing) > 0 || freed["after-sigterm"] {
		t.Errorf("done_sending not collected by the engine for %v (refused request freed: %v)", missing, freed["after-sigterm"])
	}
	// The decode side is unaffected: still serving.
	if _, err := c.decode.Ctl.Call(map[string]any{"op": "status"}); err != nil {
		t.Errorf("decode after the prefill's drain: %v", err)
	}
}

// TestLeaseFreesKilledDecode (#18 point 5): a decode that renewed its
// requests' leases and was then SIGKILLed gets them freed on the prefill
// about one lease TTL after its last renewal, long before the abort
// timeout, and the prefill counts them as lease expiries. The decode is
// kept from finishing by a second prefill rank that accepts and never
// answers (its handshake waits), while the real rank's metadata, fetched
// at admission, leases every request there.
func TestLeaseFreesKilledDecode(t *testing.T) {
	const (
		abort = 40 * time.Second
		ttl   = time.Second
	)
	c := newPDCluster(t, 2, []int{0}, func(cfg *config.Config) {
		cfg.Tracker.AbortRequestTimeout = config.Duration(abort)
		cfg.Tracker.LeaseTTL = config.Duration(ttl)
		cfg.Handshake.Timeout, cfg.Handshake.Attempts = config.Duration(120*time.Second), 1
	})
	// Prefill rank 1 (port base+1, left free) is a listener that accepts
	// and never answers.
	hole, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", c.base+1))
	if err != nil {
		t.Fatal(err)
	}
	defer hole.Close()
	go func() {
		var conns []net.Conn
		defer func() {
			for _, cn := range conns {
				cn.Close()
			}
		}()
		for {
			cn, err := hole.Accept()
			if err != nil {
				return
			}
			conns = append(conns, cn)
		}
	}()
	p := c.prefill[0]
	reqs := c.requests(10, 2)
	if _, err := c.send(p, reqs); err != nil {
		t.Fatalf("send: %v", err)
	}
	sent := time.Now()
	c.load(reqs)
	// Wait until the prefill holds every request under a lease.
	deadline := sent.Add(20 * time.Second)
	for {
		rep, err := p.Ctl.Call(map[string]any{"op": "status"})
		if err != nil {
			t.Fatal(err)
		}
		if asInt(rep.Status["leased"]) == len(reqs) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("requests not leased 20 s after the load: %v\ndecode log:\n%s", rep.Status, workers.Tail(c.decode.LogPath))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := syscall.Kill(-c.decode.Pid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	// The engine polls finished; every request must come back well
	// before the abort timeout (a generous bound: about one TTL is
	// expected, logged below).
	freed := map[string]bool{}
	deadline = sent.Add(abort - 5*time.Second)
	for len(freed) < len(reqs) && time.Now().Before(deadline) {
		rep, err := p.Ctl.Call(map[string]any{"op": "finished"})
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range rep.DoneSending {
			freed[id] = true
		}
		time.Sleep(20 * time.Millisecond)
	}
	if len(freed) != len(reqs) {
		t.Fatalf("%d of %d requests freed %v after the decode was killed (lease ttl %v, abort timeout %v)",
			len(freed), len(reqs), time.Since(killed).Round(time.Millisecond), ttl, abort)
	}
	t.Logf("all %d freed %v after SIGKILL of the decode (lease ttl %v, abort timeout %v)",
		len(reqs), time.Since(killed).Round(time.Millisecond), ttl, abort)
	mfs, err := p.Scrape(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	counted := -1.0
	for _, mf := range mfs {
		if mf.GetName() == "kvflow_prefill_lease_expired_total" {
			counted = mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	if counted != float64(len(reqs)) {
		t.Errorf("kvflow_prefill_lease_expired_total %v, want %d", counted, len(reqs))
	}
	for _, q := range reqs {
		if !freed[q.id] {
			t.Errorf("%s not freed", q.id)
		}
	}
}

// asInt reads a msgpack-decoded integer of any width (-1: not one).
func asInt(v any) int {
	switch n := v.(type) {
	case int8:
		return int(n)
	case int16:
		return int(n)
	case int32:
		return int(n)
	case int64:
		return int(n)
	case uint8:
		return int(n)
	case uint16:
		return int(n)
	case uint32:
		return int(n)
	case uint64:
		return int(n)
	case int:
		return n
	}
	return -1
}
