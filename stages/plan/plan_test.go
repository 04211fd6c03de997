package plan

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

func gqa() Topology {
	return Topology{
		Prefill: Parallel{TP: 8, PP: 1, DP: 1, KVPort: 30000},
		Decode:  Parallel{TP: 2, PP: 1, DP: 1, KVPort: 40000},
		Model:   Model{NumLayers: 64, NumKVHeads: 8},
	}
}

func mla() Topology {
	t := gqa()
	t.Model = Model{NumLayers: 64, NumKVHeads: 1, MLA: true}
	return t
}

func TestValidateReportsEveryProblem(t *testing.T) {
	cases := []struct {
		name  string
		mod   func(*Topology)
		wants []string // substrings, one per expected problem
	}{
		{"ok gqa", func(*Topology) {}, nil},
		{"ok mla", func(t *Topology) { *t = mla() }, nil},
		{"missing sizes", func(t *Topology) { t.Prefill.TP = 0; t.Decode.DP = 0; t.Model.NumLayers = 0 },
			[]string{"prefill.tp_size", "decode.dp_size", "model.num_hidden_layers"}},
		{"decode tp > prefill tp, not a multiple", func(t *Topology) { t.Prefill.TP = 4; t.Decode.TP = 6; t.Model.NumKVHeads = 12 }, []string{"decode.tp_size: 6 is not a multiple of prefill.tp_size 4"}},
		{"decode tp > prefill tp with cp", func(t *Topology) { t.Decode.TP = 16; t.Decode.PCP = 2 }, []string{"decode.tp_size: 16 > prefill.tp_size 8 with context parallelism"}},
		{"non-dividing tp", func(t *Topology) { t.Prefill.TP = 6; t.Decode.TP = 4 }, []string{"decode.tp_size: 4 does not divide"}},
		{"heads vs tp", func(t *Topology) { t.Model.NumKVHeads = 6 }, []string{"prefill.tp_size: 8 and model.num_key_value_heads 6"}},
		{"sparse without mla", func(t *Topology) { t.Model.Sparse = true }, []string{"sparse"}},
		{"decode pp partition", func(t *Topology) { t.Decode.PP = 2; t.DecodePPLayerPartition = "30,30" }, []string{"decode_pp_layer_partition: partitions in \"30,30\" sum to 60"}},
		{"decode pp empty stage", func(t *Topology) { t.Decode.PP = 2; t.DecodePPLayerPartition = "0,64" }, []string{"decode_pp_layer_partition: decode stage 0 has no layers"}},
		{"decode pp too many stages", func(t *Topology) { t.Decode.PP = 65 }, []string{"model.num_hidden_layers: 64 layers for decode.pp_size 65"}},
		{"decode pp with cp", func(t *Topology) { t.Decode.PP = 2; t.Prefill.DCP = 2 }, []string{"decode.pp_size: 2 with context parallelism"}},
		{"pp with pcp", func(t *Topology) { t.Prefill.PP = 2; t.Prefill.PCP = 2; t.Decode.PCP = 2 },
			[]string{"prefill: pp_size 2 with pcp_size 2", "prefill.pp_size: 2 with context parallelism"}},
		{"partition", func(t *Topology) { t.Prefill.PP = 2; t.PPLayerPartition = "30,30" }, []string{"sum to 60"}},
		{"partition count", func(t *Topology) { t.Prefill.PP = 2; t.PPLayerPartition = "64" }, []string{"1 partitions"}},
		{"partition syntax", func(t *Topology) { t.Prefill.PP = 2; t.PPLayerPartition = "32,x" }, []string{"invalid partition"}},
		{"layers < stages", func(t *Topology) { t.Model.NumLayers = 2; t.Prefill.PP = 4 }, []string{"2 layers for prefill.pp_size 4"}},
		{"split duplicate ports", func(t *Topology) {
			*t = mla()
			t.Prefill.TP, t.Decode.TP, t.Prefill.DCP = 2, 2, 4
		}, []string{"split ports would repeat", "prefill.dcp_size: 4 does not divide tp_size 2"}},
		{"split gqa tp", func(t *Topology) { t.Prefill.TP, t.Decode.TP, t.Prefill.DCP = 4, 2, 2 }, []string{"split context needs decode tp equal"}},
		{"split decode pcp", func(t *Topology) { t.Prefill.TP, t.Decode.TP, t.Decode.PCP = 4, 4, 2 }, []string{"decode.pcp_size: 2"}},
		{"port range", func(t *Topology) { t.Prefill.KVPort = 65530 }, []string{"prefill.kv_port"}},
		{"negative cp", func(t *Topology) { t.Decode.DCP = -1 }, []string{"decode.dcp_size"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tp := gqa()
			c.mod(&tp)
			err := tp.Validate()
			if len(c.wants) == 0 {
				if err != nil {
					t.Fatalf("unexpected: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("no error, want %q", c.wants)
			}
			for _, w := range c.wants {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
}

func TestPlanRequestBadInput(t *testing.T) {
	good := Request{ID: "r", LocalBlockIDs: []int{1, 2}, RemoteBlockIDs: []int{3, 4}, RemotePort: 30000}
	cases := []struct {
		name string
		self Rank
		mod  func(*Request)
		want string
	}{
		{"negative local", Rank{}, func(r *Request) { r.LocalBlockIDs = []int{1, -2} }, "request.local_block_ids[1]"},
		{"negative remote", Rank{}, func(r *Request) { r.RemoteBlockIDs = []int{-3, 4} }, "request.remote_block_ids[0]"},
		{"local > remote", Rank{}, func(r *Request) { r.RemoteBlockIDs = []int{3} }, "request.local_block_ids: 2 blocks"},
		{"empty remote", Rank{}, func(r *Request) { r.RemoteBlockIDs = nil }, "more than the 0 remote_block_ids"},
		{"port", Rank{}, func(r *Request) { r.RemotePort = 0 }, "request.remote_port"},
		{"remote pcp", Rank{}, func(r *Request) { r.RemotePCPSize = 2 }, "request.remote_pcp_size"},
		{"rank tp", Rank{TP: 2}, func(*Request) {}, "rank.tp_rank: 2 outside [0, 2)"},
		{"rank negative", Rank{PCP: -1}, func(*Request) {}, "rank.pcp_rank"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req := good
			c.mod(&req)
			_, err := PlanRequest(gqa(), c.self, req)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err %v, want %q", err, c.want)
			}
		})
	}
	if _, err := PlanRequest(gqa(), Rank{}, good); err != nil {
		t.Fatal(err)
	}
	bad := gqa()
	bad.Decode.TP = 3
	if _, err := PlanRequest(bad, Rank{}, good); err == nil || !strings.Contains(err.Error(), "decode.tp_size") {
		t.Fatalf("non-dividing TP: %v", err)
	}
	// Full prefix hit: a task per remote rank, no ops, DONE still sent.
	req := good
	req.LocalBlockIDs = nil
	pl, err := PlanRequest(gqa(), Rank{}, req)
	if err != nil || len(pl.Tasks) != 4 || !pl.Tasks[3].Last {
		t.Fatalf("prefix hit plan %+v, %v", pl, err)
	}
}

func TestAppendOpsBadInput(t *testing.T) {
	layout := CacheLayout{BlockLen: []uint64{4096}, CachesPerLayer: 2}
	local := Caches{Base: []uint64{0x1000000, 0x2000000}, NumBlocks: 8}
	remote := Caches{Base: []uint64{0x7000000, 0x8000000}, NumBlocks: 8}
	task := Task{P: 1, LayerStart: 0, LayerEnd: 1, LocalBlockIDs: []int{1}, RemoteBlockIDs: []int{2}}
	if ops, err := Ops(layout, task, local, remote); err != nil || len(ops) != 2 {
		t.Fatalf("good task: %v %v", ops, err)
	}
	cases := []struct {
		name string
		mod  func(*CacheLayout, *Task, *Caches, *Caches)
		want string
	}{
		{"local > remote", func(_ *CacheLayout, t *Task, _, _ *Caches) { t.RemoteBlockIDs = nil }, "1 local blocks"},
		{"local oob", func(_ *CacheLayout, t *Task, _, _ *Caches) { t.LocalBlockIDs = []int{8} }, "local block 8"},
		{"remote oob", func(_ *CacheLayout, t *Task, _, _ *Caches) { t.RemoteBlockIDs = []int{9} }, "remote block 9"},
		{"negative", func(_ *CacheLayout, t *Task, _, _ *Caches) { t.LocalBlockIDs = []int{-1} }, "negative block"},
		{"layers", func(_ *CacheLayout, t *Task, _, _ *Caches) { t.LayerEnd = 2 }, "need local tensors up to 4"},
		{"tensor mismatch", func(_ *CacheLayout, _ *Task, _, r *Caches) { r.Base = r.Base[:1] }, "remote has 1"},
		{"divisible", func(l *CacheLayout, t *Task, _, _ *Caches) { t.P = 3; l.BlockLen = []uint64{4096} }, "not divisible"},
		{"slot", func(_ *CacheLayout, t *Task, _, _ *Caches) { t.HeadSlot = 1 }, "task.head_slot"},
		{"layout", func(l *CacheLayout, _ *Task, _, _ *Caches) { l.BlockLen = nil }, "layout.block_len"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			l, tk, lc, rc := layout, task, local, remote
			l.BlockLen = append([]uint64(nil), layout.BlockLen...)
			c.mod(&l, &tk, &lc, &rc)
			_, err := Ops(l, tk, lc, rc)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err %v, want %q", err, c.want)
			}
		})
	}
}

// TestSplitExpectedDones is §5b.5: with remote_dcp/dcp = 2 two decode ranks
// read every prefill rank, so each prefill rank expects two DONEs.
func TestSplitExpectedDones(t *testing.T) {
	tp := Topology{
		Prefill: Parallel{TP: 4, PP: 1, DP: 1, DCP: 2},
		Decode:  Parallel{TP: 4, PP: 1, DP: 1},
		Model:   Model{NumLayers: 8, NumKVHeads: 8},
	}
	if err := tp.Validate(); err != nil {
		t.Fatal(err)
	}
	for r := 0; r < 4; r++ {
		n, err := PrefillExpectedDones(tp, Rank{TP: r}, "req-1", 16)
		if err != nil || n != 2 {
			t.Errorf("prefill rank %d expects %d DONEs (%v), want 2", r, n, err)
		}
	}
	// One block: only one split entry per decode rank gets it; the others
	// get no task and their prefill ranks must not wait for them.
	total := 0
	for r := 0; r < 4; r++ {
		n, err := PrefillExpectedDones(tp, Rank{TP: r}, "req-1", 1)
		if err != nil {
			t.Fatal(err)
		}
		total += n
	}
	if total != 4 { // 4 decode ranks, one non-empty entry each
		t.Errorf("1-block request: %d DONEs expected in total, want 4", total)
	}
	// A request with no block at all still notifies every entry (§5b.4).
	n, err := PrefillExpectedDones(tp, Rank{TP: 0}, "req-1", 0)
	if err != nil || n != 2 {
		t.Errorf("empty request: %d, %v; want 2", n, err)
	}
}

// randomTopology draws a topology Validate accepts (or reports it cannot).
func randomTopology(rng *rand.Rand) (Topology, bool) {
	pow := func(maxExp int) int { return 1 << rng.IntN(maxExp+1) }
	t := Topology{
		Prefill: Parallel{TP: pow(4), PP: pow(2), DP: 1 + rng.IntN(2)},
		Decode:  Parallel{TP: 1, PP: 1, DP: 1 + rng.IntN(2)},
		Model:   Model{NumLayers: 1 + rng.IntN(80), NumKVHeads: pow(6)},
	}
	t.Decode.TP = max(1, t.Prefill.TP>>rng.IntN(4))
	switch rng.IntN(4) {
	case 0:
		t.Model.MLA = true
		t.Model.NumKVHeads = 1
	case 1:
		t.Model.MLA, t.Model.Sparse = true, true
	}
	if rng.IntN(3) == 0 && t.Prefill.PP == 1 {
		t.Prefill.PCP = pow(1)
		t.Prefill.DCP = pow(2)
		if rng.IntN(2) == 0 {
			t.Decode.PCP, t.Decode.DCP = t.Prefill.PCP, t.Prefill.DCP
		} else {
			t.Decode.TP = t.Prefill.TP // split mode
			if rng.IntN(2) == 0 {
				t.Decode.DCP = t.Prefill.DCP
			}
		}
	}
	if t.Prefill.PP > 1 && rng.IntN(3) == 0 {
		parts := make([]string, t.Prefill.PP)
		left := t.Model.NumLayers
		for i := range parts {
			n := left
			if i < len(parts)-1 {
				n = rng.IntN(left + 1)
			}
			parts[i] = fmt.Sprint(n)
			left -= n
		}
		t.PPLayerPartition = strings.Join(parts, ",")
	}
	return t, t.Validate() == nil
}

func randomIDs(rng *rand.Rand, n, limit int) []int {
	ids := make([]int, n)
	b := rng.IntN(limit)
	for i := range ids {
		if rng.IntN(4) == 0 {
			b = rng.IntN(limit)
		}
		ids[i] = b % limit
		b++
	}
	return ids
}

// checkInvariants plans req on every decode rank and checks the package's
// invariants: ops inside both caches, bytes = blocks x block_len per layer,
// each prefill rank's DONE count equal to the tasks sent to it.
func checkInvariants(t *testing.T, tp Topology, reqID string, nl, extra int, rng *rand.Rand) {
	const numBlocks = 512
	local := randomIDs(rng, nl, numBlocks)
	remote := randomIDs(rng, nl+extra, numBlocks)
	req := Request{ID: reqID, LocalBlockIDs: local, RemoteBlockIDs: remote, RemotePort: 30000,
		RemotePCPSize: tp.Prefill.pcp(), RemoteDCPSize: tp.Prefill.dcp()}
	parts := 1
	if tp.Model.MLA {
		parts = 2
	}
	if tp.Model.Sparse {
		parts = 3
	}
	cpl := max(parts, 2)
	p := tp.NeedPulls()
	bl := make([]uint64, parts)
	for i := range bl {
		bl[i] = uint64(p) * 64 * uint64(1+rng.IntN(8))
	}
	layout := CacheLayout{BlockLen: bl, CachesPerLayer: cpl}
	lbase := make([]uint64, tp.Model.NumLayers*cpl)
	for i := range lbase {
		lbase[i] = uint64(i+1) << 32
	}
	dones := map[int]int{}
	for pcp := 0; pcp < tp.Decode.pcp(); pcp++ {
		for r := 0; r < tp.Decode.TP; r++ {
			pl, err := PlanRequest(tp, Rank{TP: r, PCP: pcp}, req)
			if err != nil {
				if tp.Mode() == ModeSplit && strings.Contains(err.Error(), "split entry") {
					return // remote list shorter than a split entry: a request error, reported
				}
				t.Fatalf("%+v rank %d/%d: %v", tp, r, pcp, err)
			}
			var sum uint64
			var wantSum uint64
			perLayerBytes := uint64(0)
			for k := 0; k < cpl; k++ {
				perLayerBytes += layout.blockLen(k) / uint64(p)
			}
			for _, task := range pl.Tasks {
				dones[task.RemoteRank]++
				n := task.LayerEnd - task.LayerStart
				rbase := make([]uint64, n*cpl)
				for i := range rbase {
					rbase[i] = uint64(task.RemoteRank+1)<<40 | uint64(i+1)<<32
				}
				ops, err := Ops(layout, task, Caches{Base: lbase, NumBlocks: numBlocks}, Caches{Base: rbase, NumBlocks: numBlocks})
				if err != nil {
					t.Fatalf("ops: %v", err)
				}
				for _, op := range ops {
					k := int(op.Local>>32) - 1 - task.LayerStart*cpl
					lb := layout.blockLen(k)
					lo := lbase[task.LayerStart*cpl+k]
					if op.Local < lo || op.Local+op.Len > lo+numBlocks*lb {
						t.Fatalf("local op %+v outside tensor %d", op, k)
					}
					ro := rbase[k]
					if op.Remote < ro || op.Remote+op.Len > ro+numBlocks*lb/uint64(p) {
						t.Fatalf("remote op %+v outside tensor %d", op, k)
					}
					sum += op.Len
				}
				if len(ops) != OpCount(task, layout) {
					t.Fatalf("OpCount %d != %d", OpCount(task, layout), len(ops))
				}
				wantSum += uint64(len(task.LocalBlockIDs)*n) * perLayerBytes
			}
			if sum != wantSum {
				t.Fatalf("%+v: %d bytes moved, want blocks x block_len/P per layer = %d", tp, sum, wantSum)
			}
		}
	}
	for pr, n := range dones {
		pcp, rest := pr/(tp.Prefill.TP), pr%tp.Prefill.TP
		self := Rank{TP: rest}
		if tp.Prefill.pcp() > 1 {
			self.PCP = pcp
		} else {
			self.PP = pcp
		}
		want, err := PrefillExpectedDones(tp, self, reqID, nl)
		if err != nil || want != n {
			t.Fatalf("%+v prefill rank %d: %d tasks, PrefillExpectedDones %d (%v)", tp, pr, n, want, err)
		}
		if tp.Mode() == ModeTP && n != 1 {
			t.Fatalf("%+v: prefill rank %d chosen by %d decode ranks", tp, pr, n)
		}
	}
}

func FuzzPlan(f *testing.F) {
	f.Add(uint64(1), "req-1", uint8(8), uint8(2))
	f.Add(uint64(2), "", uint8(0), uint8(0))
	f.Add(uint64(3), "héllo", uint8(33), uint8(5))
	f.Fuzz(func(t *testing.T, seed uint64, id string, nl, extra uint8) {
		rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
		tp, ok := randomTopology(rng)
		// Never panic, valid or not.
		_, _ = tp.RemoteRanksForReq(id)
		_, _ = PlanRequest(tp, Rank{TP: rng.IntN(9) - 1}, Request{ID: id, LocalBlockIDs: []int{int(nl) - 3}, RemoteBlockIDs: []int{1}, RemotePort: int(extra)})
		if !ok {
			return
		}
		checkInvariants(t, tp, id, int(nl)%64, int(extra)%8, rng)
	})
}

func TestRandomTopologies(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	valid := 0
	modes := map[string]int{}
	for i := 0; valid < 300 && i < 5000; i++ {
		tp, ok := randomTopology(rng)
		if !ok {
			continue
		}
		valid++
		modes[fmt.Sprintf("%v/P=%d/pp=%d", tp.Mode(), tp.NeedPulls(), tp.Prefill.PP)]++
		checkInvariants(t, tp, fmt.Sprintf("cmpl-%d", i), rng.IntN(40), rng.IntN(4), rng)
	}
	if valid < 100 {
		t.Fatalf("only %d valid random topologies", valid)
	}
	t.Logf("%d valid topologies: %v", valid, modes)
}

func TestErrorsJoin(t *testing.T) {
	tp := Topology{}
	err := tp.Validate()
	var j interface{ Unwrap() []error }
	if !errors.As(err, &j) || len(j.Unwrap()) < 3 {
		t.Fatalf("want several joined errors, got %v", err)
	}
}
