//go:build linux

package npu

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// llamaShape is a Llama-3-8B decode rank (TP 2 of 8 KV heads): 32 layers,
// K and V, block_size 128, 4 heads x 128 dims, bf16 (128 KiB blocks). 32
// blocks per cache make 256 MiB of cache; the copy baseline's destination
// doubles that (512 MiB of setup in all).
var llamaShape = Shape{NumLayers: 32, NumBlocks: 32, BlockSize: 128, NumKVHeads: 4, HeadDim: 128, DType: BF16}

// parallelCopy copies src to dst in chunk-sized pieces shared by workers
// goroutines: the same work split as Stitch, without the reordering.
func parallelCopy(dst, src []byte, chunk, workers int) {
	if workers == 1 {
		copy(dst, src)
		return
	}
	n := (len(src) + chunk - 1) / chunk
	var next atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				end := min((i+1)*chunk, len(src))
				copy(dst[i*chunk:end], src[i*chunk:end])
			}
		})
	}
	wg.Wait()
}

// BenchmarkStitch measures the stitch kernel on 256 MiB of a Llama-3-8B-like
// cache against copy() of the same bytes with the same number of goroutines
// (timed in the same iterations), and reports GB/s and the ratio x_copy.
//
//	go test -run '^$' -bench Stitch -benchtime 20x ./hw/npu/
func BenchmarkStitch(b *testing.B) {
	l, err := NewLayout(llamaShape)
	if err != nil {
		b.Fatal(err)
	}
	all := make([]int, llamaShape.NumBlocks)
	for i := range all {
		all[i] = i
	}
	cacheBytes := int64(l.NumCaches()) * int64(len(all)) * int64(l.BlockLen(0))
	workerCounts := []int{1}
	if n := runtime.GOMAXPROCS(0); n > 1 {
		workerCounts = append(workerCounts, n)
	}
	var h *Host
	var dst []byte
	setup := func(b *testing.B) {
		if h != nil {
			return
		}
		if h, err = NewHost(l, HostOptions{}); err != nil {
			b.Fatal(err)
		}
		dst = make([]byte, l.Size())
		for i := range h.Data() { // fault the pages in
			h.Data()[i] = byte(i * 7)
		}
		copy(dst, h.Data())
	}
	b.Cleanup(func() {
		if h != nil {
			h.Close()
		}
	})
	for _, w := range workerCounts {
		b.Run(fmt.Sprintf("copy/workers=%d", w), func(b *testing.B) {
			setup(b)
			b.SetBytes(l.Size())
			for b.Loop() {
				parallelCopy(dst, h.Data(), l.BlockLen(0), w)
			}
			b.ReportMetric(float64(l.Size())*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
	for _, p := range []int{2, 4} {
		for _, w := range workerCounts {
			b.Run(fmt.Sprintf("stitch/P=%d/workers=%d", p, w), func(b *testing.B) {
				setup(b)
				h.opts.Workers = w
				ctx := context.Background()
				b.SetBytes(cacheBytes)
				// Each iteration also runs the copy baseline, untimed by b
				// but timed here, so both see the same machine conditions.
				var copyTime time.Duration
				for b.Loop() {
					b.StopTimer()
					start := time.Now()
					parallelCopy(dst, h.Data(), l.BlockLen(0), w)
					copyTime += time.Since(start)
					b.StartTimer()
					if err := h.Stitch(ctx, all, p); err != nil {
						b.Fatal(err)
					}
				}
				gbps := float64(cacheBytes) * float64(b.N) / b.Elapsed().Seconds() / 1e9
				base := float64(l.Size()) * float64(b.N) / copyTime.Seconds() / 1e9
				b.ReportMetric(gbps, "GB/s")
				b.ReportMetric(base, "copy_GB/s")
				b.ReportMetric(gbps/base, "x_copy")
			})
		}
	}
}
