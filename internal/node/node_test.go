package node

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/tooling/testkit"
	"github.com/kvflow/kvflow/internal/tooling/verify"
	"github.com/kvflow/kvflow/stages/plan"
)

type topo struct {
	name                 string
	prefillTP, decodeTP  int
	prefillPP            int
	decodePP             int // kvflow only: decode pipeline stages
	model                config.Model
	prefixHit, emptyReqs bool
	grants               bool
	plainDone            bool // prefill: tracker.batch_done off
	unfused              bool // decode: read.fused_stitch off (the stitch kernel transposes)
	// shm: node.te_backend shm everywhere, caches in files (issue 21);
	// shmMismatch: every prefill cache path then names another file
	// (same header and size, other inode) before any request, so every
	// decode must fall back to TCP.
	shm, shmMismatch bool
	// prefillTE and decodeTE are each instance's node.te_backend ("":
	// tcp); Mooncake's engines run its tcp transport (loopback tests).
	prefillTE, decodeTE string
	// mutate, when set, changes each worker's config last.
	mutate func(role string, c *config.Config)
}

func gqa(layers int) config.Model {
	return config.Model{NumLayers: layers, NumKVHeads: 8, HeadDim: 16, BlockSize: 16, DType: "bf16", NumBlocks: 48}
}

// heads is m with n KV heads.
func heads(m config.Model, n int) config.Model {
	m.NumKVHeads = n
	return m
}

// decodePartition is m with the decode instance's layer partition.
func decodePartition(m config.Model, part string) config.Model {
	m.DecodePPLayerPartition = part
	return m
}

func mla() config.Model {
	return config.Model{NumLayers: 3, NumKVHeads: 1, BlockSize: 16, DType: "bf16", NumBlocks: 48, MLA: true, KVLoraRank: 64, QKRopeHeadDim: 16}
}

func sparse() config.Model {
	m := mla()
	m.Sparse, m.IndexerDim = true, 32
	return m
}

// cluster is one prefill instance and one decode instance on loopback.
type cluster struct {
	t       *testing.T
	prefill []*Node // by DeviceIndex
	decode  []*Node // by tp rank
	regs    map[*Node]*prometheus.Registry
	results chan decode.Result
	kvPort  int
}

func baseConfig(tp topo, role string, kvPort int) config.Config {
	c := config.Default()
	kv := &c.KVTransfer
	kv.KVConnectorExtraConfig.Prefill = config.Parallel{TPSize: tp.prefillTP, DPSize: 1, PPSize: max(1, tp.prefillPP)}
	kv.KVConnectorExtraConfig.Decode = config.Parallel{TPSize: tp.decodeTP, DPSize: 1, PPSize: max(1, tp.decodePP)}
	kv.KVPort = config.Port(kvPort)
	if role == "prefill" {
		kv.KVRole, kv.EngineID = config.KVProducer, "P"
	} else {
		kv.KVRole, kv.EngineID = config.KVConsumer, "D"
	}
	c.Model = tp.model
	c.Node.MetricsAddr = ""
	c.Cache.NoHugePages = true
	c.Handshake.Timeout = config.Duration(500 * time.Millisecond)
	c.Notify.Timeout = config.Duration(500 * time.Millisecond)
	if tp.grants {
		c.Read.Grants = config.GrantsOn
	}
	c.Read.FusedStitch = !tp.unfused
	if te := map[string]string{"prefill": tp.prefillTE, "decode": tp.decodeTE}[role]; te != "" {
		c.Node.TEBackend = te
		c.Node.Mooncake.Protocol = "tcp"
		if te == config.BackendMooncake && role == "prefill" {
			c.Read.Grants = config.GrantsOff // Mooncake has none (on is refused)
		}
	}
	if tp.mutate != nil {
		tp.mutate(role, &c)
	}
	return c
}

func startCluster(t *testing.T, tp topo, mutate ...func(role string, c *config.Config)) *cluster {
	t.Helper()
	var lastErr error
	for attempt := range 8 {
		kvPort := testkit.RandomPort()
		c, err := tryCluster(t, tp, kvPort, mutate...)
		if err == nil {
			return c
		}
		lastErr = err
		t.Logf("attempt %d on kv_port %d: %v", attempt, kvPort, err)
	}
	t.Fatalf("start cluster: %v", lastErr)
	return nil
}

func tryCluster(t *testing.T, tp topo, kvPort int, mutate ...func(role string, c *config.Config)) (*cluster, error) {
	c := &cluster{t: t, kvPort: kvPort, results: make(chan decode.Result, 1024), regs: map[*Node]*prometheus.Registry{}}
	closeAll := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, n := range append(c.decode, c.prefill...) {
			n.Close(ctx)
		}
	}
	pp := max(1, tp.prefillPP)
	for p := range pp {
		for r := range tp.prefillTP {
			cfg := baseConfig(tp, "prefill", kvPort)
			cfg.Rank = config.Rank{TP: r, PP: p}
			cfg.Tracker.BatchDone = !tp.plainDone
			for _, m := range mutate {
				m("prefill", &cfg)
			}
			shmConfig(t, tp, &cfg)
			reg := prometheus.NewRegistry()
			n, err := Start(cfg, Deps{Registerer: reg})
			if err != nil {
				closeAll()
				return nil, err
			}
			c.prefill = append(c.prefill, n)
			c.regs[n] = reg
		}
	}
	for p := range max(1, tp.decodePP) {
		for r := range tp.decodeTP {
			cfg := baseConfig(tp, "decode", kvPort+1000)
			cfg.Rank = config.Rank{TP: r, PP: p}
			for _, m := range mutate {
				m("decode", &cfg)
			}
			shmConfig(t, tp, &cfg)
			reg := prometheus.NewRegistry()
			n, err := Start(cfg, Deps{Registerer: reg, OnFinish: func(res decode.Result) { c.results <- res }})
			if err != nil {
				closeAll()
				return nil, err
			}
			c.decode = append(c.decode, n)
			c.regs[n] = reg
		}
	}
	t.Cleanup(closeAll)
	return c, nil
}

// counter sums the counter series of name whose labels include labels.
func counter(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue next
				}
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

func rowBytes(n *Node) []int {
	l := n.Device.Layout()
	out := make([]int, l.NumParts())
	for p := range out {
		out[p] = l.BlockLen(p) / n.Shape.BlockSize
	}
	return out
}

func TestEndToEnd(t *testing.T) {
	cases := []topo{
		{name: "tp1-to-1", prefillTP: 1, decodeTP: 1, model: gqa(4)},
		{name: "tp4-to-2-stitch", prefillTP: 4, decodeTP: 2, model: gqa(4)},
		{name: "tp8-to-1-stitch", prefillTP: 8, decodeTP: 1, model: gqa(2)},
		{name: "tp4-to-2-unfused", prefillTP: 4, decodeTP: 2, model: gqa(4), unfused: true},
		{name: "pp2-prefill", prefillTP: 2, decodeTP: 2, prefillPP: 2, model: gqa(5)},
		{name: "mla-tp2-to-1", prefillTP: 2, decodeTP: 1, model: mla()},
		{name: "sparse-tp2-to-2", prefillTP: 2, decodeTP: 2, model: sparse()},
		{name: "prefix-hit", prefillTP: 2, decodeTP: 1, model: gqa(3), prefixHit: true},
		{name: "tp4-to-2-plain-done", prefillTP: 4, decodeTP: 2, model: gqa(4), plainDone: true},
		// kvflow-only topologies (issue 24): head slices, replicated heads,
		// the latent spread by request, decode PP stages.
		{name: "kvflow-tp1-to-2", prefillTP: 1, decodeTP: 2, model: gqa(3)},
		{name: "kvflow-tp2-to-4", prefillTP: 2, decodeTP: 4, model: gqa(3), prefixHit: true},
		{name: "kvflow-tp2-to-8-replicated", prefillTP: 2, decodeTP: 8, model: heads(gqa(2), 4)},
		{name: "kvflow-mla-tp1-to-4", prefillTP: 1, decodeTP: 4, model: mla()},
		{name: "kvflow-mla-tp2-to-4", prefillTP: 2, decodeTP: 4, model: mla()},
		{name: "kvflow-decode-pp2-prefill-pp1", prefillTP: 1, decodeTP: 1, decodePP: 2, model: gqa(5)},
		{name: "kvflow-decode-pp2-prefill-pp2", prefillTP: 2, decodeTP: 1, prefillPP: 2, decodePP: 2, model: decodePartition(gqa(5), "2,3")},
		{name: "kvflow-decode-pp2-tp1-to-2", prefillTP: 1, decodeTP: 2, decodePP: 2, model: gqa(4)},
		// node.te_backend shm (issue 21): same-host reads from the mapped
		// prefill cache files, fused transpose, unfused, head slices
		// (gather), MLA, strict grants; and a claim that does not hold.
		{name: "shm-tp1-to-1", prefillTP: 1, decodeTP: 1, model: gqa(4), shm: true},
		{name: "shm-tp4-to-2-stitch", prefillTP: 4, decodeTP: 2, model: gqa(4), shm: true, grants: true},
		{name: "shm-tp4-to-2-unfused", prefillTP: 4, decodeTP: 2, model: gqa(4), unfused: true, shm: true},
		{name: "shm-kvflow-tp1-to-2", prefillTP: 1, decodeTP: 2, model: gqa(3), shm: true, prefixHit: true},
		{name: "shm-mla-tp2-to-1", prefillTP: 2, decodeTP: 1, model: mla(), shm: true},
		{name: "shm-mismatch-falls-back", prefillTP: 2, decodeTP: 1, model: gqa(3), shm: true, shmMismatch: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { runEndToEnd(t, tc) })
	}
}

// runEndToEnd starts a cluster of topology tc, runs moveAndCheck on it
// and returns it (still running: the test's cleanup closes it).
func runEndToEnd(t *testing.T, tc topo) *cluster {
	t.Helper()
	c := startCluster(t, tc)
	moveAndCheck(t, c, tc)
	return c
}

// moveAndCheck moves six requests (one with empty block lists) from the
// prefill instance to the decode instance of c (topology tc) and checks
// every byte, the stitch path taken, each prefill request freed exactly
// once and the DONEs counted on both sides.
func moveAndCheck(t *testing.T, c *cluster, tc topo) {
	t.Helper()
	if tc.shmMismatch {
		replaceCacheFiles(t, c)
	}
	const nreq = 6
	rng := rand.New(rand.NewPCG(uint64(len(tc.name)), 7))
	type reqInfo struct {
		id            string
		local, remote []int
	}
	var reqs []reqInfo
	perm := rng.Perm(48)
	lperm := rng.Perm(48)
	for i := range nreq {
		nb := 1 + rng.IntN(5)
		ri := reqInfo{id: fmt.Sprintf("%s-req-%d", tc.name, i), remote: perm[i*6 : i*6+nb], local: lperm[i*6 : i*6+nb]}
		if tc.prefixHit && nb > 1 {
			ri.local = ri.local[:nb-1] // local prefix hit: pull only the tail
		}
		if i == nreq-1 {
			ri.local, ri.remote = []int{}, []int{} // empty block lists
		}
		reqs = append(reqs, ri)
	}
	tag := func(id string) uint64 { return plan.StringToInt64Hash(id) }
	// Prefill: fill the blocks, hand the requests over.
	for _, p := range c.prefill {
		for _, r := range reqs {
			verify.FillBlocks(p.Device, p.Shape.NumLayers, p.Device.Layout().NumParts(), plan.DeviceIndex(p.Config.Topology().Prefill, p.Config.Self()), r.remote, tag(r.id))
			errs := p.Prefill.Send([]prefill.SendRequest{{RequestID: r.id, BlockIDs: r.remote}})
			if errs[0] != nil {
				t.Fatal(errs[0])
			}
		}
	}
	// Decode: every rank loads every request, as vLLM broadcasts.
	for _, d := range c.decode {
		for _, r := range reqs {
			errs := d.Decode.Load(context.Background(), []decode.LoadRequest{{
				RequestID: r.id, LocalBlockIDs: r.local,
				Params: decode.KVTransferParams{RemoteBlockIDs: r.remote, RemoteEngineID: "P",
					RemoteHost: "127.0.0.1", RemotePort: c.kvPort, RemotePCPSize: 1, RemoteDCPSize: 1},
			}})
			if errs[0] != nil {
				t.Fatal(errs[0])
			}
		}
	}
	want := nreq * len(c.decode)
	deadline := time.After(30 * time.Second)
	for range want {
		select {
		case res := <-c.results:
			if res.Err != nil {
				t.Errorf("request %s failed: %v", res.RequestID, res.Err)
			}
		case <-deadline:
			t.Fatal("requests did not finish")
		}
	}
	// Every byte against the prefill caches.
	var dones []string
	for _, d := range c.decode {
		done, failed := d.Decode.Finished()
		if len(failed) != 0 || len(done) != nreq {
			t.Errorf("decode rank %d: %d done, failures %v", d.Config.Rank.TP, len(done), failed)
		}
		dones = append(dones, done...)
		for _, r := range reqs {
			pl, err := plan.PlanRequest(d.Config.Topology(), d.Config.Self(), plan.Request{ID: r.id, LocalBlockIDs: r.local,
				RemoteBlockIDs: r.remote, RemoteHost: "127.0.0.1", RemotePort: c.kvPort, RemoteEngineID: "P", RemotePCPSize: 1, RemoteDCPSize: 1})
			if err != nil {
				t.Fatal(err)
			}
			bad, err := verify.Check(d.Device, pl, rowBytes(c.prefill[0]), tag(r.id))
			if bad != 0 {
				t.Errorf("decode rank %d request %s: %d bad bytes: %v", d.Config.Rank.TP, r.id, bad, err)
			}
		}
	}
	// P > 1: the transpose ran fused into the reads, or (unfused)
	// in the stitch stage.
	if p := c.decode[0].Config.Topology().NeedPulls(); p > 1 {
		unfused := tc.unfused || tc.decodeTE == config.BackendMooncake // Mooncake: no strided reads
		for _, d := range c.decode {
			fused := counter(t, c.regs[d], "kvflow_read_fused_stitch_jobs_total", nil)
			if want := float64(nreq); unfused && fused != 0 || !unfused && fused != want {
				t.Errorf("decode rank %d: %v jobs read fused, want %v (unfused %v)", d.Config.Rank.TP, fused, want, unfused)
			}
		}
	}
	if tc.shm {
		checkSameHostPath(t, c, tc.shmMismatch)
	}
	// Every prefill request is freed exactly once, on every rank.
	freed := map[string]int{}
	deadline2 := time.Now().Add(10 * time.Second)
	for {
		for _, p := range c.prefill {
			for _, id := range p.Prefill.Finished() {
				freed[fmt.Sprintf("%d/%s", plan.DeviceIndex(p.Config.Topology().Prefill, p.Config.Self()), id)]++
			}
		}
		if len(freed) == nreq*len(c.prefill) || time.Now().After(deadline2) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if len(freed) != nreq*len(c.prefill) {
		t.Errorf("prefill freed %d of %d (rank, request) pairs", len(freed), nreq*len(c.prefill))
	}
	for k, v := range freed {
		if v != 1 {
			t.Errorf("%s freed %d times", k, v)
		}
	}
	// kvflow to kvflow: every DONE went batched (done_batch_msg),
	// none plain, unless the prefill side turned batching off
	// (tracker.batch_done: false), and each prefill rank counted
	// exactly the DONEs the decode side sent it.
	var sent, got, plainSent, plainGot, msgs float64
	for _, d := range c.decode {
		sent += counter(t, c.regs[d], "kvflow_notify_batched_dones_total", nil)
		plainSent += counter(t, c.regs[d], "kvflow_sidechannel_requests_total", map[string]string{"role": "client", "op": "done"})
	}
	for _, p := range c.prefill {
		got += counter(t, c.regs[p], "kvflow_prefill_done_messages_total", nil)
		plainGot += counter(t, c.regs[p], "kvflow_sidechannel_requests_total", map[string]string{"role": "server", "op": "done"})
		msgs += counter(t, c.regs[p], "kvflow_sidechannel_requests_total", map[string]string{"role": "server", "op": "done_batch", "outcome": "ok"})
	}
	if tc.plainDone {
		if sent != 0 || msgs != 0 || plainSent == 0 || plainGot != plainSent || got != plainSent {
			t.Errorf("batching off: %v batched DONEs in %v messages, %v plain sent, %v plain received, %v counted", sent, msgs, plainSent, plainGot, got)
		}
	} else if plainSent != 0 || plainGot != 0 || sent == 0 || got != sent || msgs == 0 || msgs > sent {
		t.Errorf("batched DONEs: decode sent %v (and %v plain), prefill counted %v (%v plain), in %v messages", sent, plainSent, got, plainGot, msgs)
	}
}

// TestEnginesServeOnlyWhatTheyMust: over real sockets, a decode worker's
// transfer engine refuses every read and write of its cache, and a prefill
// worker's refuses writes (reads it serves, as Mooncake peers expect).
func TestEnginesServeOnlyWhatTheyMust(t *testing.T) {
	c := startCluster(t, topo{name: "serve", prefillTP: 1, decodeTP: 1, model: gqa(2)})
	cfg := mooncake.DefaultTCPConfig()
	cfg.IOTimeout = 2 * time.Second
	cli, err := mooncake.NewTCPEngine(cfg, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	buf := make([]byte, 4096)
	if err := cli.Register(mooncake.AddrOf(buf), uint64(len(buf)), ""); err != nil {
		t.Fatal(err)
	}
	remote := func(n *Node) uint64 { return n.Device.Regions()[0].Addr }
	cases := []struct {
		name   string
		n      *Node
		write  bool
		refuse bool
	}{
		{"decode read", c.decode[0], false, true},
		{"decode write", c.decode[0], true, true},
		// read.grants auto (the default): no request is held, so nothing
		// is readable; the blocks of a held request are (TestEndToEnd).
		{"prefill read", c.prefill[0], false, true},
		{"prefill write", c.prefill[0], true, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ops := []mooncake.Op{{Local: mooncake.AddrOf(buf), Remote: remote(tc.n), Length: uint64(len(buf))}}
			var err error
			if tc.write {
				err = cli.BatchWrite(context.Background(), tc.n.Engine.SessionID(), ops)
			} else {
				err = cli.BatchRead(context.Background(), tc.n.Engine.SessionID(), ops)
			}
			if got := errors.Is(err, mooncake.ErrRejected); got != tc.refuse {
				t.Fatalf("err = %v; refused %v, want %v", err, got, tc.refuse)
			}
		})
	}
}
