package plan

import (
	"testing"
)

// appendFunc is AppendOps or a variant of it (appendOpsRef) to benchmark.
type appendFunc func([]Op, CacheLayout, Task, Caches, Caches) ([]Op, error)

// benchInput is the benchmarks' 128-block request (runs of 16 contiguous
// blocks) and both sides' tensor base addresses.
func benchInput(b *testing.B, tp Topology, layout CacheLayout) (req Request, lbase, rbase []uint64) {
	if err := tp.Validate(); err != nil {
		b.Fatal(err)
	}
	const nblocks = 128
	local := make([]int, nblocks)
	remote := make([]int, nblocks)
	for i := range local {
		local[i] = 1000 + i + i/16*3 // runs of 16 contiguous blocks
		remote[i] = 20 + i
	}
	lbase = make([]uint64, tp.Model.NumLayers*layout.CachesPerLayer)
	for i := range lbase {
		lbase[i] = uint64(i+1) << 32
	}
	rbase = make([]uint64, len(lbase))
	for i := range rbase {
		rbase[i] = uint64(i+1)<<32 | 1<<62
	}
	req = Request{ID: "cmpl-5d73b0af444ad0bf081de695914b7c9e-0", LocalBlockIDs: local, RemoteBlockIDs: remote, RemotePort: 30000}
	return req, lbase, rbase
}

// benchPlan plans a 128-block request on one decode rank and builds every
// task's ops into a reused buffer with appendOps (AppendOps, or the old
// per-block code for the *Ref baselines): planning plus the full op list,
// what the read stage spent per request before it handed the transfer
// compact Reads. Besides ns/op (= ns/request) it reports ops/request,
// ns/task and ns/planop (ns per address triple).
func benchPlan(b *testing.B, tp Topology, layout CacheLayout, appendOps appendFunc) {
	req, lbase, rbase := benchInput(b, tp, layout)
	cpl := layout.CachesPerLayer
	var ops []Op
	nops, ntasks := 0, 0
	for b.Loop() {
		pl, err := PlanRequest(tp, Rank{TP: 1}, req)
		if err != nil {
			b.Fatal(err)
		}
		nops, ntasks = 0, len(pl.Tasks)
		for _, t := range pl.Tasks {
			n := (t.LayerEnd - t.LayerStart) * cpl
			ops, err = appendOps(ops[:0], layout, t, Caches{Base: lbase}, Caches{Base: rbase[:n]})
			if err != nil {
				b.Fatal(err)
			}
			nops += len(ops)
		}
	}
	b.ReportMetric(float64(nops), "ops/request")
	ns := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	b.ReportMetric(ns/float64(ntasks), "ns/task")
	b.ReportMetric(ns/float64(nops), "ns/planop")
}

// benchReads is benchPlan up to the hand-off to the read stage's transfer:
// PlanRequest and every task's compact Reads built into per-task Reads
// reused across requests (validation, block runs, byte count; no op
// written). This is the planning cost per request.
func benchReads(b *testing.B, tp Topology, layout CacheLayout) {
	req, lbase, rbase := benchInput(b, tp, layout)
	cpl := layout.CachesPerLayer
	var reads []Reads
	nops, ntasks := 0, 0
	for b.Loop() {
		pl, err := PlanRequest(tp, Rank{TP: 1}, req)
		if err != nil {
			b.Fatal(err)
		}
		if len(reads) < len(pl.Tasks) {
			reads = make([]Reads, len(pl.Tasks))
		}
		nops, ntasks = 0, len(pl.Tasks)
		for i, t := range pl.Tasks {
			n := (t.LayerEnd - t.LayerStart) * cpl
			if err := reads[i].Build(layout, t, Caches{Base: lbase}, Caches{Base: rbase[:n]}); err != nil {
				b.Fatal(err)
			}
			nops += reads[i].Len()
		}
	}
	b.ReportMetric(float64(nops), "ops/request")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(ntasks), "ns/task")
}

// BenchmarkPlanMLA64: DeepSeek-style MLA, 64 layers, prefill TP 8 -> decode TP 2
// (random rank choice), 2-part cache; AppendOps (Reads.Build then AppendTo).
func BenchmarkPlanMLA64(b *testing.B) { benchPlan(b, mla(), mlaLayout, AppendOps) }

// BenchmarkPlanReadsMLA64 is BenchmarkPlanMLA64 without writing the ops:
// planning up to the compact Reads the read stage hands its transfer.
func BenchmarkPlanReadsMLA64(b *testing.B) { benchReads(b, mla(), mlaLayout) }

// BenchmarkPlanMLA64Ref is BenchmarkPlanMLA64 with the old op generation
// (appendOpsRef), to compare in the same run.
func BenchmarkPlanMLA64Ref(b *testing.B) { benchPlan(b, mla(), mlaLayout, appendOpsRef) }

var (
	mlaLayout = CacheLayout{BlockLen: []uint64{128 * 512 * 2, 128 * 64 * 2}, CachesPerLayer: 2}
	gqaLayout = CacheLayout{BlockLen: []uint64{128 * 4 * 128 * 2}, CachesPerLayer: 2}
)

// BenchmarkPlanGQA64P4: GQA, 8 KV heads, prefill TP 8 -> decode TP 2, so
// tp_num_need_pulls = 4 (one op per block, 4 tasks); AppendOps (Reads.Build
// then AppendTo).
func BenchmarkPlanGQA64P4(b *testing.B) { benchGQA64P4(b, AppendOps) }

// BenchmarkPlanReadsGQA64P4 is BenchmarkPlanGQA64P4 without writing the
// ops: planning up to the compact Reads the read stage hands its transfer.
func BenchmarkPlanReadsGQA64P4(b *testing.B) {
	tp := gqa()
	if tp.NeedPulls() != 4 {
		b.Fatalf("P = %d", tp.NeedPulls())
	}
	benchReads(b, tp, gqaLayout)
}

// BenchmarkPlanGQA64P4Ref is BenchmarkPlanGQA64P4 with the old op
// generation (appendOpsRef), to compare in the same run.
func BenchmarkPlanGQA64P4Ref(b *testing.B) { benchGQA64P4(b, appendOpsRef) }

func benchGQA64P4(b *testing.B, f appendFunc) {
	tp := gqa()
	if tp.NeedPulls() != 4 {
		b.Fatalf("P = %d", tp.NeedPulls())
	}
	benchPlan(b, tp, gqaLayout, f)
}

// BenchmarkPlanOnly is PlanRequest alone (no ops) for the GQA case.
func BenchmarkPlanOnly(b *testing.B) {
	tp := gqa()
	ids := make([]int, 128)
	for i := range ids {
		ids[i] = i
	}
	req := Request{ID: "req-1", LocalBlockIDs: ids, RemoteBlockIDs: ids, RemotePort: 30000}
	for b.Loop() {
		if _, err := PlanRequest(tp, Rank{TP: 1}, req); err != nil {
			b.Fatal(err)
		}
	}
}
