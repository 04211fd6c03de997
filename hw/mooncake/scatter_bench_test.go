package mooncake

import (
	"fmt"
	"testing"
)

// BenchmarkScatterRows: the strided receive's copy out of the lane buffer
// (64 KiB answers as 512-byte rows, 1024 apart) against one contiguous
// copy of the same bytes, both into 256 MiB of destination (cold).
func BenchmarkScatterRows(b *testing.B) {
	const n, dstLen = 64 << 10, 256 << 20
	src := make([]byte, n)
	dst := mmap(b, dstLen)
	for i := range dst {
		dst[i] = 1
	}
	b.Run("copy", func(b *testing.B) {
		b.SetBytes(n)
		off := 0
		for b.Loop() {
			copy(dst[off:off+n], src)
			off = (off + 2*n) % (dstLen - 2*n)
		}
	})
	for _, s := range []Stride{{Row: 512, Pitch: 512}, {Row: 512, Pitch: 1024}, {Row: 256, Pitch: 1024}} {
		b.Run(fmt.Sprintf("rows%d-%d", s.Row, s.Pitch), func(b *testing.B) {
			b.SetBytes(n)
			off := 0
			for b.Loop() {
				scatterRows(AddrOf(dst[off:]), s, 0, src)
				off = (off + 4*n) % (dstLen - 4*n)
			}
		})
	}
}
