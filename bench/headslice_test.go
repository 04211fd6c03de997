//go:build linux

package bench

import (
	"bytes"
	"context"
	"testing"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/stages/plan"
)

// BenchmarkHeadSlice is the read of a decode rank at TP 2 from a prefill
// rank at TP 1 (issue 24): the decode rank needs half of every token row
// of the prefill blocks (4 of 8 KV heads × 128, bf16, block 128: 1 KiB of
// each 2 KiB row), 8 layers × K/V × 16 blocks = 32 MiB per request, over
// TCPEngine on loopback. Three ways, each verified once:
//
//   - rows: the planner's head-split reads (plan.Task.HeadSplit), one op
//     per token row, 1 KiB each (32,768 ops), straight into the decode
//     cache: only the bytes needed cross the wire.
//   - whole+slice: whole prefill blocks (contiguous runs, 64 MiB) into a
//     registered scratch cache, then each row's slice copied locally.
//   - strided: the same rows in their strided form (plan.Reads.AppendGather:
//     one op per tensor and block run, 16 ops of 2 MiB) through
//     BatchReadGather: kvflow's strided READ, each request up to 4 MiB of
//     rows the target gathers (writev) into one contiguous answer that lands
//     straight in the decode cache. What the read stage does by default
//     with the TCP engine.
//
// MB/s is the useful 32 MiB per request in all three.
//
//	go test -run '^$' -bench 'HeadSlice$' -benchtime 20x ./bench/
func BenchmarkHeadSlice(b *testing.B) {
	const nblocks = 16
	pshape := npu.Shape{NumLayers: 8, NumBlocks: nblocks, BlockSize: 128, NumKVHeads: 8, HeadDim: 128, DType: npu.BF16}
	dshape := pshape
	dshape.NumKVHeads = 4
	pl, err := npu.NewLayout(pshape)
	if err != nil {
		b.Fatal(err)
	}
	dl, err := npu.NewLayout(dshape)
	if err != nil {
		b.Fatal(err)
	}
	var src, dst, scratch *npu.Host
	var srv, cli *mooncake.TCPEngine
	b.Cleanup(func() {
		for _, e := range []*mooncake.TCPEngine{cli, srv} {
			if e != nil {
				e.Close()
			}
		}
		for _, h := range []*npu.Host{dst, src, scratch} {
			if h != nil {
				h.Close()
			}
		}
	})
	for _, h := range []struct {
		h **npu.Host
		l npu.Layout
	}{{&src, pl}, {&dst, dl}, {&scratch, pl}} {
		if *h.h, err = npu.NewHost(h.l, npu.HostOptions{NoHugePages: true}); err != nil {
			b.Fatal(err)
		}
	}
	sd := src.Data()
	for i := range sd {
		sd[i] = byte(i*13 + i>>20)
	}
	for _, e := range []**mooncake.TCPEngine{&srv, &cli} {
		if *e, err = mooncake.NewTCPEngine(mooncake.DefaultTCPConfig(), nil, nil); err != nil {
			b.Fatal(err)
		}
	}
	if err := npu.RegisterAll(srv, src); err != nil {
		b.Fatal(err)
	}
	for _, h := range []*npu.Host{dst, scratch} {
		if err := npu.RegisterAll(cli, h); err != nil {
			b.Fatal(err)
		}
	}
	ids := make([]int, nblocks)
	for i := range ids {
		ids[i] = i
	}
	const slice = 1 // decode tp rank 1: heads 4..7
	rowD := uint64(dl.BlockLen(0)) / uint64(dshape.BlockSize)
	rowP := 2 * rowD
	useful := int64(dshape.NumLayers*2*nblocks) * int64(dl.BlockLen(0))
	toOps := func(pops []plan.Op) []mooncake.Op {
		ops := make([]mooncake.Op, len(pops))
		for i, o := range pops {
			ops[i] = mooncake.Op{Local: o.Local, Remote: o.Remote, Length: o.Len}
		}
		return ops
	}
	// verify checks that every decode block holds the slice of its rows.
	verify := func(b *testing.B) {
		for layer := range dshape.NumLayers {
			for part := range 2 {
				for blk := range nblocks {
					d, s := dst.Block(layer, part, blk), src.Block(layer, part, blk)
					for t := uint64(0); t < uint64(dshape.BlockSize); t++ {
						if !bytes.Equal(d[t*rowD:(t+1)*rowD], s[t*rowP+slice*rowD:][:rowD]) {
							b.Fatalf("layer %d part %d block %d row %d: wrong bytes", layer, part, blk, t)
						}
					}
				}
			}
		}
	}
	ctx := context.Background()

	b.Run("rows", func(b *testing.B) {
		topo := plan.Topology{Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 2, PP: 1, DP: 1},
			Model: plan.Model{NumLayers: pshape.NumLayers, NumKVHeads: pshape.NumKVHeads}}
		p, err := plan.PlanRequest(topo, plan.Rank{TP: slice}, plan.Request{ID: "r", LocalBlockIDs: ids, RemoteBlockIDs: ids, RemotePort: 30000})
		if err != nil {
			b.Fatal(err)
		}
		layout := plan.CacheLayout{BlockLen: []uint64{uint64(dl.BlockLen(0))}, CachesPerLayer: 2, BlockSize: dshape.BlockSize}
		pops, err := plan.AppendOps(nil, layout, p.Tasks[0], plan.Caches{Base: dst.BaseAddrs(), NumBlocks: nblocks}, plan.Caches{Base: src.BaseAddrs(), NumBlocks: nblocks})
		if err != nil {
			b.Fatal(err)
		}
		ops := toOps(pops)
		clear(dst.Data())
		if err := cli.BatchRead(ctx, srv.SessionID(), ops); err != nil {
			b.Fatal(err)
		}
		verify(b)
		b.SetBytes(useful)
		b.ReportMetric(float64(len(ops)), "ops/req")
		for b.Loop() {
			if err := cli.BatchRead(ctx, srv.SessionID(), ops); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("strided", func(b *testing.B) {
		topo := plan.Topology{Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 2, PP: 1, DP: 1},
			Model: plan.Model{NumLayers: pshape.NumLayers, NumKVHeads: pshape.NumKVHeads}}
		p, err := plan.PlanRequest(topo, plan.Rank{TP: slice}, plan.Request{ID: "r", LocalBlockIDs: ids, RemoteBlockIDs: ids, RemotePort: 30000})
		if err != nil {
			b.Fatal(err)
		}
		layout := plan.CacheLayout{BlockLen: []uint64{uint64(dl.BlockLen(0))}, CachesPerLayer: 2, BlockSize: dshape.BlockSize}
		var rd plan.Reads
		if err := rd.Build(layout, p.Tasks[0], plan.Caches{Base: dst.BaseAddrs(), NumBlocks: nblocks}, plan.Caches{Base: src.BaseAddrs(), NumBlocks: nblocks}); err != nil {
			b.Fatal(err)
		}
		row, pitch, ok := rd.GatherStride()
		if !ok {
			b.Fatal("no strided form")
		}
		ops := toOps(rd.AppendGather(nil))
		g := mooncake.Stride{Row: row, Pitch: pitch}
		clear(dst.Data())
		if err := cli.BatchReadGather(ctx, srv.SessionID(), ops, g); err != nil {
			b.Fatal(err)
		}
		verify(b)
		b.SetBytes(useful)
		b.ReportMetric(float64(len(ops)), "ops/req")
		for b.Loop() {
			if err := cli.BatchReadGather(ctx, srv.SessionID(), ops, g); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("whole+slice", func(b *testing.B) {
		topo := plan.Topology{Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 1, PP: 1, DP: 1},
			Model: plan.Model{NumLayers: pshape.NumLayers, NumKVHeads: pshape.NumKVHeads}}
		p, err := plan.PlanRequest(topo, plan.Rank{}, plan.Request{ID: "r", LocalBlockIDs: ids, RemoteBlockIDs: ids, RemotePort: 30000})
		if err != nil {
			b.Fatal(err)
		}
		layout := plan.CacheLayout{BlockLen: []uint64{uint64(pl.BlockLen(0))}, CachesPerLayer: 2}
		pops, err := plan.AppendOps(nil, layout, p.Tasks[0], plan.Caches{Base: scratch.BaseAddrs(), NumBlocks: nblocks}, plan.Caches{Base: src.BaseAddrs(), NumBlocks: nblocks})
		if err != nil {
			b.Fatal(err)
		}
		ops := toOps(pops)
		sliceAll := func() {
			for layer := range dshape.NumLayers {
				for part := range 2 {
					for blk := range nblocks {
						d, s := dst.Block(layer, part, blk), scratch.Block(layer, part, blk)
						for t := uint64(0); t < uint64(dshape.BlockSize); t++ {
							copy(d[t*rowD:(t+1)*rowD], s[t*rowP+slice*rowD:])
						}
					}
				}
			}
		}
		clear(dst.Data())
		if err := cli.BatchRead(ctx, srv.SessionID(), ops); err != nil {
			b.Fatal(err)
		}
		sliceAll()
		verify(b)
		b.SetBytes(useful)
		b.ReportMetric(float64(len(ops)), "ops/req")
		for b.Loop() {
			if err := cli.BatchRead(ctx, srv.SessionID(), ops); err != nil {
				b.Fatal(err)
			}
			sliceAll()
		}
	})
}
