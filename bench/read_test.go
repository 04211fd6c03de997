//go:build linux

package bench

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/stages/plan"
)

// rawConn is the read baseline: one Go TCP connection on loopback; per
// batch the client sends the op count and the server writes each op's
// source range, read straight into the op's destination range. No framing,
// no lanes, no registration: a copy loop of the same bytes in the same
// pieces.
type rawConn struct {
	client net.Conn
}

func newRawConn(tb testing.TB, srcs func(i int) []byte) *rawConn {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		var hdr [16]byte
		for {
			if _, err := io.ReadFull(c, hdr[:]); err != nil {
				return
			}
			first, n := int(binary.LittleEndian.Uint64(hdr[:])), int(binary.LittleEndian.Uint64(hdr[8:]))
			for i := first; i < first+n; i++ {
				if _, err := c.Write(srcs(i)); err != nil {
					return
				}
			}
		}
	}()
	r := &rawConn{}
	if r.client, err = net.Dial("tcp", ln.Addr().String()); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { r.client.Close(); ln.Close(); <-done })
	return r
}

func (r *rawConn) batch(tb testing.TB, first, n int, dsts func(i int) []byte) {
	var hdr [16]byte
	binary.LittleEndian.PutUint64(hdr[:], uint64(first))
	binary.LittleEndian.PutUint64(hdr[8:], uint64(n))
	if _, err := r.client.Write(hdr[:]); err != nil {
		tb.Error(err)
		return
	}
	for i := first; i < first+n; i++ {
		if _, err := io.ReadFull(r.client, dsts(i)); err != nil {
			tb.Error(err)
			return
		}
	}
}

func at(addr, n uint64) []byte {
	a := uintptr(addr)
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&a))), int(n))
}

// BenchmarkRead is the read stage's transfer: TCPEngine.BatchRead on
// loopback of one 16-block request of a Llama-3-8B-like cache at TP 1 → 1
// (32 layers, K and V, 8 KV heads × 128, block 128, bf16: 16 MiB per
// block, 256 MiB per request), with the ops the planner builds
// (plan.PlanRequest + AppendOps) between two real npu.Host caches
// registered with two engines. "contiguous": local and remote blocks in
// order (runs grouped: 64 ops of 4 MiB); "scattered": local blocks
// reversed (1024 ops of 256 KiB). Baselines, interleaved in the same
// iterations: raw_GB/s, the same pieces over one Go TCP connection, and
// raw4_GB/s over four (the engine's lane count). ratio = kvflow / raw,
// ratio_raw4 = kvflow / raw4. 512 MiB of caches.
//
//	go test -run '^$' -bench 'Read$' -benchtime 10x ./bench/
func BenchmarkRead(b *testing.B) {
	const nblocks = 16
	shape := npu.Shape{NumLayers: 32, NumBlocks: nblocks, BlockSize: 128, NumKVHeads: 8, HeadDim: 128, DType: npu.BF16}
	l, err := npu.NewLayout(shape)
	if err != nil {
		b.Fatal(err)
	}
	var src, dst *npu.Host
	var srv, cli *mooncake.TCPEngine
	setup := func(b *testing.B) {
		if src != nil {
			return
		}
		for _, h := range []**npu.Host{&src, &dst} {
			if *h, err = npu.NewHost(l, npu.HostOptions{NoHugePages: true}); err != nil {
				b.Fatal(err)
			}
		}
		sd := src.Data()
		for i := range sd {
			sd[i] = byte(i*13 + i>>20)
		}
		clear(dst.Data())
		for _, e := range []**mooncake.TCPEngine{&srv, &cli} {
			if *e, err = mooncake.NewTCPEngine(mooncake.DefaultTCPConfig(), nil, nil); err != nil {
				b.Fatal(err)
			}
		}
		if err := npu.RegisterAll(srv, src); err != nil {
			b.Fatal(err)
		}
		if err := npu.RegisterAll(cli, dst); err != nil {
			b.Fatal(err)
		}
	}
	b.Cleanup(func() {
		for _, e := range []*mooncake.TCPEngine{cli, srv} {
			if e != nil {
				e.Close()
			}
		}
		for _, h := range []*npu.Host{dst, src} {
			if h != nil {
				h.Close()
			}
		}
	})
	topo := plan.Topology{Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 1, PP: 1, DP: 1},
		Model: plan.Model{NumLayers: shape.NumLayers, NumKVHeads: shape.NumKVHeads}}
	layout := plan.CacheLayout{BlockLen: []uint64{uint64(l.BlockLen(0))}, CachesPerLayer: l.NumParts()}
	for _, scattered := range []bool{false, true} {
		name := "contiguous"
		if scattered {
			name = "scattered"
		}
		b.Run(name, func(b *testing.B) {
			setup(b)
			local, remote := make([]int, nblocks), make([]int, nblocks)
			for i := range local {
				local[i], remote[i] = i, i
				if scattered {
					local[i] = nblocks - 1 - i
				}
			}
			pl, err := plan.PlanRequest(topo, plan.Rank{}, plan.Request{ID: "r", LocalBlockIDs: local, RemoteBlockIDs: remote, RemotePort: 30000})
			if err != nil {
				b.Fatal(err)
			}
			pops, err := plan.AppendOps(nil, layout, pl.Tasks[0], plan.Caches{Base: dst.BaseAddrs(), NumBlocks: nblocks}, plan.Caches{Base: src.BaseAddrs(), NumBlocks: nblocks})
			if err != nil {
				b.Fatal(err)
			}
			ops := make([]mooncake.Op, len(pops))
			var total int64
			for i, o := range pops {
				ops[i] = mooncake.Op{Local: o.Local, Remote: o.Remote, Length: o.Len}
				total += int64(o.Len)
			}
			srcOf := func(i int) []byte { return at(ops[i].Remote, ops[i].Length) }
			dstOf := func(i int) []byte { return at(ops[i].Local, ops[i].Length) }
			raw := newRawConn(b, srcOf)
			const lanes = 4
			var raws []*rawConn
			for range lanes {
				raws = append(raws, newRawConn(b, srcOf))
			}
			rawN := func() {
				var wg sync.WaitGroup
				per := (len(ops) + lanes - 1) / lanes
				for k, r := range raws {
					first := k * per
					n := min(per, len(ops)-first)
					if n > 0 {
						wg.Go(func() { r.batch(b, first, n, dstOf) })
					}
				}
				wg.Wait()
			}
			ctx := context.Background()
			// Warm up (connections) and verify once.
			if err := cli.BatchRead(ctx, srv.SessionID(), ops); err != nil {
				b.Fatal(err)
			}
			for i := range ops {
				if !bytes.Equal(dstOf(i), srcOf(i)) {
					b.Fatalf("op %d: bytes differ", i)
				}
			}
			raw.batch(b, 0, len(ops), dstOf)
			b.SetBytes(total)
			b.ReportMetric(float64(len(ops)), "ops/request")
			var kv, rawT, rawNT time.Duration
			for b.Loop() {
				t0 := time.Now()
				if err := cli.BatchRead(ctx, srv.SessionID(), ops); err != nil {
					b.Fatal(err)
				}
				kv += time.Since(t0)
				b.StopTimer() // ns/op and MB/s are the engine's
				t0 = time.Now()
				raw.batch(b, 0, len(ops), dstOf)
				rawT += time.Since(t0)
				t0 = time.Now()
				rawN()
				rawNT += time.Since(t0)
				b.StartTimer()
			}
			n := float64(total) * float64(b.N)
			kg, rg, r4 := n/kv.Seconds()/1e9, n/rawT.Seconds()/1e9, n/rawNT.Seconds()/1e9
			b.ReportMetric(kg, "kvflow_GB/s")
			b.ReportMetric(rg, "raw_GB/s")
			b.ReportMetric(r4, "raw4_GB/s")
			b.ReportMetric(kg/rg, "ratio")
			b.ReportMetric(kg/r4, "ratio_raw4")
		})
	}
}
