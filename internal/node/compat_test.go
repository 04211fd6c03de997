package node

import (
	"context"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/internal/sidechannel/wire"
)

// pair is one prefill and one decode worker (TP 1 each) on loopback, the
// prefill's configuration changed by mutate.
type pair struct {
	p, d    *Node
	dreg    *prometheus.Registry
	preg    *prometheus.Registry // the prefill's: what its transfer engine served
	results chan decode.Result
	kvPort  int
}

func startPair(t *testing.T, tp topo, mutate func(*config.Config)) *pair {
	t.Helper()
	for range 8 {
		kvPort := 10000 + rand.IntN(20000) // below the ephemeral range (32768+): :0 binds and outgoing connections take ports there
		pc := baseConfig(tp, "prefill", kvPort)
		if mutate != nil {
			mutate(&pc)
		}
		preg := prometheus.NewRegistry()
		p, err := Start(pc, Deps{Registerer: preg})
		if err != nil {
			t.Logf("prefill on kv_port %d: %v", kvPort, err)
			continue
		}
		pr := &pair{p: p, dreg: prometheus.NewRegistry(), preg: preg, results: make(chan decode.Result, 16), kvPort: kvPort}
		d, err := Start(baseConfig(tp, "decode", kvPort+1000), Deps{Registerer: pr.dreg, OnFinish: func(r decode.Result) { pr.results <- r }})
		if err != nil {
			p.Close(context.Background())
			t.Logf("decode on kv_port %d: %v", kvPort+1000, err)
			continue
		}
		pr.d = d
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			d.Close(ctx)
			p.Close(ctx)
		})
		return pr
	}
	t.Fatal("nodes did not start")
	return nil
}

func (pr *pair) result(t *testing.T, id string) decode.Result {
	t.Helper()
	select {
	case r := <-pr.results:
		if r.RequestID != id {
			t.Fatalf("result for %q, want %q", r.RequestID, id)
		}
		return r
	case <-time.After(20 * time.Second):
		t.Fatalf("no result for %q", id)
	}
	return decode.Result{}
}

// waitFreed polls the prefill until it reports id done sending (its DONE
// arrived and the blocks are free).
func waitFreed(t *testing.T, p *Node, id string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if slices.Contains(p.Prefill.Finished(), id) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("prefill never freed %q (no DONE)", id)
}

// TestCompatKvflowPeer: a kvflow prefill whose cache differs from the
// decode's in one way each fails the request before any read, with a
// reason naming the field and both values; the prefill still gets the
// DONE and frees the blocks; the mismatch is counted by field; the peer's
// metadata is not cached (the next request fetches it again and fails
// too). Without the check each of these requests ended done with bytes
// read from the wrong places.
func TestCompatKvflowPeer(t *testing.T) {
	cases := []struct {
		name   string
		tp     topo
		mutate func(*config.Model)
		field  string // first differing field (the counter's label)
		reason string // in the request's error
	}{
		{"block_size", topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}, func(m *config.Model) { m.BlockSize = 32 },
			"block_size", "peer P tp 0: block_size is 32, this decode expects 16; block_len of part 0 is 8192, this decode expects 4096"},
		{"kv_heads", topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}, func(m *config.Model) { m.NumKVHeads = 16 },
			"kv_heads", "kv_heads is 16, this decode expects 8"},
		{"head_dim", topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}, func(m *config.Model) { m.HeadDim = 8 },
			"head_dim", "head_dim is 8, this decode expects 16"},
		{"dtype", topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}, func(m *config.Model) { m.DType = "fp16" },
			"dtype", "dtype is fp16, this decode expects bf16"},
		{"layers", topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}, func(m *config.Model) { m.NumLayers = 3 },
			"layers", "layers is 3, this decode expects 2"},
		{"mla kv_lora_rank", topo{prefillTP: 1, decodeTP: 1, model: mla()}, func(m *config.Model) { m.KVLoraRank = 32 },
			"kv_lora_rank", "kv_lora_rank is 32, this decode expects 64"},
		{"mla rope", topo{prefillTP: 1, decodeTP: 1, model: mla()}, func(m *config.Model) { m.QKRopeHeadDim = 32 },
			"qk_rope_head_dim", "block_len of part 1 is 1024, this decode expects 512"},
		{"sparse indexer", topo{prefillTP: 1, decodeTP: 1, model: sparse()}, func(m *config.Model) { m.IndexerDim = 64 },
			"indexer_dim", "indexer_dim is 64, this decode expects 32"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pr := startPair(t, tc.tp, func(c *config.Config) { tc.mutate(&c.Model) })
			for i := range 2 {
				id := fmt.Sprintf("%s-%d", tc.name, i)
				if errs := pr.p.Prefill.Send([]prefill.SendRequest{{RequestID: id, BlockIDs: []int{3, 4}}}); errs[0] != nil {
					t.Fatal(errs[0])
				}
				if err := load(t, pr.d, id, []int{5, 6}, []int{3, 4}, pr.kvPort, "P"); err != nil {
					t.Fatal(err)
				}
				r := pr.result(t, id)
				if r.Err == nil {
					t.Fatalf("request ended done against a prefill with another %s", tc.field)
				}
				if !strings.Contains(r.Err.Error(), tc.reason) {
					t.Fatalf("reason %q, want it to contain %q", r.Err, tc.reason)
				}
				if r.Bytes != 0 {
					t.Errorf("%d bytes moved before the check", r.Bytes)
				}
				waitFreed(t, pr.p, id)
			}
			if n := counter(t, pr.dreg, "kvflow_handshake_peer_mismatches_total", map[string]string{"field": tc.field}); n != 2 {
				t.Errorf("mismatches{field=%q} = %v, want 2", tc.field, n)
			}
			if n := gauge(t, pr.dreg, "kvflow_handshake_cache_entries"); n != 0 {
				t.Errorf("%v peers cached, want 0 (a refused peer is not cached as good)", n)
			}
			if n := counter(t, pr.dreg, "kvflow_read_bytes_total", nil); n != 0 {
				t.Errorf("%v bytes read", n)
			}
			if n := counter(t, pr.preg, "kvflow_transfer_bytes_total", map[string]string{"direction": "serve_read"}); n != 0 {
				t.Errorf("prefill engine served %v bytes to a decode that refused it", n)
			}
		})
	}
}

// rawRouter is a seed-like side channel on a real ZMQ ROUTER: it answers
// GET_META with meta's bytes as they are and every DONE_RECVING with
// "ACK", recording the DONE's request ids.
type rawRouter struct {
	port int
	mu   sync.Mutex
	meta []byte
	done []string
}

func startRawRouter(t *testing.T, meta []byte) *rawRouter {
	t.Helper()
	zctx, err := zmq.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	sock, err := zctx.NewSocket(zmq.ROUTER)
	if err != nil {
		t.Fatal(err)
	}
	if err := sock.Bind("tcp://127.0.0.1:*"); err != nil {
		t.Fatal(err)
	}
	ep, err := sock.GetLastEndpoint()
	if err != nil {
		t.Fatal(err)
	}
	r := &rawRouter{meta: meta}
	if _, err := fmt.Sscanf(ep[strings.LastIndexByte(ep, ':')+1:], "%d", &r.port); err != nil {
		t.Fatalf("endpoint %q: %v", ep, err)
	}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() { // owns sock
		defer close(done)
		poller := zmq.NewPoller()
		poller.Add(sock, zmq.POLLIN)
		for {
			select {
			case <-stop:
				return
			default:
			}
			polled, err := poller.Poll(20 * time.Millisecond)
			if err != nil || len(polled) == 0 {
				continue
			}
			frames, err := sock.RecvMessageBytes(0)
			if err != nil || len(frames) != 3 {
				continue
			}
			req, err := wire.DecodeRequest(frames[2])
			if err != nil {
				t.Errorf("router: undecodable request %q: %v", frames[2], err)
				continue
			}
			var reply []byte
			r.mu.Lock()
			switch req.Kind {
			case wire.KindGetMeta:
				reply = r.meta
			case wire.KindDoneRecving:
				r.done = append(r.done, req.RequestID)
				reply = []byte(wire.AckReply)
			default:
				t.Errorf("router: a seed peer got %v", req.Kind)
			}
			r.mu.Unlock()
			if reply != nil {
				if _, err := sock.SendMessage(frames[0], "", reply); err != nil {
					t.Errorf("router: reply: %v", err)
				}
			}
		}
	}()
	t.Cleanup(func() {
		close(stop)
		<-done
		sock.SetLinger(0)
		sock.Close()
		zctx.Term()
	})
	return r
}

func (r *rawRouter) dones() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.done)
}

// seedMeta is p's metadata in the seed's bytes (no kvflow extension).
func seedMeta(p *Node, numBlocks int) []byte {
	return wire.EncodeMetadata(sidechannel.Metadata{EngineID: "P", TERPCPort: p.Engine.RPCPort(),
		KVCachesBaseAddr: p.Device.BaseAddrs(), NumBlocks: numBlocks})
}

// TestCompatSeedPeer: a peer whose side channel sends the seed's bytes only
// (no fingerprint), with a real transfer engine behind it, is checked
// against that engine's segment descriptor: registered buffers whose
// lengths are not num_blocks × block_len (a prefill with twice the block
// size) fail the request before any read, DONE still sent; a peer whose
// buffers match is read as before.
func TestCompatSeedPeer(t *testing.T) {
	tp := topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}
	cases := []struct {
		name      string
		mutate    func(*config.Config)
		numBlocks int // advertised; 0: the prefill's own
		reason    string
	}{
		{name: "block_size", mutate: func(c *config.Config) { c.Model.BlockSize = 32 },
			reason: "peer P tp 0: the registered buffer at kv_caches_base_addr[0] (part 0) is 393216 bytes, this decode expects 196608 (num_blocks 48 × block_len 4096)"},
		{name: "num_blocks", numBlocks: 96,
			reason: "the registered buffer at kv_caches_base_addr[0] (part 0) is 196608 bytes, this decode expects 393216 (num_blocks 96 × block_len 4096)"},
		{name: "layers", mutate: func(c *config.Config) { c.Model.NumLayers = 3 },
			reason: "the number of kv_caches_base_addr is 6, this decode expects 4 (2 layers × 2 parts)"},
		{name: "matching"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pr := startPair(t, tp, tc.mutate)
			nb := tc.numBlocks
			if nb == 0 {
				nb = pr.p.Shape.NumBlocks
			}
			r := startRawRouter(t, seedMeta(pr.p, nb))
			id := "seed-" + tc.name
			// The prefill's own side channel is not used: the router stands
			// in for it, the prefill's transfer engine serves the reads.
			if errs := pr.p.Prefill.Send([]prefill.SendRequest{{RequestID: id, BlockIDs: []int{3, 4}}}); errs[0] != nil {
				t.Fatal(errs[0])
			}
			if err := load(t, pr.d, id, []int{5, 6}, []int{3, 4}, r.port, "P"); err != nil {
				t.Fatal(err)
			}
			res := pr.result(t, id)
			if tc.reason == "" {
				if res.Err != nil || res.Bytes == 0 {
					t.Fatalf("matching seed peer: %v, %d bytes", res.Err, res.Bytes)
				}
				if n := counter(t, pr.preg, "kvflow_transfer_bytes_total", map[string]string{"direction": "serve_read"}); n == 0 {
					t.Errorf("prefill engine served no bytes to a matching seed-format decode")
				}
			} else {
				if res.Err == nil || !strings.Contains(res.Err.Error(), tc.reason) {
					t.Fatalf("result %v, want a failure containing %q", res.Err, tc.reason)
				}
				if res.Bytes != 0 {
					t.Errorf("%d bytes moved before the check", res.Bytes)
				}
				// Refused before any byte moves: the decode sent no read
				// request and the prefill's engine served none.
				if n := counter(t, pr.dreg, "kvflow_transfer_ops_total", map[string]string{"direction": "read"}); n != 0 {
					t.Errorf("decode engine issued %v read ops against a mismatched seed peer", n)
				}
				if n := counter(t, pr.preg, "kvflow_transfer_bytes_total", map[string]string{"direction": "serve_read"}); n != 0 {
					t.Errorf("prefill engine served %v bytes to a decode that refused it", n)
				}
			}
			deadline := time.Now().Add(10 * time.Second)
			for !slices.Contains(r.dones(), id) {
				if time.Now().After(deadline) {
					t.Fatalf("no DONE for %q at the seed peer (got %v)", id, r.dones())
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
}

// TestCompatBadFingerprint: a fingerprint of the wrong type or with an
// absurd value fails the request with a reason naming the field, DONE
// still sent; the decode worker keeps serving requests from other peers.
func TestCompatBadFingerprint(t *testing.T) {
	pr := startPair(t, topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}, nil)
	good := wire.EncodeMetadata(sidechannel.Metadata{EngineID: "P", TERPCPort: pr.p.Engine.RPCPort(),
		KVCachesBaseAddr: pr.p.Device.BaseAddrs(), NumBlocks: 48})
	head := append([]byte{0x85}, good[1:]...)
	for _, tc := range []struct {
		name, cache, field string
	}{
		// {"cache": {"block_size": "16"}}-like values, hand-written msgpack.
		{"block_size str", "81a5636163686581aa626c6f636b5f73697a65a23136", "kvflow.cache.block_size"},
		{"layers huge", "81a5636163686581a66c6179657273cf0000010000000000", "kvflow.cache.layers"},
		{"cache nil", "81a5636163686" + "5c0", "kvflow.cache"},
		// {"lease_ttl_ms": 1}: valid msgpack, but a lease no kvflow prefill
		// advertises (a renew busy loop on this decode).
		{"lease 1 ms", "81ac" + hex.EncodeToString([]byte("lease_ttl_ms")) + "01", "kvflow.lease_ttl_ms is 1, below the 50"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			meta := append(append(append([]byte(nil), head...), 0xa6), "kvflow"...)
			meta = append(meta, unhexT(t, tc.cache)...)
			r := startRawRouter(t, meta)
			id := "bad-" + tc.name
			if err := load(t, pr.d, id, []int{5}, []int{3}, r.port, "P"); err != nil {
				t.Fatal(err)
			}
			res := pr.result(t, id)
			if res.Err == nil || !strings.Contains(res.Err.Error(), tc.field) {
				t.Fatalf("result %v, want a failure naming %s", res.Err, tc.field)
			}
			deadline := time.Now().Add(10 * time.Second)
			for !slices.Contains(r.dones(), id) {
				if time.Now().After(deadline) {
					t.Fatalf("no DONE for %q", id)
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
	// The real prefill is still served.
	if errs := pr.p.Prefill.Send([]prefill.SendRequest{{RequestID: "ok", BlockIDs: []int{3}}}); errs[0] != nil {
		t.Fatal(errs[0])
	}
	if err := load(t, pr.d, "ok", []int{5}, []int{3}, pr.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	if res := pr.result(t, "ok"); res.Err != nil || res.Bytes == 0 {
		t.Fatalf("good peer after bad ones: %v, %d bytes", res.Err, res.Bytes)
	}
}

func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no gauge %s", name)
	return 0
}

func unhexT(t *testing.T, s string) []byte {
	t.Helper()
	var b []byte
	if _, err := fmt.Sscanf(s, "%x", &b); err != nil {
		t.Fatalf("hex %q: %v", s, err)
	}
	return b
}
