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
