package plan

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// randBlocks returns n distinct-ish block ids made of random runs (lengths
// 1..maxRun) separated by random gaps, starting near start; with shuffle a
// few ids are swapped so runs also break on descending steps.
func randBlocks(r *rand.Rand, n, start, maxRun int) []int {
	ids := make([]int, 0, n)
	b := start
	for len(ids) < n {
		run := 1 + r.IntN(maxRun)
		for j := 0; j < run && len(ids) < n; j++ {
			ids = append(ids, b)
			b++
		}
		b += r.IntN(4) // 0 keeps the run going across the boundary
	}
	if r.IntN(4) == 0 && n > 1 {
		for range 1 + r.IntN(3) {
			i, j := r.IntN(n), r.IntN(n)
			ids[i], ids[j] = ids[j], ids[i]
		}
	}
	return ids
}

func randBases(r *rand.Rand, n int, nearWrap bool) []uint64 {
	b := make([]uint64, n)
	for i := range b {
		switch {
		case nearWrap && r.IntN(3) == 0:
			b[i] = ^uint64(0) - uint64(r.IntN(1<<20)) // addresses wrap: must match the reference exactly
		case r.IntN(2) == 0:
			b[i] = uint64(i+1)<<32 | uint64(r.IntN(1<<16))<<8
		default:
			b[i] = r.Uint64()
		}
	}
	return b
}

// compareOps runs AppendOps and appendOpsRef on the same input, each after
// a copy of the same dst prefix (with or without spare capacity), and fails
// on any difference in the ops, the error or OpCount.
func compareOps(t *testing.T, r *rand.Rand, layout CacheLayout, task Task, local, remote Caches) int {
	t.Helper()
	prefix := make([]Op, r.IntN(3))
	for i := range prefix {
		prefix[i] = Op{Local: r.Uint64(), Remote: r.Uint64(), Len: r.Uint64()}
	}
	spare := 0
	if r.IntN(2) == 0 {
		spare = OpCount(task, layout) + r.IntN(2)
	}
	mk := func() []Op {
		d := make([]Op, len(prefix), len(prefix)+spare)
		copy(d, prefix)
		return d
	}
	got, gerr := AppendOps(mk(), layout, task, local, remote)
	want, werr := appendOpsRef(mk(), layout, task, local, remote)
	if fmt.Sprint(gerr) != fmt.Sprint(werr) {
		t.Fatalf("error %v, reference %v\nlayout %+v task %+v", gerr, werr, layout, task)
	}
	if !slices.Equal(got, want) {
		for i := range min(len(got), len(want)) {
			if got[i] != want[i] {
				t.Fatalf("op %d = %+v, reference %+v (%d vs %d ops)\nlayout %+v task %+v", i, got[i], want[i], len(got), len(want), layout, task)
			}
		}
		t.Fatalf("%d ops, reference %d\nlayout %+v task %+v", len(got), len(want), layout, task)
	}
	if gerr == nil && OpCount(task, layout) != len(got)-len(prefix) {
		t.Fatalf("OpCount %d, ops %d", OpCount(task, layout), len(got)-len(prefix))
	}
	return len(got) - len(prefix)
}

// TestAppendOpsMatchesReferenceRandomTasks compares AppendOps with the
// straightforward per-block implementation over random tasks built directly
// (any P and head slot, 1-3 block parts, 1-3 caches per layer, layer
// slices, prefix hits, runs and breaks, wrapping addresses, and invalid
// inputs that both must reject alike).
func TestAppendOpsMatchesReferenceRandomTasks(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	iters := 20000
	if testing.Short() {
		iters = 2000
	}
	nops := 0
	for it := range iters {
		layout, task, local, remote := randOpsInput(r, it)
		nops += compareOps(t, r, layout, task, local, remote)
	}
	t.Logf("%d tasks, %d ops compared", iters, nops)
}

// randOpsInput is one random task with its layout and caches for the
// reference comparisons: any P and head slot, 1-3 block parts, 1-3 caches
// per layer, layer slices, prefix hits, runs and breaks, wrapping addresses
// (even it), and now and then an invalid input.
func randOpsInput(r *rand.Rand, it int) (CacheLayout, Task, Caches, Caches) {
	ps := []int{1, 1, 2, 4, 8, 3}
	p := ps[r.IntN(len(ps))]
	parts := 1 + r.IntN(3)
	cpl := []int{2, 2, 3, 1}[r.IntN(4)]
	if parts == 3 {
		cpl = 3
	}
	layout := CacheLayout{CachesPerLayer: cpl}
	for range parts {
		unit := uint64(p)
		if r.IntN(20) == 0 {
			unit = 1 // usually not divisible by P: an error for P > 1
		}
		layout.BlockLen = append(layout.BlockLen, unit*uint64(1+r.IntN(1<<14)))
	}
	layers := 1 + r.IntN(8)
	ls := r.IntN(layers)
	le := ls + r.IntN(layers-ls+1)
	nr := r.IntN(40)
	nl := nr
	if nr > 0 && r.IntN(3) == 0 {
		nl = r.IntN(nr + 1) // local prefix hit
	}
	task := Task{
		P: p, HeadSlot: r.IntN(p), LayerStart: ls, LayerEnd: le,
		LocalBlockIDs:  randBlocks(r, nl, r.IntN(1000), 1+r.IntN(20)),
		RemoteBlockIDs: randBlocks(r, nr, r.IntN(1000), 1+r.IntN(20)),
	}
	local := Caches{Base: randBases(r, layers*cpl, it%2 == 0)}
	remote := Caches{Base: randBases(r, (le-ls)*cpl, it%2 == 0)}
	if r.IntN(2) == 0 {
		local.NumBlocks, remote.NumBlocks = 2100, 2100
	}
	switch r.IntN(40) { // occasional invalid input
	case 0:
		local.NumBlocks = 1 + r.IntN(1000)
	case 1:
		remote.Base = remote.Base[:len(remote.Base)/2]
	case 2:
		task.HeadSlot = p
	case 3:
		if nl > 0 {
			task.LocalBlockIDs[r.IntN(nl)] = -1
		}
	case 4:
		task.LayerEnd = layers + 1
	case 5:
		layout.BlockLen = append(layout.BlockLen, 0)
	}
	return layout, task, local, remote
}

// TestAppendOpsMatchesReferenceRandomPlans compares AppendOps with the
// reference on every task PlanRequest gives for random valid topologies
// (GQA with P = 1, 2, 4, 8, MLA, sparse, prefill PP with and without a layer
// partition, context parallelism) and requests (prefix hits, runs).
func TestAppendOpsMatchesReferenceRandomPlans(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	iters := 3000
	if testing.Short() {
		iters = 300
	}
	ntasks, nops, planned := 0, 0, 0
	seen := map[string]int{}
	for range iters {
		dtp := []int{1, 2, 4}[r.IntN(3)]
		ptp := dtp * []int{1, 2, 4, 8}[r.IntN(4)]
		topo := Topology{
			Prefill: Parallel{TP: ptp, PP: 1 + r.IntN(3), DP: 1, KVPort: 30000},
			Decode:  Parallel{TP: dtp, PP: 1, DP: 1 + r.IntN(2), KVPort: 40000},
			Model:   Model{NumLayers: 4 + r.IntN(61), NumKVHeads: []int{1, 2, 4, 8, 16, 32}[r.IntN(6)]},
		}
		switch r.IntN(4) {
		case 0:
			topo.Model.MLA = true
		case 1:
			topo.Model.MLA, topo.Model.Sparse = true, true
		}
		if topo.Prefill.PP == 1 && r.IntN(4) == 0 {
			topo.Prefill.PCP = 2
			topo.Decode.PCP = 2
			if r.IntN(2) == 0 {
				topo.Decode.DCP = 2
			}
		}
		if topo.Prefill.PP > 1 && r.IntN(2) == 0 {
			n, pp := topo.Model.NumLayers, topo.Prefill.PP
			part := ""
			left := n
			for s := range pp {
				c := left - (pp - 1 - s)
				if s < pp-1 {
					c = 1 + r.IntN(left-(pp-1-s))
				}
				if s > 0 {
					part += ","
				}
				part += fmt.Sprint(c)
				left -= c
			}
			topo.PPLayerPartition = part
		}
		if topo.Validate() != nil {
			continue
		}
		var layout CacheLayout
		switch {
		case topo.Model.Sparse:
			layout = CacheLayout{BlockLen: []uint64{128 * 512 * 2, 128 * 64 * 2, 128 * 128}, CachesPerLayer: 3}
		case topo.Model.MLA:
			layout = CacheLayout{BlockLen: []uint64{128 * 512 * 2, 128 * 64 * 2}, CachesPerLayer: 2}
		default:
			layout = CacheLayout{BlockLen: []uint64{128 * 128 * 2 * uint64(1+r.IntN(8))}, CachesPerLayer: 2}
		}
		nr := r.IntN(130)
		nl := nr
		if r.IntN(3) == 0 {
			nl = r.IntN(nr + 1)
		}
		req := Request{
			ID:             fmt.Sprintf("cmpl-%x-0", r.Uint64()),
			LocalBlockIDs:  randBlocks(r, nl, r.IntN(5000), 1+r.IntN(32)),
			RemoteBlockIDs: randBlocks(r, nr, r.IntN(5000), 1+r.IntN(32)),
			RemotePort:     30000,
		}
		self := Rank{TP: r.IntN(dtp)}
		pl, err := PlanRequest(topo, self, req)
		if err != nil {
			continue
		}
		planned++
		cpl := layout.CachesPerLayer
		local := Caches{Base: randBases(r, topo.Model.NumLayers*cpl, false), NumBlocks: 6000}
		for _, task := range pl.Tasks {
			remote := Caches{Base: randBases(r, (task.LayerEnd-task.LayerStart)*cpl, false), NumBlocks: 6000}
			nops += compareOps(t, r, layout, task, local, remote)
			ntasks++
			seen[fmt.Sprintf("P=%d mla=%v sparse=%v pp=%d", task.P, topo.Model.MLA, topo.Model.Sparse, topo.Prefill.PP)]++
		}
	}
	if planned < iters/4 {
		t.Fatalf("only %d of %d random topologies planned", planned, iters)
	}
	for _, want := range []string{"P=1 mla=false", "P=2 mla=false", "P=4 mla=false", "P=8 mla=false", "P=1 mla=true sparse=false", "sparse=true"} {
		found := false
		for k := range seen {
			if strings.Contains(k, want) {
				found = true
			}
		}
		if !found {
			t.Errorf("no task with %q among %v", want, seen)
		}
	}
	t.Logf("%d plans, %d tasks, %d ops compared; %v", planned, ntasks, nops, seen)
}
