//go:build linux

package bench

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/hw/shm"
	"github.com/kvflow/kvflow/stages/plan"
)

// BenchmarkSameHost is node.te_backend shm's read (issue 21): a decode
// rank copying one 16-block request from a same-host prefill's cache file
// (npu.CreateShm under /dev/shm), through hw/shm.Reader.Read with its
// grant checks, vs, in the same iterations:
//
//   - copy_GB/s: a plain copy() of the same ops' bytes between the same
//     two mappings (the prefill's file mapping and the decode's cache):
//     the target is ratio_copy = shm / copy ≥ 0.8;
//   - tcp_GB/s: TCPEngine.BatchRead of the same ops on loopback (the path
//     a same-host decode takes without shm).
//
// 8 layers × K/V × 16 blocks of Llama-3-8B-like blocks (8 KV heads × 128,
// block 128, bf16: 512 KiB per block and cache, 64 MiB per request).
// "contiguous": runs grouped (16 ops of 4 MiB); "scattered": local
// blocks reversed (256 ops of 512 KiB); "fused": a decode rank of 8 heads
// reading from a prefill rank of 4 (tp_num_need_pulls 2), each prefill
// block's 512-byte token rows landing 1 KiB apart (the fused head
// transpose), copy baseline the same rows with the same copy() each.
// Every byte verified once.
//
// ratio_copy and ratio_tcp are medians of per-iteration ratios (copy time
// / shm time, tcp time / shm time); the GB/s are totals.
//
//	go test -run '^$' -bench 'SameHost$' -benchtime 20x ./bench/
func BenchmarkSameHost(b *testing.B) {
	const nblocks = 16
	for _, tc := range []struct {
		name      string
		scattered bool
		split     int // prefill ranks per decode block (fused); 1: plain
	}{{"contiguous", false, 1}, {"scattered", true, 1}, {"fused", false, 2}} {
		b.Run(tc.name, func(b *testing.B) {
			dshape := npu.Shape{NumLayers: 8, NumBlocks: nblocks, BlockSize: 128, NumKVHeads: 8, HeadDim: 128, DType: npu.BF16}
			pshape := dshape
			pshape.NumKVHeads /= tc.split
			pl, err := npu.NewLayout(pshape)
			if err != nil {
				b.Fatal(err)
			}
			dl, err := npu.NewLayout(dshape)
			if err != nil {
				b.Fatal(err)
			}
			dir := "/dev/shm"
			if _, err := os.Stat(dir); err != nil {
				dir = b.TempDir()
			}
			dir, err = os.MkdirTemp(dir, "kvflow-bench-shm-")
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { os.RemoveAll(dir) })
			path := filepath.Join(dir, "p.kv")
			src, err := npu.CreateShm(path, pl, npu.HostOptions{NoHugePages: true, RemoveOnClose: true})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { src.Close() })
			dst, err := npu.NewHost(dl, npu.HostOptions{NoHugePages: true})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { dst.Close() })
			sd := src.Data()
			for i := range sd {
				sd[i] = byte(i*13 + i>>20)
			}
			table, err := shm.CreateTable(path+".grants", nblocks, 0)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { table.Close(true) })
			all := make([]int, nblocks)
			for i := range all {
				all[i] = i
			}
			if err := table.GrantRequest("r", all); err != nil {
				b.Fatal(err)
			}
			claim, err := shm.MakeClaim(path, table)
			if err != nil {
				b.Fatal(err)
			}
			var local [][]byte
			for k := range dl.NumCaches() {
				layer, part := dl.CacheOf(k)
				local = append(local, dst.Bytes(layer, part))
			}
			r, err := shm.Open(claim, shm.Options{BaseAddrs: src.BaseAddrs(), Local: local})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { r.Close() })
			var srv, cli *mooncake.TCPEngine
			for _, e := range []**mooncake.TCPEngine{&srv, &cli} {
				if *e, err = mooncake.NewTCPEngine(mooncake.DefaultTCPConfig(), nil, nil); err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { (*e).Close() })
			}
			if err := npu.RegisterAll(srv, src); err != nil {
				b.Fatal(err)
			}
			if err := npu.RegisterAll(cli, dst); err != nil {
				b.Fatal(err)
			}

			// The planner's ops of a TP split → 1 request (rank 0's
			// task when split > 1).
			topo := plan.Topology{Prefill: plan.Parallel{TP: tc.split, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 1, PP: 1, DP: 1},
				Model: plan.Model{NumLayers: dshape.NumLayers, NumKVHeads: dshape.NumKVHeads}}
			lidx, ridx := make([]int, nblocks), make([]int, nblocks)
			for i := range lidx {
				lidx[i], ridx[i] = i, i
				if tc.scattered {
					lidx[i] = nblocks - 1 - i
				}
			}
			req, err := plan.PlanRequest(topo, plan.Rank{}, plan.Request{ID: "r", LocalBlockIDs: lidx, RemoteBlockIDs: ridx, RemotePort: 30000})
			if err != nil {
				b.Fatal(err)
			}
			layout := plan.CacheLayout{BlockLen: []uint64{uint64(dl.BlockLen(0))}, CachesPerLayer: dl.NumParts()}
			pops, err := plan.AppendOps(nil, layout, req.Tasks[0], plan.Caches{Base: dst.BaseAddrs(), NumBlocks: nblocks}, plan.Caches{Base: src.BaseAddrs(), NumBlocks: nblocks})
			if err != nil {
				b.Fatal(err)
			}
			var stride shm.Stride
			ms := mooncake.Stride{}
			if tc.split > 1 {
				// The fused form (what read.Stage asks of a transfer with
				// LocalStride): rank 0's slice of every block, one op per
				// prefill block, landing in rows of the prefill's row
				// length, a decode row apart.
				rowRemote := uint64(pshape.NumKVHeads * pshape.HeadDim * pshape.DType.Size())
				stride = shm.Stride{Row: rowRemote, Pitch: rowRemote * uint64(tc.split)}
				ms = mooncake.Stride{Row: stride.Row, Pitch: stride.Pitch}
				pops = pops[:0]
				for k := range dl.NumCaches() {
					pbl, dbl := uint64(pl.BlockLen(0)), uint64(dl.BlockLen(0))
					for i := range lidx {
						pops = append(pops, plan.Op{Local: dst.BaseAddrs()[k] + uint64(lidx[i])*dbl, Remote: src.BaseAddrs()[k] + uint64(ridx[i])*pbl, Len: pbl})
					}
				}
			}
			ops := make([]shm.Op, len(pops))
			mops := make([]mooncake.Op, len(pops))
			var total int64
			for i, o := range pops {
				ops[i] = shm.Op{Local: o.Local, Remote: o.Remote, Len: o.Len}
				mops[i] = mooncake.Op{Local: o.Local, Remote: o.Remote, Length: o.Len}
				total += int64(o.Len)
			}
			srcOf := func(i int) []byte { return at(ops[i].Remote, ops[i].Len) }
			copyAll := func() {
				for i, op := range ops {
					s := srcOf(i)
					if stride.Row == 0 {
						copy(at(op.Local, op.Len), s)
						continue
					}
					d := at(op.Local, (op.Len/stride.Row-1)*stride.Pitch+stride.Row)
					for j := uint64(0); j < op.Len/stride.Row; j++ {
						copy(d[j*stride.Pitch:j*stride.Pitch+stride.Row], s[j*stride.Row:(j+1)*stride.Row])
					}
				}
			}
			tcpRead := func() error {
				if stride.Row > 0 {
					return cli.BatchReadStrided(context.Background(), srv.SessionID(), mops, ms)
				}
				return cli.BatchRead(context.Background(), srv.SessionID(), mops)
			}
			ctx := context.Background()
			// Warm up every path and verify the shm path against copy().
			copyAll()
			want := bytes.Clone(dst.Data())
			clear(dst.Data())
			if err := r.Read(ctx, "r", ops, stride); err != nil {
				b.Fatal(err)
			}
			if !bytes.Equal(dst.Data(), want) {
				b.Fatal("shm read differs from copy()")
			}
			if err := tcpRead(); err != nil {
				b.Fatal(err)
			}
			if !bytes.Equal(dst.Data(), want) {
				b.Fatal("tcp read differs from copy()")
			}
			b.SetBytes(total)
			b.ReportMetric(float64(len(ops)), "ops/request")
			// The shm read and the copy alternate which goes first, and
			// the ratios are medians of per-iteration ratios, so a burst of
			// load from another process lands on one iteration, not on
			// one side.
			var shmT, copyT, tcpT time.Duration
			var rc, rt []float64
			timeCopy := func() time.Duration {
				t0 := time.Now()
				copyAll()
				return time.Since(t0)
			}
			i := 0
			for b.Loop() {
				var c time.Duration
				if i%2 == 1 {
					b.StopTimer()
					c = timeCopy()
					b.StartTimer()
				}
				t0 := time.Now()
				if err := r.Read(ctx, "r", ops, stride); err != nil {
					b.Fatal(err)
				}
				s := time.Since(t0)
				b.StopTimer() // ns/op and MB/s are the shm path's
				if i%2 == 0 {
					c = timeCopy()
				}
				t0 = time.Now()
				if err := tcpRead(); err != nil {
					b.Fatal(err)
				}
				t := time.Since(t0)
				b.StartTimer()
				shmT, copyT, tcpT = shmT+s, copyT+c, tcpT+t
				rc, rt = append(rc, c.Seconds()/s.Seconds()), append(rt, t.Seconds()/s.Seconds())
				i++
			}
			n := float64(total) * float64(b.N)
			sg, cg, tg := n/shmT.Seconds()/1e9, n/copyT.Seconds()/1e9, n/tcpT.Seconds()/1e9
			b.ReportMetric(sg, "shm_GB/s")
			b.ReportMetric(cg, "copy_GB/s")
			b.ReportMetric(tg, "tcp_GB/s")
			b.ReportMetric(median(rc), "ratio_copy")
			b.ReportMetric(median(rt), "ratio_tcp")
		})
	}
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
