package read

import (
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/stages/plan"
)

// opsEngine records the ops of every BatchRead.
type opsEngine struct {
	mooncake.Engine
	got [][]mooncake.Op
}

func (e *opsEngine) BatchRead(_ context.Context, _ string, ops []mooncake.Op) error {
	e.got = append(e.got, ops)
	return nil
}

// adapterTasks plans 128-block requests (runs of 16 blocks, a prefix hit)
// for GQA with tp_num_need_pulls 4 and for MLA and returns every task with
// its layout and caches.
func adapterTasks(t testing.TB) (out []struct {
	layout        plan.CacheLayout
	task          plan.Task
	local, remote plan.Caches
}) {
	gqa := plan.Topology{
		Prefill: plan.Parallel{TP: 8, PP: 2, DP: 1, KVPort: 30000},
		Decode:  plan.Parallel{TP: 2, PP: 1, DP: 1, KVPort: 40000},
		Model:   plan.Model{NumLayers: 64, NumKVHeads: 8},
	}
	mla := gqa
	mla.Model = plan.Model{NumLayers: 64, NumKVHeads: 1, MLA: true}
	for _, c := range []struct {
		topo   plan.Topology
		layout plan.CacheLayout
	}{
		{gqa, plan.CacheLayout{BlockLen: []uint64{128 * 4 * 128 * 2}, CachesPerLayer: 2}},
		{mla, plan.CacheLayout{BlockLen: []uint64{128 * 512 * 2, 128 * 64 * 2}, CachesPerLayer: 2}},
	} {
		local, remote := make([]int, 120), make([]int, 128)
		for i := range local {
			local[i] = 1000 + i + i/16*3
		}
		for i := range remote {
			remote[i] = 20 + i
		}
		pl, err := plan.PlanRequest(c.topo, plan.Rank{TP: 1}, plan.Request{ID: "cmpl-1", LocalBlockIDs: local, RemoteBlockIDs: remote, RemotePort: 30000})
		if err != nil {
			t.Fatal(err)
		}
		cpl := c.layout.CachesPerLayer
		lbase := make([]uint64, c.topo.Model.NumLayers*cpl)
		for i := range lbase {
			lbase[i] = uint64(i+1) << 32
		}
		for _, task := range pl.Tasks {
			rbase := make([]uint64, (task.LayerEnd-task.LayerStart)*cpl)
			for i := range rbase {
				rbase[i] = uint64(i+1)<<32 | 1<<62
			}
			out = append(out, struct {
				layout        plan.CacheLayout
				task          plan.Task
				local, remote plan.Caches
			}{c.layout, task, plan.Caches{Base: lbase}, plan.Caches{Base: rbase}})
		}
	}
	return out
}

// Engine hands the engine exactly the ops of the expanded list, whether
// the batch is compact reads or a list.
func TestEngineBatchRead(t *testing.T) {
	for _, c := range adapterTasks(t) {
		var rd plan.Reads
		if err := rd.Build(c.layout, c.task, c.local, c.remote); err != nil {
			t.Fatal(err)
		}
		e := &opsEngine{}
		tr := Engine(e)
		if caps := tr.Capabilities(); caps.LocalStride || caps.Gather || caps.Ledger || caps.Classify == nil {
			t.Fatalf("capabilities of a plain engine: %+v", caps)
		}
		if err := tr.BatchRead(context.Background(), "s", &Batch{Reads: &rd}); err != nil {
			t.Fatal(err)
		}
		if err := tr.BatchRead(context.Background(), "s", &Batch{List: rd.AppendTo(nil)}); err != nil {
			t.Fatal(err)
		}
		if len(e.got[0]) != rd.Len() || !slices.Equal(e.got[0], e.got[1]) {
			t.Fatalf("P=%d: BatchReads gave %d ops, BatchRead %d, or they differ", c.task.P, len(e.got[0]), len(e.got[1]))
		}
	}
}

// BenchmarkEngineOps is the read stage's op materialisation per 128-block
// request: /reads expands the compact reads once into mooncake ops (the
// Engine adapter's); /ops is the former path, plan.AppendOps into a
// []plan.Op and then the copy into mooncake ops.
//
//	go test -run '^$' -bench EngineOps -benchmem ./stages/read/
func BenchmarkEngineOps(b *testing.B) {
	tasks := adapterTasks(b)
	for _, p := range []int{4, 1} {
		var ts []int
		for i, c := range tasks {
			if c.task.P == p {
				ts = append(ts, i)
			}
		}
		name := map[int]string{4: "GQA64P4", 1: "MLA64"}[p]
		b.Run(name+"/reads", func(b *testing.B) {
			var rd plan.Reads
			var dst []mooncake.Op
			for b.Loop() {
				for _, i := range ts {
					c := tasks[i]
					if err := rd.Build(c.layout, c.task, c.local, c.remote); err != nil {
						b.Fatal(err)
					}
					dst = AppendEngineOps(dst[:0], &rd)
				}
			}
		})
		b.Run(name+"/ops", func(b *testing.B) {
			var ops []plan.Op
			var dst []mooncake.Op
			for b.Loop() {
				for _, i := range ts {
					c := tasks[i]
					var err error
					if ops, err = plan.AppendOps(ops[:0], c.layout, c.task, c.local, c.remote); err != nil {
						b.Fatal(err)
					}
					dst = slices.Grow(dst[:0], len(ops))
					for _, op := range ops {
						dst = append(dst, mooncake.Op{Local: op.Local, Remote: op.Remote, Length: op.Len})
					}
				}
			}
		})
	}
}

// AppendEngineOps is Reads.AppendTo for random layouts (1-3 parts, 1-3
// caches per layer, any P and head slot, layer slices, runs, prefix hits,
// wrapping addresses), after a non-empty dst.
func TestAppendEngineOpsRandom(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	var rd plan.Reads
	for range 3000 {
		p := []int{1, 1, 2, 4, 8}[r.IntN(5)]
		parts := 1 + r.IntN(3)
		layout := plan.CacheLayout{CachesPerLayer: max(parts, 1+r.IntN(3))}
		for range parts {
			layout.BlockLen = append(layout.BlockLen, uint64(p)*uint64(1+r.IntN(1<<12)))
		}
		layers := 1 + r.IntN(6)
		ls := r.IntN(layers)
		le := ls + r.IntN(layers-ls+1)
		nr := r.IntN(40)
		nl := nr - r.IntN(nr/4+1)
		ids := func(n int) []int {
			out := make([]int, n)
			b := r.IntN(100)
			for i := range out {
				out[i] = b
				b += 1 + r.IntN(3)/2*r.IntN(5)
			}
			return out
		}
		task := plan.Task{P: p, HeadSlot: r.IntN(p), LayerStart: ls, LayerEnd: le, LocalBlockIDs: ids(nl), RemoteBlockIDs: ids(nr)}
		bases := func(n int) []uint64 {
			out := make([]uint64, n)
			for i := range out {
				out[i] = r.Uint64()
			}
			return out
		}
		if err := rd.Build(layout, task, plan.Caches{Base: bases(layers * layout.CachesPerLayer)}, plan.Caches{Base: bases((le - ls) * layout.CachesPerLayer)}); err != nil {
			t.Fatal(err)
		}
		pre := []mooncake.Op{{Local: 1, Remote: 2, Length: 3}}
		got := AppendEngineOps(slices.Clone(pre), &rd)
		want := pre
		for _, op := range rd.AppendTo(nil) {
			want = append(want, mooncake.Op{Local: op.Local, Remote: op.Remote, Length: op.Len})
		}
		if !slices.Equal(got, want) {
			t.Fatalf("layout %+v task %+v: engine ops differ from AppendTo's (%d vs %d)", layout, task, len(got), len(want))
		}
	}
}

// capsEngine is a mooncake.Engine with every optional read capability
// (strided local rows, gathered remote rows, a ledger); it records which
// form each batch took.
type capsEngine struct {
	mooncake.Engine
	calls []string
	ops   [][]mooncake.Op
	short bool // the ledger shows op 0 half landed
}

func (e *capsEngine) BatchRead(_ context.Context, _ string, ops []mooncake.Op) error {
	e.calls, e.ops = append(e.calls, "plain"), append(e.ops, ops)
	return nil
}

func (e *capsEngine) BatchReadStrided(_ context.Context, _ string, ops []mooncake.Op, s mooncake.Stride) error {
	e.calls, e.ops = append(e.calls, "strided"), append(e.ops, ops)
	return nil
}

func (e *capsEngine) BatchReadGather(_ context.Context, _ string, ops []mooncake.Op, g mooncake.Stride) error {
	e.calls, e.ops = append(e.calls, "gather"), append(e.ops, ops)
	return nil
}

func (e *capsEngine) BatchReadLedger(_ context.Context, _ string, ops []mooncake.Op, landed []uint64) error {
	e.calls, e.ops = append(e.calls, "ledger"), append(e.ops, ops)
	for i, op := range ops {
		landed[i] = op.Length
	}
	if e.short {
		landed[0] /= 2
	}
	return nil
}

// Engine resolves an engine's capabilities once and sends each batch to
// the form it asks for; a batch asking for what the engine cannot do is
// refused, not silently read another way. Through the stage, a ledger
// shortfall fails the job.
func TestEngineCapabilities(t *testing.T) {
	var rd plan.Reads
	layout := plan.CacheLayout{BlockLen: []uint64{4096}, CachesPerLayer: 2, BlockSize: 16}
	task := plan.Task{P: 1, HeadSplit: 2, HeadSlice: 1, LayerStart: 0, LayerEnd: 1, LocalBlockIDs: []int{0, 1}, RemoteBlockIDs: []int{4, 5}}
	if err := rd.Build(layout, task, plan.Caches{Base: []uint64{1 << 30, 2 << 30}}, plan.Caches{Base: []uint64{3 << 30, 4 << 30}}); err != nil {
		t.Fatal(err)
	}
	e := &capsEngine{}
	tr := Engine(e)
	if c := tr.Capabilities(); !c.LocalStride || !c.Gather || !c.Ledger || c.Classify == nil {
		t.Fatalf("capabilities %+v", c)
	}
	ctx := context.Background()
	for _, b := range []*Batch{
		{Reads: &rd},
		{Reads: &rd, Gather: true},
		{Reads: &rd, Row: 64, Pitch: 256},
		{Reads: &rd, Landed: make([]uint64, rd.Len())},
	} {
		if err := tr.BatchRead(ctx, "s", b); err != nil {
			t.Fatal(err)
		}
	}
	if want := []string{"plain", "gather", "strided", "ledger"}; !slices.Equal(e.calls, want) {
		t.Fatalf("calls %v, want %v", e.calls, want)
	}
	if len(e.ops[1]) != 2 || e.ops[1][0].Length != 2*4096 || len(e.ops[0]) != rd.Len() {
		t.Fatalf("gather ops %v; plain %d ops", e.ops[1], len(e.ops[0]))
	}
	plain := Engine(&opsEngine{})
	for _, b := range []*Batch{{Reads: &rd, Gather: true}, {Reads: &rd, Row: 64, Pitch: 256}, {Reads: &rd, Landed: make([]uint64, rd.Len())}} {
		if err := plain.BatchRead(ctx, "s", b); err == nil {
			t.Fatalf("a plain engine ran %+v", b)
		}
	}

	// The stage with a ledger engine that reports a short op: the job fails.
	st, err := build(Engine(&capsEngine{short: true}), Options{Layout: plan.CacheLayout{BlockLen: []uint64{4096}, CachesPerLayer: 2},
		Local: plan.Caches{Base: []uint64{5 << 30, 6 << 30, 7 << 30, 8 << 30}, NumBlocks: 8}})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Process(ctx, testJob(1)); !errors.Is(err, ErrShortfall) {
		t.Fatalf("err %v, want %v", err, ErrShortfall)
	}
}
