package plan

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// simTopo is a random topology with a byte-level model of every worker's
// cache, small enough to enumerate: each byte's logical identity (layer,
// part, request block index, token, KV head, byte) is computable from its
// address on either side.
type simTopo struct {
	topo      Topology
	bs, hb    int   // tokens per block; bytes per head (GQA)
	mlaW      []int // MLA: row bytes per part
	nblk      int   // blocks per tensor on every worker
	local     []int // decode-side block ids of the request
	remote    []int // prefill-side block ids
	heads     int
	cpl       int
	partWidth func(side Parallel, part int) int // row bytes
}

// logical is one byte of the model's KV for one request.
type logical struct{ layer, part, blk, tok, head, b int }

// headsOf is the KV heads a TP rank of an instance with tp ranks holds
// (vLLM: contiguous slices, or one replicated head when tp > H).
func headsOf(h, tp, rank int) []int {
	if tp <= h {
		n := h / tp
		out := make([]int, n)
		for i := range out {
			out[i] = rank*n + i
		}
		return out
	}
	return []int{rank / (tp / h)}
}

const regionShift = 40

func (s *simTopo) rowBytes(p Parallel, part int) int {
	if s.topo.Model.MLA {
		return s.mlaW[part]
	}
	return len(headsOf(s.heads, p.TP, 0)) * s.hb
}

// layout and caches of one worker (stage layers [lo, hi)), region id reg.
func (s *simTopo) caches(p Parallel, lo, hi, reg int) (CacheLayout, Caches) {
	var l CacheLayout
	l.CachesPerLayer, l.BlockSize = s.cpl, s.bs
	parts := 1
	if s.topo.Model.MLA {
		parts = 2
	}
	for q := 0; q < parts; q++ {
		l.BlockLen = append(l.BlockLen, uint64(s.bs*s.rowBytes(p, q)))
	}
	var c Caches
	c.NumBlocks = s.nblk
	addr := uint64(reg) << regionShift
	for k := 0; k < (hi-lo)*s.cpl; k++ {
		c.Base = append(c.Base, addr)
		addr += uint64(s.nblk) * l.blockLen(k)
	}
	return l, c
}

// decodeByte: the logical identity of byte off of decode-side tensor k,
// local block lb, for decode TP rank tp whose stage starts at layer lo.
// ok is false for bytes outside the request's blocks.
func (s *simTopo) identify(p Parallel, tpRank, lo int, l CacheLayout, c Caches, addr uint64, blocks []int) (logical, bool) {
	k := -1
	for i := len(c.Base) - 1; i >= 0; i-- {
		if addr >= c.Base[i] {
			k = i
			break
		}
	}
	if k < 0 {
		return logical{}, false
	}
	L := l.blockLen(k)
	rel := addr - c.Base[k]
	blk, off := int(rel/L), int(rel%L)
	if blk >= s.nblk {
		return logical{}, false
	}
	idx := -1
	for i, b := range blocks {
		if b == blk {
			idx = i
		}
	}
	if idx < 0 {
		return logical{}, false
	}
	part := k % s.cpl
	row := s.rowBytes(p, part)
	tok, r := off/row, off%row
	lg := logical{layer: lo + k/s.cpl, part: part, blk: idx, tok: tok, b: r}
	if !s.topo.Model.MLA {
		lg.head, lg.b = headsOf(s.heads, p.TP, tpRank)[r/s.hb], r%s.hb
	}
	return lg, true
}

func randSim(r *rand.Rand) *simTopo {
	s := &simTopo{bs: 1 + r.IntN(3), hb: 1 + r.IntN(2), nblk: 6}
	pows := []int{1, 2, 4, 8}
	s.topo.Prefill = Parallel{TP: pows[r.IntN(4)], PP: 1 + r.IntN(3), DP: 1}
	s.topo.Decode = Parallel{TP: pows[r.IntN(4)], PP: 1 + r.IntN(3), DP: 1}
	s.topo.Model.NumLayers = 3 + r.IntN(5)
	if r.IntN(4) == 0 {
		s.topo.Model.MLA, s.topo.Model.NumKVHeads = true, 1
		s.mlaW = []int{1 + r.IntN(4), 1 + r.IntN(3)}
	} else {
		s.topo.Model.NumKVHeads = pows[r.IntN(4)]
	}
	s.heads, s.cpl = s.topo.Model.NumKVHeads, 2
	if r.IntN(3) == 0 {
		s.topo.DecodePPLayerPartition = randPartition(r, s.topo.Model.NumLayers, s.topo.Decode.PP)
	}
	if r.IntN(3) == 0 {
		s.topo.PPLayerPartition = randPartition(r, s.topo.Model.NumLayers, s.topo.Prefill.PP)
	}
	perm := r.Perm(s.nblk)
	nr := 1 + r.IntN(s.nblk)
	s.remote = perm[:nr]
	s.local = r.Perm(s.nblk)[:1+r.IntN(nr)] // prefix hit when shorter
	return s
}

func randPartition(r *rand.Rand, layers, pp int) string {
	parts := make([]int, pp)
	for i := range parts {
		parts[i] = 1
	}
	for i := pp; i < layers; i++ {
		parts[r.IntN(pp)]++
	}
	out := ""
	for i, p := range parts {
		if i > 0 {
			out += ","
		}
		out += fmt.Sprint(p)
	}
	return out
}

// TestPlanCoversEveryByteOnce plans random topologies (both TP directions,
// decode and prefill PP, GQA with split and replicated heads, MLA) for every
// decode rank, expands every task's reads and follows each byte: every
// byte of the request's blocks in every decode rank's cache is written
// exactly once, from a prefill location holding the same logical byte
// (layer, part, block, token, head); over all decode ranks each logical
// byte is read once per decode rank holding it (MLA: once per decode
// rank); and each prefill rank's PrefillExpectedDones equals the tasks
// that target it.
func TestPlanCoversEveryByteOnce(t *testing.T) {
	r := rand.New(rand.NewPCG(24, 1))
	accepted, kvflow := 0, 0
	for iter := 0; iter < 3000 && accepted < 400; iter++ {
		s := randSim(r)
		if s.topo.Validate() != nil {
			continue
		}
		accepted++
		if s.topo.NeedsKvflowPeer() {
			kvflow++
		}
		if err := s.check(); err != nil {
			t.Fatalf("topology %+v (bs %d, hb %d, local %v, remote %v): %v", s.topo, s.bs, s.hb, s.local, s.remote, err)
		}
	}
	if accepted < 200 || kvflow < 100 {
		t.Fatalf("only %d valid topologies (%d kvflow-only)", accepted, kvflow)
	}
	t.Logf("%d topologies, %d kvflow-only", accepted, kvflow)
}

func (s *simTopo) check() error {
	topo := s.topo
	const reqID = "req-prop"
	const port = 20000
	req := Request{ID: reqID, LocalBlockIDs: s.local, RemoteBlockIDs: s.remote, RemotePort: port}
	nl := len(s.local)
	remTrim := s.remote[len(s.remote)-nl:]
	reads := map[logical]int{}
	tasksTo := map[int]int{}
	for dpp := 0; dpp < topo.Decode.PP; dpp++ {
		dlo, dhi, err := PPIndices(topo.Model.NumLayers, dpp, topo.Decode.PP, topo.DecodePPLayerPartition)
		if err != nil {
			return err
		}
		for dtp := 0; dtp < topo.Decode.TP; dtp++ {
			self := Rank{TP: dtp, PP: dpp}
			pl, err := PlanRequest(topo, self, req)
			if err != nil {
				return fmt.Errorf("decode tp %d pp %d: %w", dtp, dpp, err)
			}
			ll, lc := s.caches(topo.Decode, dlo, dhi, 1)
			written := map[uint64]int{}
			for _, tk := range pl.Tasks {
				tasksTo[tk.RemoteRank]++
				ptpRank, pst := tk.RemoteRank%topo.Prefill.TP, tk.RemoteRank/topo.Prefill.TP
				plo, phi, err := PPIndices(topo.Model.NumLayers, pst, topo.Prefill.PP, topo.PPLayerPartition)
				if err != nil {
					return err
				}
				_, rc := s.caches(topo.Prefill, plo, phi, 2+tk.RemoteRank)
				ops, err := Ops(ll, tk, lc, rc)
				if err != nil {
					return fmt.Errorf("decode tp %d pp %d task %+v: %w", dtp, dpp, tk, err)
				}
				for _, op := range ops {
					for i := uint64(0); i < op.Len; i++ {
						la := s.stitched(ll, lc, op.Local+i, pl.P)
						written[la]++
						want, ok := s.identify(topo.Decode, dtp, dlo, ll, lc, la, s.local)
						if !ok {
							return fmt.Errorf("decode tp %d pp %d: write outside the request's blocks at %#x", dtp, dpp, la)
						}
						_, rcl := s.caches(topo.Prefill, plo, phi, 2+tk.RemoteRank)
						pll, _ := s.caches(topo.Prefill, plo, phi, 2+tk.RemoteRank)
						got, ok := s.identify(topo.Prefill, ptpRank, plo, pll, rcl, op.Remote+i, remTrim)
						if !ok {
							return fmt.Errorf("decode tp %d pp %d: read outside the request's remote blocks at %#x", dtp, dpp, op.Remote+i)
						}
						if got != want {
							return fmt.Errorf("decode tp %d pp %d task to rank %d: local byte %+v gets %+v", dtp, dpp, tk.RemoteRank, want, got)
						}
						reads[got]++
					}
				}
			}
			// Every byte of the request's blocks in this rank's cache.
			for k := range lc.Base {
				L := ll.blockLen(k)
				for _, b := range s.local {
					for o := uint64(0); o < L; o++ {
						a := lc.Base[k] + uint64(b)*L + o
						if n := written[a]; n != 1 {
							lg, _ := s.identify(topo.Decode, dtp, dlo, ll, lc, a, s.local)
							return fmt.Errorf("decode tp %d pp %d: byte %+v written %d times", dtp, dpp, lg, n)
						}
					}
				}
			}
		}
	}
	// Each logical byte read once per decode replica holding it.
	replicas := 1
	if topo.Model.MLA {
		replicas = topo.Decode.TP
	} else if topo.Decode.TP > s.heads {
		replicas = topo.Decode.TP / s.heads
	}
	for lg, n := range reads {
		if n != replicas {
			return fmt.Errorf("logical byte %+v read %d times, want %d", lg, n, replicas)
		}
	}
	for pst := 0; pst < topo.Prefill.PP; pst++ {
		for ptp := 0; ptp < topo.Prefill.TP; ptp++ {
			me := ptp + pst*topo.Prefill.TP
			n, err := PrefillExpectedDones(topo, Rank{TP: ptp, PP: pst}, reqID, len(s.local))
			if err != nil {
				return err
			}
			if n != tasksTo[me] {
				return fmt.Errorf("prefill rank %d expects %d DONEs, %d tasks target it", me, n, tasksTo[me])
			}
		}
	}
	return nil
}

// stitched is where byte a of a P > 1 read ends up after the seed's
// stitch ([P][bs][row/P] -> [bs][P][row/P] within each block).
func (s *simTopo) stitched(l CacheLayout, c Caches, a uint64, p int) uint64 {
	if p == 1 {
		return a
	}
	k := 0
	for i := len(c.Base) - 1; i >= 0; i-- {
		if a >= c.Base[i] {
			k = i
			break
		}
	}
	L := l.blockLen(k)
	rel := a - c.Base[k]
	blk, off := rel/L, rel%L
	slice := L / uint64(p)
	q, within := off/slice, off%slice
	row := L / uint64(s.bs)
	sub := row / uint64(p)
	tok, cc := within/sub, within%sub
	return c.Base[k] + blk*L + tok*row + q*sub + cc
}

func TestHeadSourceFor(t *testing.T) {
	gqaT := func(h, ptp, dtp int) Topology {
		return Topology{Prefill: Parallel{TP: ptp, PP: 1, DP: 1}, Decode: Parallel{TP: dtp, PP: 1, DP: 1}, Model: Model{NumLayers: 4, NumKVHeads: h}}
	}
	cases := []struct {
		name string
		topo Topology
		want []HeadSource // per decode tp rank
	}{
		{"8 heads tp 1->2", gqaT(8, 1, 2), []HeadSource{{0, 0, 2}, {0, 1, 2}}},
		{"8 heads tp 2->4", gqaT(8, 2, 4), []HeadSource{{0, 0, 2}, {0, 1, 2}, {1, 0, 2}, {1, 1, 2}}},
		{"2 heads tp 2->8 (decode replicates)", gqaT(2, 2, 8), []HeadSource{{0, 0, 1}, {0, 0, 1}, {0, 0, 1}, {0, 0, 1}, {1, 0, 1}, {1, 0, 1}, {1, 0, 1}, {1, 0, 1}}},
		{"4 heads tp 2->8", gqaT(4, 2, 8), []HeadSource{{0, 0, 2}, {0, 0, 2}, {0, 1, 2}, {0, 1, 2}, {1, 0, 2}, {1, 0, 2}, {1, 1, 2}, {1, 1, 2}}},
		{"1 head tp 2->4 (both replicate)", gqaT(1, 2, 4), []HeadSource{{0, 0, 1}, {1, 0, 1}, {0, 0, 1}, {1, 0, 1}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if err := c.topo.Validate(); err != nil {
				t.Fatal(err)
			}
			if !c.topo.NeedsKvflowPeer() {
				t.Fatal("NeedsKvflowPeer false")
			}
			for d, want := range c.want {
				got, err := c.topo.HeadSourceFor("r", d)
				if err != nil || got != want {
					t.Errorf("decode rank %d: %+v, %v; want %+v", d, got, err, want)
				}
			}
		})
	}
	// MLA: one prefill rank per decode rank, rotated by the request hash.
	m := gqaT(1, 2, 4)
	m.Model.MLA = true
	for _, id := range []string{"a", "b", "c", "d"} {
		start := int(StringToInt64Hash(id) % 2)
		for d := range 4 {
			got, err := m.HeadSourceFor(id, d)
			if err != nil || got != (HeadSource{TP: (start + d) % 2, Split: 1}) {
				t.Errorf("mla %q rank %d: %+v, %v", id, d, got, err)
			}
		}
	}
	if _, err := gqaT(8, 4, 2).HeadSourceFor("r", 0); err == nil {
		t.Error("decode tp < prefill tp: no error")
	}
}
