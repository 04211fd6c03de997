package plan

import (
	"math/rand/v2"
	"testing"
)

// TestAppendGatherIsTheRows: the strided form of head-split reads, each
// op expanded row by row under GatherStride, is exactly the per-row ops,
// in order, over random decode/prefill TP pairs, block lists with and
// without gaps, and prefix hits; other reads have no strided form.
func TestAppendGatherIsTheRows(t *testing.T) {
	rng := rand.New(rand.NewPCG(24, 3))
	gathered := 0
	for it := range 300 {
		ptp := 1 << rng.IntN(3)
		dtp := ptp << (1 + rng.IntN(2))
		heads := ptp << rng.IntN(3)
		topo := Topology{Prefill: Parallel{TP: ptp, PP: 1, DP: 1}, Decode: Parallel{TP: dtp, PP: 1, DP: 1},
			Model: Model{NumLayers: 1 + rng.IntN(4), NumKVHeads: heads}}
		nr := 1 + rng.IntN(12)
		nl := 1 + rng.IntN(nr)
		var rem, loc []int
		b := rng.IntN(3)
		for range nr {
			rem = append(rem, b)
			b += 1 + rng.IntN(2)*rng.IntN(3)
		}
		b = rng.IntN(3)
		for range nl {
			loc = append(loc, b)
			b += 1 + rng.IntN(3)/2
		}
		pl, err := PlanRequest(topo, Rank{TP: rng.IntN(dtp)}, Request{ID: "r", LocalBlockIDs: loc, RemoteBlockIDs: rem, RemotePort: 30000})
		if err != nil {
			t.Fatal(err)
		}
		bs := 4 << rng.IntN(3)
		rowD := uint64(2 * max(1, heads/dtp) * 8)
		layout := CacheLayout{BlockLen: []uint64{rowD * uint64(bs)}, CachesPerLayer: 2, BlockSize: bs}
		var lc, rc Caches
		for k := range 2 * topo.Model.NumLayers {
			lc.Base = append(lc.Base, uint64(k+1)<<32)
			rc.Base = append(rc.Base, uint64(k+1)<<40)
		}
		for _, task := range pl.Tasks {
			var r Reads
			if err := r.Build(layout, task, lc, rc); err != nil {
				t.Fatalf("it %d: %v", it, err)
			}
			row, pitch, ok := r.GatherStride()
			if ok != (task.HeadSplit > 1) {
				t.Fatalf("it %d: GatherStride ok %v for head split %d", it, ok, task.HeadSplit)
			}
			g := r.AppendGather(nil)
			if len(g) != r.GatherLen() {
				t.Fatalf("it %d: %d gather ops, GatherLen %d", it, len(g), r.GatherLen())
			}
			if !ok {
				continue
			}
			gathered++
			var rows []Op
			for _, op := range g {
				for i := uint64(0); i < op.Len/row; i++ {
					rows = append(rows, Op{Local: op.Local + i*row, Remote: op.Remote + i*pitch, Len: row})
				}
			}
			want := r.AppendTo(nil)
			if len(rows) != len(want) {
				t.Fatalf("it %d: %d rows, want %d", it, len(rows), len(want))
			}
			for i := range want {
				if rows[i] != want[i] {
					t.Fatalf("it %d: row %d %+v, want %+v", it, i, rows[i], want[i])
				}
			}
		}
	}
	if gathered < 100 {
		t.Fatalf("only %d head-split tasks", gathered)
	}
}
