package node

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/internal/tooling/testkit"
)

func load(t *testing.T, d *Node, id string, local, remote []int, port int, engine string) error {
	t.Helper()
	return d.Decode.Load(context.Background(), []decode.LoadRequest{{RequestID: id, LocalBlockIDs: local,
		Params: decode.KVTransferParams{RemoteBlockIDs: remote, RemoteEngineID: engine, RemoteHost: "127.0.0.1", RemotePort: port}}})[0]
}

func waitResult(t *testing.T, c *cluster, within time.Duration) decode.Result {
	t.Helper()
	select {
	case r := <-c.results:
		return r
	case <-time.After(within):
		t.Fatalf("no result within %v", within)
	}
	return decode.Result{}
}

// A prefill worker that is gone fails the request with its block ids, within
// the configured timeouts; a healthy peer still serves later requests.
func TestPrefillGone(t *testing.T) {
	tp := topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}
	c := startCluster(t, tp)
	healthy := startCluster(t, tp) // a second prefill instance
	p := c.prefill[0]
	p.Prefill.Send([]prefill.SendRequest{{RequestID: "warm", BlockIDs: []int{1}}})
	d := c.decode[0]
	if err := load(t, d, "warm", []int{1}, []int{1}, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	if r := waitResult(t, c, 10*time.Second); r.Err != nil {
		t.Fatalf("warm-up: %v", r.Err)
	}
	// Kill the prefill worker: metadata is cached, so the read itself fails.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	p.Close(ctx)
	cancel()
	start := time.Now()
	if err := load(t, d, "orphan", []int{2, 3}, []int{4, 5}, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	r := waitResult(t, c, 20*time.Second)
	if r.Err == nil || r.RequestID != "orphan" {
		t.Fatalf("request to a dead prefill: %+v", r)
	}
	t.Logf("failed after %v: %v", time.Since(start), r.Err)
	_, failed := d.Decode.Finished()
	var found bool
	for _, f := range failed {
		if f.RequestID == "orphan" {
			found = true
			if len(f.BlockIDs) != 2 || f.BlockIDs[0] != 2 || f.Reason == "" {
				t.Errorf("failure %+v: want local block ids [2 3] and a reason", f)
			}
		}
	}
	if !found {
		t.Fatal("failure not reported by Finished")
	}
	// The same decode worker pulls from a healthy prefill instance.
	healthy.prefill[0].Prefill.Send([]prefill.SendRequest{{RequestID: "ok", BlockIDs: []int{7}}})
	if err := load(t, d, "ok", []int{7}, []int{7}, healthy.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	if r := waitResult(t, c, 10*time.Second); r.Err != nil || r.RequestID != "ok" {
		t.Fatalf("request to a healthy peer: %+v", r)
	}
}

// A side channel that accepts connections and never answers fails the
// request after the handshake timeouts; nothing hangs.
func TestMetadataSilent(t *testing.T) {
	tp := topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}
	c := startCluster(t, tp)
	port := silentPeer(t)
	start := time.Now()
	if err := load(t, c.decode[0], "silent", []int{1}, []int{1}, port, "P"); err != nil {
		t.Fatal(err)
	}
	r := waitResult(t, c, 30*time.Second)
	if r.Err == nil || !strings.Contains(r.Err.Error(), "handshake") {
		t.Fatalf("silent metadata server: %+v", r)
	}
	t.Logf("failed after %v: %v", time.Since(start), r.Err)
}

// Bad load requests get clear errors and nothing is lost; an abort ends the
// request as failed exactly once.
func TestBadInputAndAbort(t *testing.T) {
	tp := topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}
	c := startCluster(t, tp)
	d := c.decode[0]
	bad := []decode.LoadRequest{
		{RequestID: "", Params: decode.KVTransferParams{RemoteHost: "h", RemotePort: 1, RemoteEngineID: "P"}},
		{RequestID: "x"},
		{RequestID: "y", Params: decode.KVTransferParams{RemoteHost: "h", RemotePort: 70000, RemoteEngineID: "P"}},
	}
	for i, err := range d.Decode.Load(context.Background(), bad) {
		if !errors.Is(err, decode.ErrInvalid) {
			t.Errorf("bad load %d: %v", i, err)
		}
	}
	// Blocks outside the cache: accepted, then failed by the planner.
	if err := load(t, d, "oob", []int{1000}, []int{1}, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	if r := waitResult(t, c, 10*time.Second); r.Err == nil {
		t.Fatal("out-of-range block pulled")
	}
	// A remote_host libzmq cannot connect to (a space, a NUL): that request
	// fails naming the endpoint; the worker does not crash (it once did) and
	// the next request is served.
	for i, host := range []string{"a b\x00c", "bad host"} {
		id := fmt.Sprintf("badhost-%d", i)
		err := d.Decode.Load(context.Background(), []decode.LoadRequest{{RequestID: id, LocalBlockIDs: []int{2},
			Params: decode.KVTransferParams{RemoteBlockIDs: []int{2}, RemoteEngineID: "P", RemoteHost: host, RemotePort: c.kvPort}}})[0]
		if err != nil {
			continue // refused at admission: as good
		}
		if r := waitResult(t, c, 20*time.Second); r.RequestID != id || r.Err == nil || !strings.Contains(r.Err.Error(), "connect tcp://") {
			t.Fatalf("load from host %q: %+v", host, r)
		}
	}
	c.prefill[0].Prefill.Send([]prefill.SendRequest{{RequestID: "after-badhost", BlockIDs: []int{2}}})
	if err := load(t, d, "after-badhost", []int{2}, []int{2}, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	if r := waitResult(t, c, 10*time.Second); r.RequestID != "after-badhost" || r.Err != nil {
		t.Fatalf("request after bad hosts: %+v", r)
	}
	// A request held at a peer that never answers, aborted while waiting.
	port := silentPeer(t)
	if err := load(t, d, "stuck", []int{1}, []int{1}, port, "P"); err != nil {
		t.Fatal(err)
	}
	if err := load(t, d, "stuck", []int{1}, []int{1}, port, "P"); !errors.Is(err, decode.ErrDuplicate) {
		t.Fatalf("duplicate load: %v", err)
	}
	time.Sleep(50 * time.Millisecond)
	if n := d.Decode.Abort([]string{"stuck", "unknown"}); n != 1 {
		t.Fatalf("aborted %d, want 1", n)
	}
	r := waitResult(t, c, 5*time.Second)
	if r.RequestID != "stuck" || r.Err == nil || !strings.Contains(r.Err.Error(), "aborted") {
		t.Fatalf("aborted request: %+v", r)
	}
	select {
	case r := <-c.results:
		t.Fatalf("extra result %+v", r)
	case <-time.After(200 * time.Millisecond):
	}
	// The prefill side: DONE for unknown requests does not free anything.
	p := c.prefill[0]
	p.Prefill.Send([]prefill.SendRequest{{RequestID: "held", BlockIDs: []int{3}}})
	if err := p.Prefill.Done("nobody"); err != nil {
		t.Logf("unknown DONE: %v", err)
	}
	for _, id := range p.Prefill.Finished() {
		if id == "held" {
			t.Fatal("a DONE for another request freed held")
		}
	}
	errs := p.Prefill.Send([]prefill.SendRequest{{RequestID: ""}, {RequestID: "b", BlockIDs: []int{-1}}, {RequestID: "c", DelayStartTime: -1}})
	for i, err := range errs {
		if err == nil {
			t.Errorf("bad send %d accepted", i)
		}
	}
}

// Stage metrics are visible on the worker's registry.
func TestStageMetrics(t *testing.T) {
	tp := topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}
	kvPort := 0
	var p, d *Node
	reg := prometheus.NewRegistry()
	results := make(chan decode.Result, 4)
	for range 8 {
		kvPort = testkit.RandomPort()
		cfg := baseConfig(tp, "prefill", kvPort)
		var err error
		if p, err = Start(cfg, Deps{}); err != nil {
			continue
		}
		dc := baseConfig(tp, "decode", kvPort+1000)
		if d, err = Start(dc, Deps{Registerer: reg, OnFinish: func(r decode.Result) { results <- r }}); err != nil {
			p.Close(context.Background())
			continue
		}
		break
	}
	if d == nil {
		t.Fatal("could not start nodes")
	}
	defer p.Close(context.Background())
	defer d.Close(context.Background())
	p.Prefill.Send([]prefill.SendRequest{{RequestID: "m", BlockIDs: []int{1}}})
	d.Decode.Load(context.Background(), []decode.LoadRequest{{RequestID: "m", LocalBlockIDs: []int{1},
		Params: decode.KVTransferParams{RemoteBlockIDs: []int{1}, RemoteEngineID: "P", RemoteHost: "127.0.0.1", RemotePort: kvPort}}})
	if r := <-results; r.Err != nil {
		t.Fatal(r.Err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, mf := range mfs {
		have[mf.GetName()] = true
	}
	for _, name := range []string{"kvflow_stage_queue_depth", "kvflow_stage_queue_capacity", "kvflow_stage_blocked_seconds_total",
		"kvflow_stage_duration_seconds", "kvflow_stage_items_total", "kvflow_stage_busy_workers",
		"kvflow_handshake_cache_lookups_total", "kvflow_decode_requests_total", "kvflow_read_bytes_total"} {
		if !have[name] {
			t.Errorf("metric %s not registered", name)
		}
	}
	if n, _ := testutil.GatherAndCount(reg, "kvflow_stage_duration_seconds"); n != 5 {
		t.Errorf("stage duration series %d, want 5 stages", n)
	}
}

// With read grants on, the prefill engine serves only the blocks of held
// requests: after a request is aborted (and reported freed), a late read of
// its blocks is refused and the decode request fails — never done.
func TestReadGrantsFence(t *testing.T) {
	tp := topo{prefillTP: 1, decodeTP: 1, model: gqa(2), grants: true}
	c := startCluster(t, tp)
	p, d := c.prefill[0], c.decode[0]
	p.Prefill.Send([]prefill.SendRequest{{RequestID: "held", BlockIDs: []int{1, 2}}, {RequestID: "gone", BlockIDs: []int{3}}})
	if n := p.Prefill.Abort([]string{"gone"}); n != 1 {
		t.Fatalf("abort: %d", n)
	}
	p.Prefill.Finished() // the engine frees "gone": its grant is revoked
	if err := load(t, d, "held", []int{1, 2}, []int{1, 2}, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	if r := waitResult(t, c, 10*time.Second); r.Err != nil {
		t.Fatalf("held request: %v", r.Err)
	}
	if err := load(t, d, "gone", []int{3}, []int{3}, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	r := waitResult(t, c, 10*time.Second)
	if r.Err == nil || !strings.Contains(r.Err.Error(), "read") {
		t.Fatalf("read after abort: %+v", r)
	}
	// Blocks never handed over are not readable either.
	if err := load(t, d, "never", []int{5}, []int{5}, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	if r := waitResult(t, c, 10*time.Second); r.Err == nil {
		t.Fatal("read of blocks never granted succeeded")
	}
}

// With auth.mode curve, a decode worker holding the keys pulls; one without
// them cannot fetch metadata, and its request fails (never done).
func TestCurveAuth(t *testing.T) {
	dir := t.TempDir()
	keys := func(name string) (sec, pub string) {
		sec, pub = filepath.Join(dir, name+".key"), filepath.Join(dir, name+".pub")
		if _, err := sidechannel.WriteKeyPair(sec, pub); err != nil {
			t.Fatal(err)
		}
		return sec, pub
	}
	pSec, pPub := keys("prefill")
	dSec, dPub := keys("decode")
	tp := topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}
	var p, good, bad *Node
	results := make(chan decode.Result, 4)
	var kvPort int
	for range 8 {
		kvPort = testkit.RandomPort()
		pc := baseConfig(tp, "prefill", kvPort)
		pc.Auth = config.Auth{Mode: config.AuthCurve, SecretKeyFile: pSec, PublicKeyFile: pPub}
		var err error
		if p, err = Start(pc, Deps{}); err == nil {
			break
		}
	}
	if p == nil {
		t.Fatal("prefill did not start")
	}
	defer p.Close(context.Background())
	gc := baseConfig(tp, "decode", kvPort+1000)
	gc.Auth = config.Auth{Mode: config.AuthCurve, SecretKeyFile: dSec, PublicKeyFile: dPub, ServerPublicKeyFile: pPub}
	good, err := Start(gc, Deps{OnFinish: func(r decode.Result) { results <- r }})
	if err != nil {
		t.Fatal(err)
	}
	defer good.Close(context.Background())
	bad, err = Start(baseConfig(tp, "decode", kvPort+1001), Deps{OnFinish: func(r decode.Result) { results <- r }})
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close(context.Background())
	p.Prefill.Send([]prefill.SendRequest{{RequestID: "a", BlockIDs: []int{1}}, {RequestID: "b", BlockIDs: []int{2}}})
	load := func(n *Node, id string, b int) {
		n.Decode.Load(context.Background(), []decode.LoadRequest{{RequestID: id, LocalBlockIDs: []int{b},
			Params: decode.KVTransferParams{RemoteBlockIDs: []int{b}, RemoteEngineID: "P", RemoteHost: "127.0.0.1", RemotePort: kvPort}}})
	}
	load(good, "a", 1)
	load(bad, "b", 2)
	got := map[string]error{}
	for range 2 {
		select {
		case r := <-results:
			got[r.RequestID] = r.Err
		case <-time.After(20 * time.Second):
			t.Fatal("no result")
		}
	}
	if got["a"] != nil {
		t.Errorf("authorized decode failed: %v", got["a"])
	}
	if got["b"] == nil || !strings.Contains(got["b"].Error(), "handshake") {
		t.Errorf("decode without keys: %v", got["b"])
	}
}

// silentPeer listens on loopback, accepts connections and never answers:
// a side channel that hangs. It returns the port.
func silentPeer(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c) // held open, never answered
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}
