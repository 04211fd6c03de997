package bench

import (
	"testing"
	"time"

	"github.com/kvflow/kvflow/stages/plan"
)

// planCase is one topology of BenchmarkPlan.
type planCase struct {
	name   string
	topo   plan.Topology
	layout plan.CacheLayout
}

func planCases() []planCase {
	gqa := plan.Topology{
		Prefill: plan.Parallel{TP: 8, PP: 1, DP: 1, KVPort: 30000},
		Decode:  plan.Parallel{TP: 2, PP: 1, DP: 1, KVPort: 40000},
		Model:   plan.Model{NumLayers: 64, NumKVHeads: 8},
	}
	mla := gqa
	mla.Model = plan.Model{NumLayers: 64, NumKVHeads: 1, MLA: true}
	return []planCase{
		// 8 KV heads, prefill TP 8 -> decode TP 2: tp_num_need_pulls 4,
		// one op per block per tensor (65,536 ops for 128 blocks).
		{"GQA64P4", gqa, plan.CacheLayout{BlockLen: []uint64{128 * 4 * 128 * 2}, CachesPerLayer: 2}},
		// DeepSeek-style MLA, 64 layers, 2-part cache, P = 1 (runs grouped).
		{"MLA64", mla, plan.CacheLayout{BlockLen: []uint64{128 * 512 * 2, 128 * 64 * 2}, CachesPerLayer: 2}},
	}
}

// BenchmarkPlan is the plan stage's per-request cost for a 128-block
// request on one decode rank, in two parts timed separately in the same
// iterations:
//
//   - planning (kvflow_ns/request, the figure, target < 50 µs):
//     PlanRequest, then every task's compact reads built (plan.Reads.Build
//     into per-task Reads reused across requests) — the plan→read hand-off
//     as the read stage does it: validation, block runs, byte count, no op
//     written;
//   - expansion (expand_ns/request): every task's ops written into a
//     reused []plan.Op (Reads.AppendTo; the same ops plan.AppendOps
//     gives). Nothing on the request path does this any more: the read
//     stage hands the compact reads to the transfer adapter, which expands
//     them once, straight into the engine's own op list
//     (stages/read.AppendEngineOps; BenchmarkEngineOps there compares it
//     with the former AppendOps-then-copy path). It is timed here so the
//     former figure (planning + expansion) stays visible.
//
// The baseline (base_ns/request), timed in the same iterations, writes the
// same number of ops with a bare loop of address arithmetic (no topology,
// no rank choice, no checks): the least any planner must spend producing
// that op list. ratio = (kvflow + expand) / base, the former whole-stage
// figure against the bare loop. allocs/op are the planning's (expansion
// and baseline reuse their buffers); ops/request counts the ops.
//
//	go test -run '^$' -bench Plan -benchmem -count 5 ./bench/
func BenchmarkPlan(b *testing.B) {
	for _, pc := range planCases() {
		b.Run(pc.name, func(b *testing.B) {
			if err := pc.topo.Validate(); err != nil {
				b.Fatal(err)
			}
			const nblocks = 128
			local, remote := make([]int, nblocks), make([]int, nblocks)
			for i := range local {
				local[i] = 1000 + i + i/16*3 // runs of 16 contiguous blocks
				remote[i] = 20 + i
			}
			cpl := pc.layout.CachesPerLayer
			lbase := make([]uint64, pc.topo.Model.NumLayers*cpl)
			rbase := make([]uint64, len(lbase))
			for i := range lbase {
				lbase[i] = uint64(i+1) << 32
				rbase[i] = uint64(i+1)<<32 | 1<<62
			}
			req := plan.Request{ID: "cmpl-5d73b0af444ad0bf081de695914b7c9e-0", LocalBlockIDs: local, RemoteBlockIDs: remote, RemotePort: 30000}
			var reads []plan.Reads
			var ops []plan.Op
			baseOps := make([]plan.Op, 0, 1<<17)
			nops := 0
			var kv, expand, base time.Duration
			b.ReportAllocs()
			for b.Loop() {
				t0 := time.Now()
				pl, err := plan.PlanRequest(pc.topo, plan.Rank{TP: 1}, req)
				if err != nil {
					b.Fatal(err)
				}
				if len(reads) < len(pl.Tasks) {
					reads = make([]plan.Reads, len(pl.Tasks))
				}
				for i, t := range pl.Tasks {
					n := (t.LayerEnd - t.LayerStart) * cpl
					if err := reads[i].Build(pc.layout, t, plan.Caches{Base: lbase}, plan.Caches{Base: rbase[:n]}); err != nil {
						b.Fatal(err)
					}
				}
				t1 := time.Now()
				kv += t1.Sub(t0)
				nops = 0
				for i := range pl.Tasks {
					ops = reads[i].AppendTo(ops[:0])
					nops += len(ops)
				}
				t2 := time.Now()
				expand += t2.Sub(t1)
				baseOps = bareOps(baseOps[:0], nops, lbase, rbase, pc.layout.BlockLen[0])
				base += time.Since(t2)
			}
			n := float64(b.N)
			b.ReportMetric(float64(nops), "ops/request")
			b.ReportMetric(float64(kv.Nanoseconds())/n, "kvflow_ns/request")
			b.ReportMetric(float64(expand.Nanoseconds())/n, "expand_ns/request")
			b.ReportMetric(float64(base.Nanoseconds())/n, "base_ns/request")
			b.ReportMetric(float64(kv+expand)/float64(base), "ratio")
		})
	}
}

// bareOps appends n ops of fixed stride, tensor by tensor: the baseline's
// irreducible work.
func bareOps(dst []plan.Op, n int, lbase, rbase []uint64, l uint64) []plan.Op {
	per := (n + len(lbase) - 1) / len(lbase)
	for t := range lbase {
		lb, rb := lbase[t], rbase[t]
		for blk := range uint64(min(per, n-len(dst))) {
			dst = append(dst, plan.Op{Local: lb + blk*l, Remote: rb + blk*l/4, Len: l / 4})
		}
	}
	return dst
}
