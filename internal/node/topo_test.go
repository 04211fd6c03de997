package node

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/stages/plan"
)

// rankHeads is the KV heads a TP rank of an instance with tp ranks holds
// (vLLM: contiguous slices, or one replicated head when tp > heads).
func rankHeads(heads, tp, rank int) []int {
	if tp <= heads {
		n := heads / tp
		out := make([]int, n)
		for i := range out {
			out[i] = rank*n + i
		}
		return out
	}
	return []int{rank / (tp / heads)}
}

// logicalByte is the model's KV byte of one request: global layer, part,
// the block's index in the request, token, KV head (0 for MLA) and byte
// within the head's row slice. Every worker holding that byte holds the
// same value, whichever rank it is.
func logicalByte(tag uint64, layer, part, blk, tok, head, b int) byte {
	x := tag ^ uint64(layer)<<56 ^ uint64(part)<<52 ^ uint64(blk)<<40 ^ uint64(tok)<<28 ^ uint64(head)<<16 ^ uint64(b)
	x = (x ^ x>>31) * 0x9e3779b97f4a7c15
	return byte(x>>32) ^ byte(x>>7)
}

// headGeometry is a node's per-token row split into heads: the heads it
// holds and the bytes of one head, per part.
func headGeometry(n *Node) (heads []int, headBytes []int) {
	topo := n.Config.Topology()
	own := topo.Decode
	if n.Prefill != nil {
		own = topo.Prefill
	}
	rows := rowBytes(n)
	if topo.Model.MLA {
		return []int{0}, rows
	}
	heads = rankHeads(topo.Model.NumKVHeads, own.TP, n.Config.Rank.TP)
	for _, r := range rows {
		headBytes = append(headBytes, r/len(heads))
	}
	return heads, headBytes
}

// stageStart is the first global layer of a node's PP stage.
func stageStart(t *testing.T, n *Node) int {
	topo := n.Config.Topology()
	own, part := topo.Decode, topo.DecodePPLayerPartition
	if n.Prefill != nil {
		own, part = topo.Prefill, topo.PPLayerPartition
	}
	lo, _, err := plan.PPIndices(topo.Model.NumLayers, n.Config.Rank.PP, own.PP, part)
	if err != nil {
		t.Fatal(err)
	}
	return lo
}

// forEachByte calls f for every byte of blocks (request block index i,
// block id) of node n's cache with its logical identity.
func forEachByte(t *testing.T, n *Node, blocks []int, idx func(i int) int, f func(got []byte, k int, want byte)) {
	heads, hb := headGeometry(n)
	lo := stageStart(t, n)
	for l := range n.Shape.NumLayers {
		for part := range n.Device.Layout().NumParts() {
			for i, b := range blocks {
				blk := n.Device.Block(l, part, b)
				row := len(heads) * hb[part]
				for tok := 0; tok*row < len(blk); tok++ {
					for h, head := range heads {
						for k := range hb[part] {
							off := tok*row + h*hb[part] + k
							f(blk, off, logicalByte(0x24, lo+l, part, idx(i), tok, head, k))
						}
					}
				}
			}
		}
	}
}

// TestKvflowTopologiesHoldTheirHeads runs kvflow ↔ kvflow clusters over
// real sockets in the topologies the seed refuses and checks every decode
// rank's cache against the model, not the plan: the prefill workers'
// blocks hold each byte's logical identity (layer, part, block, token,
// KV head), the same on every rank that holds it, and each decode rank's
// blocks must hold exactly its own heads (all of the latent with MLA) of
// its own PP stage's layers. Every prefill rank frees each request once,
// after the DONEs of every decode rank that read it.
func TestKvflowTopologiesHoldTheirHeads(t *testing.T) {
	cases := []topo{
		{name: "tp1-to-2", prefillTP: 1, decodeTP: 2, model: gqa(3)},
		{name: "tp2-to-4", prefillTP: 2, decodeTP: 4, model: gqa(2), prefixHit: true},
		{name: "tp2-to-8-replicated", prefillTP: 2, decodeTP: 8, model: heads(gqa(2), 4)},
		{name: "tp4-to-8-both-replicated", prefillTP: 4, decodeTP: 8, model: heads(gqa(1), 2)},
		{name: "mla-tp1-to-2", prefillTP: 1, decodeTP: 2, model: mla()},
		{name: "mla-tp1-to-4", prefillTP: 1, decodeTP: 4, model: mla()},
		{name: "mla-tp2-to-4", prefillTP: 2, decodeTP: 4, model: mla()},
		{name: "decode-pp2-prefill-pp1", prefillTP: 1, decodeTP: 1, decodePP: 2, model: gqa(5)},
		{name: "decode-pp2-prefill-pp2", prefillTP: 2, decodeTP: 2, prefillPP: 2, decodePP: 2, model: decodePartition(gqa(5), "2,3")},
		{name: "decode-pp2-tp2-to-1", prefillTP: 2, decodeTP: 1, decodePP: 2, model: gqa(4)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := startCluster(t, tc)
			type reqInfo struct {
				id            string
				local, remote []int
			}
			reqs := []reqInfo{
				{id: tc.name + "-a", local: []int{3, 4, 9}, remote: []int{20, 7, 8}},
				{id: tc.name + "-b", local: []int{0}, remote: []int{1}},
				{id: tc.name + "-c", local: []int{11, 10}, remote: []int{30, 31}},
			}
			if tc.prefixHit {
				reqs[0].local = reqs[0].local[1:] // pull only the tail
			}
			for _, p := range c.prefill {
				for _, r := range reqs {
					forEachByte(t, p, r.remote, func(i int) int { return i }, func(b []byte, k int, v byte) { b[k] = v })
					if errs := p.Prefill.Send([]prefill.SendRequest{{RequestID: r.id, BlockIDs: r.remote}}); errs[0] != nil {
						t.Fatal(errs[0])
					}
				}
			}
			for _, d := range c.decode {
				l := d.Device.Layout()
				for layer := range l.Shape().NumLayers {
					for part := range l.NumParts() {
						clear(d.Device.Bytes(layer, part))
					}
				}
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
			deadline := time.After(30 * time.Second)
			for range len(reqs) * len(c.decode) {
				select {
				case res := <-c.results:
					if res.Err != nil {
						t.Errorf("request %s failed: %v", res.RequestID, res.Err)
					}
				case <-deadline:
					t.Fatal("requests did not finish")
				}
			}
			for _, d := range c.decode {
				for _, r := range reqs {
					skip := len(r.remote) - len(r.local)
					bad, first := 0, ""
					forEachByte(t, d, r.local, func(i int) int { return skip + i }, func(b []byte, k int, v byte) {
						if b[k] != v {
							if bad == 0 {
								first = fmt.Sprintf("byte %d is %#x, want %#x", k, b[k], v)
							}
							bad++
						}
					})
					if bad > 0 {
						t.Errorf("decode tp %d pp %d request %s: %d wrong bytes, first: %s", d.Config.Rank.TP, d.Config.Rank.PP, r.id, bad, first)
					}
				}
			}
			// Head slices went as kvflow's strided READ (the TCP engine's
			// gathered reads, the read stage's default): the prefill ranks
			// served fewer requests than the decode ranks read token rows
			// (one READ per row without it).
			if m := c.decode[0].Config.Model; !m.MLA && tc.decodeTP > tc.prefillTP && m.NumKVHeads/tc.prefillTP > max(1, m.NumKVHeads/tc.decodeTP) {
				rows, served := 0, 0.0
				for _, d := range c.decode {
					for _, r := range reqs {
						rows += d.Shape.NumLayers * d.Device.Layout().NumParts() * len(r.local) * d.Shape.BlockSize
					}
				}
				for _, p := range c.prefill {
					served += counter(t, c.regs[p], "kvflow_transfer_ops_total", map[string]string{"direction": "serve_read"})
				}
				if served == 0 || served >= float64(rows) {
					t.Errorf("prefill served %v read requests for %d head-slice rows: strided READ not used", served, rows)
				}
			}
			// Each prefill rank frees each request exactly once.
			freed := map[string]int{}
			until := time.Now().Add(10 * time.Second)
			for len(freed) < len(reqs)*len(c.prefill) && time.Now().Before(until) {
				for _, p := range c.prefill {
					for _, id := range p.Prefill.Finished() {
						freed[fmt.Sprintf("tp%d-pp%d/%s", p.Config.Rank.TP, p.Config.Rank.PP, id)]++
					}
				}
				time.Sleep(5 * time.Millisecond)
			}
			if len(freed) != len(reqs)*len(c.prefill) {
				t.Errorf("prefill freed %d of %d (rank, request) pairs", len(freed), len(reqs)*len(c.prefill))
			}
			for k, v := range freed {
				if v != 1 {
					t.Errorf("%s freed %d times", k, v)
				}
			}
			// The DONEs each prefill rank counted are the ones planned for it.
			for _, p := range c.prefill {
				want := 0
				for _, r := range reqs {
					n, err := plan.PrefillExpectedDones(p.Config.Topology(), p.Config.Self(), r.id, len(r.local))
					if err != nil {
						t.Fatal(err)
					}
					want += n
				}
				if got := counter(t, c.regs[p], "kvflow_prefill_done_messages_total", nil); got != float64(want) {
					t.Errorf("prefill tp %d pp %d: %v DONEs counted, %d planned", p.Config.Rank.TP, p.Config.Rank.PP, got, want)
				}
			}
		})
	}
}
