package read

import (
	"context"
	"errors"
	"testing"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

// recordTransfer keeps the ops of every batch (in the form asked for) and
// whether it was asked to gather; gather states Capabilities.Gather.
type recordTransfer struct {
	ops      [][]plan.Op
	gathered []bool
	gather   bool
}

func (r *recordTransfer) BatchRead(_ context.Context, _ string, b *Batch) error {
	r.ops = append(r.ops, b.AppendTo(nil))
	r.gathered = append(r.gathered, b.Gather)
	return nil
}

func (r *recordTransfer) Capabilities() Capabilities { return Capabilities{Gather: r.gather} }

// A kvflow-only plan (decode TP > prefill TP) is refused, before any read,
// by a peer whose metadata has no kvflow boot epoch (a seed or Mooncake
// peer), and read from a kvflow peer as head slices: one op per token row
// of the local block (Options.BlockSize rows), remote rows twice as long.
func TestHeadSliceReadAndSeedPeerRefused(t *testing.T) {
	topo := plan.Topology{Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 2, PP: 1, DP: 1},
		Model: plan.Model{NumLayers: 2, NumKVHeads: 8}}
	pl, err := plan.PlanRequest(topo, plan.Rank{TP: 1}, plan.Request{ID: "r", LocalBlockIDs: []int{0, 1}, RemoteBlockIDs: []int{2, 3}, RemotePort: 30000})
	if err != nil {
		t.Fatal(err)
	}
	const blockLen, blockSize = 4096, 16 // decode block: 16 rows of 256 bytes
	mk := func(epoch uint64) *job.Job {
		j := job.New(plan.Request{ID: "r"}, testNow)
		j.Plan = pl
		j.Metas = []job.Meta{{EngineID: "P", TERPCPort: 17000, BaseAddrs: []uint64{1 << 30, 2 << 30, 3 << 30, 4 << 30}, NumBlocks: 8, BootEpoch: epoch}}
		return j
	}
	for _, tc := range []struct {
		name    string
		epoch   uint64
		wantErr error
		wantOps int
	}{
		{"seed peer refused", 0, ErrPeerNotKvflow, 0},
		{"kvflow peer", 1, nil, 4 * 2 * blockSize},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rt := &recordTransfer{}
			s, err := build(rt, Options{
				Layout:    plan.CacheLayout{BlockLen: []uint64{blockLen}, CachesPerLayer: 2},
				Local:     plan.Caches{Base: []uint64{5 << 30, 6 << 30, 7 << 30, 8 << 30}, NumBlocks: 8},
				BlockSize: blockSize,
			})
			if err != nil {
				t.Fatal(err)
			}
			j := mk(tc.epoch)
			err = s.Process(context.Background(), j)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("err %v, want %v", err, tc.wantErr)
			}
			n := 0
			for _, b := range rt.ops {
				n += len(b)
			}
			if n != tc.wantOps {
				t.Fatalf("%d ops, want %d", n, tc.wantOps)
			}
			if n == 0 {
				return
			}
			const row = blockLen / blockSize
			// Tensor 0, local block 0 row 0: slice 1 of remote block 2's row 0.
			if op := rt.ops[0][0]; op != (plan.Op{Local: 5 << 30, Remote: 1<<30 + 2*2*blockLen + row, Len: row}) {
				t.Errorf("first op %+v", op)
			}
			if got := j.BytesRead.Load(); got != 4*2*blockLen {
				t.Errorf("bytes read %d, want %d", got, 4*2*blockLen)
			}
		})
	}
}

// A long head-split task is read a few layers at a time: the chunks'
// ops, in order, are exactly the whole task's, and every chunk stays
// within maxHeadSliceOps.
func TestHeadSliceChunks(t *testing.T) {
	topo := plan.Topology{Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 2, PP: 1, DP: 1},
		Model: plan.Model{NumLayers: 64, NumKVHeads: 8}}
	ids := make([]int, 16)
	for i := range ids {
		ids[i] = i
	}
	pl, err := plan.PlanRequest(topo, plan.Rank{TP: 1}, plan.Request{ID: "r", LocalBlockIDs: ids, RemoteBlockIDs: ids, RemotePort: 30000})
	if err != nil {
		t.Fatal(err)
	}
	layout := plan.CacheLayout{BlockLen: []uint64{128 * 1024}, CachesPerLayer: 2, BlockSize: 128}
	var local, remote plan.Caches
	for k := range 128 {
		local.Base = append(local.Base, uint64(k+1)<<32)
		remote.Base = append(remote.Base, uint64(k+1)<<40)
	}
	whole, err := plan.Ops(layout, pl.Tasks[0], local, remote)
	if err != nil {
		t.Fatal(err)
	}
	chunks := headSliceChunks(pl.Tasks[0], len(whole))
	if len(chunks) != 4 {
		t.Fatalf("%d chunks of %d ops, want 4", len(chunks), len(whole))
	}
	var got []plan.Op
	for _, c := range chunks {
		ops, err := plan.Ops(layout, c, local, remote)
		if err != nil {
			t.Fatal(err)
		}
		if len(ops) > maxHeadSliceOps {
			t.Errorf("chunk layers [%d, %d): %d ops", c.LayerStart, c.LayerEnd, len(ops))
		}
		got = append(got, ops...)
	}
	if len(got) != len(whole) {
		t.Fatalf("%d ops in chunks, %d whole", len(got), len(whole))
	}
	for i := range got {
		if got[i] != whole[i] {
			t.Fatalf("op %d: %+v, want %+v", i, got[i], whole[i])
		}
	}
	// Through the stage: four batches, the same ops.
	rt := &recordTransfer{}
	st, err := build(rt, Options{Layout: plan.CacheLayout{BlockLen: layout.BlockLen, CachesPerLayer: 2}, Local: local, BlockSize: 128})
	if err != nil {
		t.Fatal(err)
	}
	j := job.New(plan.Request{ID: "r"}, testNow)
	j.Plan = pl
	j.Metas = []job.Meta{{EngineID: "P", TERPCPort: 17000, BaseAddrs: remote.Base, NumBlocks: 16, BootEpoch: 1}}
	if err := st.Process(context.Background(), j); err != nil {
		t.Fatal(err)
	}
	if len(rt.ops) != 4 {
		t.Fatalf("%d batches, want 4", len(rt.ops))
	}
	i := 0
	for _, b := range rt.ops {
		for _, op := range b {
			if op != whole[i] {
				t.Fatalf("stage op %d: %+v, want %+v", i, op, whole[i])
			}
			i++
		}
	}
	if i != len(whole) || j.OpsRead.Load() != uint64(len(whole)) || j.BytesRead.Load() != 64*2*16*128*1024 {
		t.Errorf("%d ops posted, %d counted, %d bytes; want %d ops", i, j.OpsRead.Load(), j.BytesRead.Load(), len(whole))
	}

	// Not a head split, or small: whole.
	seed := pl.Tasks[0]
	seed.HeadSplit = 0
	if n := len(headSliceChunks(seed, 1<<20)); n != 1 {
		t.Errorf("seed task split into %d", n)
	}
	if n := len(headSliceChunks(pl.Tasks[0], maxHeadSliceOps)); n != 1 {
		t.Errorf("small task split into %d", n)
	}
}

// With a transfer that gathers (Capabilities.Gather), a head-split task
// goes as its strided form, one batch: one op per tensor and run of
// blocks, whose rows are the per-row ops; the stage counts the ops it
// posted and the same bytes. A long task is not cut into layer chunks.
func TestHeadSliceGather(t *testing.T) {
	topo := plan.Topology{Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 2, PP: 1, DP: 1},
		Model: plan.Model{NumLayers: 64, NumKVHeads: 8}}
	ids := []int{0, 1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17} // two runs
	pl, err := plan.PlanRequest(topo, plan.Rank{TP: 1}, plan.Request{ID: "r", LocalBlockIDs: ids, RemoteBlockIDs: ids, RemotePort: 30000})
	if err != nil {
		t.Fatal(err)
	}
	layout := plan.CacheLayout{BlockLen: []uint64{128 * 1024}, CachesPerLayer: 2, BlockSize: 128}
	var local, remote plan.Caches
	for k := range 128 {
		local.Base = append(local.Base, uint64(k+1)<<32)
		remote.Base = append(remote.Base, uint64(k+1)<<40)
	}
	rows, err := plan.Ops(layout, pl.Tasks[0], local, remote)
	if err != nil {
		t.Fatal(err)
	}
	rt := &recordTransfer{gather: true}
	st, err := build(rt, Options{Layout: plan.CacheLayout{BlockLen: layout.BlockLen, CachesPerLayer: 2}, Local: local, BlockSize: 128})
	if err != nil {
		t.Fatal(err)
	}
	j := job.New(plan.Request{ID: "r"}, testNow)
	j.Plan = pl
	j.Metas = []job.Meta{{EngineID: "P", TERPCPort: 17000, BaseAddrs: remote.Base, NumBlocks: 32, BootEpoch: 1}}
	if err := st.Process(context.Background(), j); err != nil {
		t.Fatal(err)
	}
	if len(rt.ops) != 1 || !rt.gathered[0] || len(rt.ops[0]) != 128*2 {
		t.Fatalf("%d batches (gathered %v), first of %d ops; want 1 gathered batch of %d", len(rt.ops), rt.gathered, len(rt.ops[0]), 128*2)
	}
	const row, pitch = 1024, 2048
	i := 0
	for _, op := range rt.ops[0] {
		for r := uint64(0); r < op.Len/row; r++ {
			if got := (plan.Op{Local: op.Local + r*row, Remote: op.Remote + r*pitch, Len: row}); got != rows[i] {
				t.Fatalf("row %d: %+v, want %+v", i, got, rows[i])
			}
			i++
		}
	}
	if i != len(rows) || j.OpsRead.Load() != 256 || j.BytesRead.Load() != 64*2*16*128*1024 {
		t.Fatalf("%d rows of %d; counted %d ops, %d bytes", i, len(rows), j.OpsRead.Load(), j.BytesRead.Load())
	}
}
