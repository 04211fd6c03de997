//go:build linux

package bench

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvflow/kvflow/hw/npu"
)

// BenchmarkStitch is the stitch stage's kernel (npu.Host.Stitch) on one
// request's 16 blocks of a Llama-3-8B-like decode rank at TP 2 (32 layers,
// K and V, 4 KV heads × 128, block 128, bf16: 8 MiB per block, 128 MiB per
// request), for P = 2 and 4 head slots, against copy() of the same bytes
// (one memmove from the cache into a second buffer), interleaved in the
// same iterations. Reports kvflow_GB/s, copy_GB/s and ratio = kvflow /
// copy. 256 MiB of memory.
//
//	go test -run '^$' -bench Stitch -benchtime 10x ./bench/
func BenchmarkStitch(b *testing.B) {
	shape := npu.Shape{NumLayers: 32, NumBlocks: 16, BlockSize: 128, NumKVHeads: 4, HeadDim: 128, DType: npu.BF16}
	l, err := npu.NewLayout(shape)
	if err != nil {
		b.Fatal(err)
	}
	h, err := npu.NewHost(l, npu.HostOptions{NoHugePages: true})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { h.Close() })
	data := h.Data()
	for i := range data {
		data[i] = byte(i * 7)
	}
	dst := make([]byte, len(data))
	copy(dst, data)
	blocks := make([]int, shape.NumBlocks)
	for i := range blocks {
		blocks[i] = i
	}
	reqBytes := int64(shape.NumBlocks) * int64(l.NumCaches()) * int64(l.BlockLen(0))
	for _, p := range []int{2, 4} {
		b.Run(fmt.Sprintf("P=%d", p), func(b *testing.B) {
			ctx := context.Background()
			b.SetBytes(reqBytes)
			var kv, base time.Duration
			for b.Loop() {
				t0 := time.Now()
				if err := h.Stitch(ctx, blocks, p); err != nil {
					b.Fatal(err)
				}
				kv += time.Since(t0)
				b.StopTimer() // ns/op and MB/s are the kernel's
				t0 = time.Now()
				copy(dst, data[:reqBytes])
				base += time.Since(t0)
				b.StartTimer()
			}
			total := float64(reqBytes) * float64(b.N)
			b.ReportMetric(total/kv.Seconds()/1e9, "kvflow_GB/s")
			b.ReportMetric(total/base.Seconds()/1e9, "copy_GB/s")
			b.ReportMetric(float64(base)/float64(kv), "ratio")
		})
	}
}
