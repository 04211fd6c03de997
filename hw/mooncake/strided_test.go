package mooncake

import (
	"bytes"
	"context"
	"errors"
	"testing"
)

// TestBatchReadStrided reads over real loopback sockets with a stride and
// checks every byte against a naive row-by-row placement of the same
// remote bytes: merged requests (small remote-contiguous ops), ops split
// into several requests at a chunk boundary in the middle of a row, and a
// stride whose rows touch (Pitch == Row, a plain read). Bytes between the
// rows are never written.
func TestBatchReadStrided(t *testing.T) {
	srv, _ := newEngine(t, testConfig())
	cfg := testConfig()
	cfg.ChunkSize = 64 << 10
	cli, _ := newEngine(t, cfg)
	const remoteLen, localLen = 2 << 20, 4 << 20
	rem := register(t, srv, remoteLen, 3)
	loc := register(t, cli, localLen, 0)
	base, rbase := AddrOf(loc), AddrOf(rem)

	// interleaved: the slices of two "prefill ranks" for 16 blocks of
	// 128 rows, as the fused head transpose asks for them: block b's
	// slot q op reads 128*512 remote bytes into rows of 512 bytes,
	// 1024 apart, from block b's start + q*512.
	var interleaved []Op
	for q := range 2 {
		for b := range 16 {
			interleaved = append(interleaved, Op{
				Local:  base + uint64(b)*128*1024 + uint64(q)*512,
				Remote: rbase + uint64(q)*(16*128*512) + uint64(b)*128*512,
				Length: 128 * 512,
			})
		}
	}
	for _, tc := range []struct {
		name string
		ops  []Op
		s    Stride
	}{
		{"interleaved, merged", interleaved, Stride{Row: 512, Pitch: 1024}},
		{"split mid-row", []Op{{Local: base + 7, Remote: rbase + 100, Length: 768 * 300}, {Local: base + 2<<20, Remote: rbase + 300000, Length: 768}},
			Stride{Row: 768, Pitch: 2000}},
		{"rows touch", []Op{{Local: base, Remote: rbase, Length: 512 * 1000}}, Stride{Row: 512, Pitch: 512}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for i := range loc {
				loc[i] = 0xEE
			}
			want := bytes.Clone(loc)
			for _, op := range tc.ops {
				src := rem[op.Remote-rbase:][:op.Length]
				for i := uint64(0); i < op.Length; i++ {
					want[op.Local-base+(i/tc.s.Row)*tc.s.Pitch+i%tc.s.Row] = src[i]
				}
			}
			if err := cli.BatchReadStrided(context.Background(), srv.SessionID(), tc.ops, tc.s); err != nil {
				t.Fatal(err)
			}
			if i := firstDiff(loc, want); i < len(loc) {
				t.Fatalf("byte %d: got %#x, want %#x", i, loc[i], want[i])
			}
		})
	}
}

// TestBatchReadStridedBadInput: a stride that does not fit its ops, or
// rows that leave the registered memory, fail the whole batch before any
// I/O with an error per op; local memory is untouched.
func TestBatchReadStridedBadInput(t *testing.T) {
	srv, _ := newEngine(t, testConfig())
	cli, _ := newEngine(t, testConfig())
	rem := register(t, srv, 1<<16, 3)
	loc := register(t, cli, 1<<16, 0)
	before := bytes.Clone(loc)
	op := Op{Local: AddrOf(loc), Remote: AddrOf(rem), Length: 4096}
	for _, tc := range []struct {
		name string
		ops  []Op
		s    Stride
		want error
	}{
		{"zero row", []Op{op}, Stride{Row: 0, Pitch: 64}, ErrNotAttempted},
		{"pitch below row", []Op{op}, Stride{Row: 128, Pitch: 64}, ErrNotAttempted},
		{"partial row", []Op{op}, Stride{Row: 1000, Pitch: 2000}, ErrNotAttempted},
		{"rows past the region", []Op{op}, Stride{Row: 512, Pitch: 16 << 10}, ErrNotRegistered},
		{"extent wraps", []Op{{Local: AddrOf(loc), Remote: AddrOf(rem), Length: 3}}, Stride{Row: 1, Pitch: 1 << 63}, ErrNotAttempted},
		{"huge extent", []Op{{Local: AddrOf(loc), Remote: AddrOf(rem), Length: 1 << 40}}, Stride{Row: 1 << 10, Pitch: 1<<31 - 1}, ErrNotRegistered},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := cli.BatchReadStrided(context.Background(), srv.SessionID(), tc.ops, tc.s)
			var be *BatchError
			if !errors.As(err, &be) || len(be.Errs) != len(tc.ops) {
				t.Fatalf("got %v, want a BatchError with %d errors", err, len(tc.ops))
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
			if !bytes.Equal(loc, before) {
				t.Fatal("local memory was written")
			}
		})
	}
}

// TestScatterRows: every split of an op's bytes into pieces, starting and
// ending anywhere in a row, lands each byte where Stride says.
func TestScatterRows(t *testing.T) {
	for _, s := range []Stride{{Row: 1, Pitch: 1}, {Row: 3, Pitch: 5}, {Row: 8, Pitch: 8}, {Row: 16, Pitch: 40},
		{Row: 512, Pitch: 1024}, {Row: 320, Pitch: 328}} { // the last two: rows long enough for copyOut's stores
		rows := 7
		if s.Row > 64 {
			rows = 3
		}
		n := int(s.Row) * rows
		cuts := []int{}
		for a := 0; a <= n; a++ {
			if s.Row <= 64 || a%int(s.Row) < 2 || a%int(s.Row) > int(s.Row)-2 || a%97 == 0 {
				cuts = append(cuts, a)
			}
		}
		src := make([]byte, n)
		for i := range src {
			src[i] = byte(i + 1)
		}
		want := make([]byte, int(s.Extent(uint64(n))))
		for i := range n {
			want[uint64(i)/s.Row*s.Pitch+uint64(i)%s.Row] = src[i]
		}
		for _, a := range cuts {
			for _, b := range cuts {
				if b < a {
					continue
				}
				dst := make([]byte, len(want)+1) // one guard byte
				// Only the piece [a, b) is copied: compare it alone.
				scatterRows(AddrOf(dst), s, uint64(a), src[a:b])
				storeFence()
				for i := range n {
					at := uint64(i)/s.Row*s.Pitch + uint64(i)%s.Row
					if exp := byte(0); i >= a && i < b {
						exp = want[at]
						if dst[at] != exp {
							t.Fatalf("stride %+v piece [%d,%d): byte %d at %d = %d, want %d", s, a, b, i, at, dst[at], exp)
						}
					} else if dst[at] != 0 {
						t.Fatalf("stride %+v piece [%d,%d): byte %d at %d written", s, a, b, i, at)
					}
				}
				if dst[len(want)] != 0 {
					t.Fatalf("stride %+v piece [%d,%d): wrote past the extent", s, a, b)
				}
			}
		}
	}
}

// TestCopyOut: copyOut (non-temporal stores for the aligned middle)
// copies exactly, for every length and alignment of either side, and
// writes nothing outside dst.
func TestCopyOut(t *testing.T) {
	src := make([]byte, 8192)
	for i := range src {
		src[i] = byte(i*31 + 7)
	}
	buf := make([]byte, 8192+128)
	for _, n := range []int{0, 1, 63, 64, 255, 256, 257, 511, 512, 1000, 4096, 4159, 8000} {
		for da := 0; da < 64; da += 7 {
			for sa := 0; sa < 64; sa += 13 {
				if sa+n > len(src) {
					continue
				}
				clear(buf)
				copyOut(buf[da:da+n], src[sa:sa+n])
				storeFence()
				if !bytes.Equal(buf[da:da+n], src[sa:sa+n]) {
					t.Fatalf("n %d dst+%d src+%d: bytes differ", n, da, sa)
				}
				for i, b := range buf {
					if (i < da || i >= da+n) && b != 0 {
						t.Fatalf("n %d dst+%d src+%d: byte %d outside dst written", n, da, sa, i)
					}
				}
			}
		}
	}
}
