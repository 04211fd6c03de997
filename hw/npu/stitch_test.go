package npu

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvflow/kvflow/internal/tooling/testkit"
)

func putInt32s(dst []byte, v []int64) {
	for i, x := range v {
		binary.LittleEndian.PutUint32(dst[4*i:], uint32(int32(x)))
	}
}

func getInt32s(src []byte) []int64 {
	out := make([]int64, len(src)/4)
	for i := range out {
		out[i] = int64(int32(binary.LittleEndian.Uint32(src[4*i:])))
	}
	return out
}

func newTestHost(t testing.TB, s Shape, opts HostOptions) *Host {
	t.Helper()
	l, err := NewLayout(s)
	if err != nil {
		t.Fatal(err)
	}
	h, err := NewHost(l, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// TestHeadTransposeVectors runs every head_transpose.json case through the
// host backend: "transpose" cases as one cache of all their blocks (written
// to K and V), "cat_kv_cache" cases as the seed's whole per-layer caches,
// blocks not listed included.
func TestHeadTransposeVectors(t *testing.T) {
	var f struct {
		Cases []struct {
			Kind      string  `json:"kind"`
			NumBlocks int     `json:"num_blocks"`
			P         int     `json:"tp_num_need_pulls"`
			BlockSize int     `json:"block_size"`
			Heads     int     `json:"num_kv_head"`
			HeadDim   int     `json:"head_dim"`
			Input     []int64 `json:"input"`
			Output    []int64 `json:"output"`

			CacheShape []int                `json:"cache_shape"`
			BlockIDs   [][]int              `json:"block_ids"`
			KVHeads    int                  `json:"num_key_value_heads"`
			TPSize     int                  `json:"tp_size"`
			Before     map[string][][]int64 `json:"caches_before"`
			After      map[string][][]int64 `json:"caches_after"`
		} `json:"cases"`
	}
	testkit.SeedrefJSON(t, "head_transpose.json", &f)
	kinds := map[string]int{}
	for i, c := range f.Cases {
		kinds[c.Kind]++
		t.Run(fmt.Sprintf("%d_%s", i, c.Kind), func(t *testing.T) {
			ctx := context.Background()
			switch c.Kind {
			case "transpose":
				h := newTestHost(t, Shape{NumLayers: 1, NumBlocks: c.NumBlocks, BlockSize: c.BlockSize, NumKVHeads: c.Heads, HeadDim: c.HeadDim, DType: FP32}, HostOptions{NoHugePages: true})
				for part := range 2 {
					putInt32s(h.Bytes(0, part), c.Input)
				}
				all := make([]int, c.NumBlocks)
				for b := range all {
					all[b] = b
				}
				if err := h.Stitch(ctx, all, c.P); err != nil {
					t.Fatal(err)
				}
				for part := range 2 {
					if got := getInt32s(h.Bytes(0, part)); !slices.Equal(got, c.Output) {
						t.Errorf("part %d:\n got %v\nwant %v", part, got, c.Output)
					}
				}
			case "cat_kv_cache":
				nb, bs, heads, hd := c.CacheShape[0], c.CacheShape[1], c.CacheShape[2], c.CacheShape[3]
				if want := max(c.KVHeads/c.TPSize, 1); heads != want {
					t.Fatalf("cache heads %d, the seed's num_kv_head %d", heads, want)
				}
				layers := len(c.Before)
				h := newTestHost(t, Shape{NumLayers: layers, NumBlocks: nb, BlockSize: bs, NumKVHeads: heads, HeadDim: hd, DType: FP32}, HostOptions{NoHugePages: true})
				for layer := range layers {
					for part, v := range c.Before[fmt.Sprintf("layer%d", layer)] {
						putInt32s(h.Bytes(layer, part), v)
					}
				}
				var ids []int
				for _, g := range c.BlockIDs {
					ids = append(ids, g...)
				}
				if err := h.Stitch(ctx, ids, c.P); err != nil {
					t.Fatal(err)
				}
				for layer := range layers {
					for part, want := range c.After[fmt.Sprintf("layer%d", layer)] {
						if got := getInt32s(h.Bytes(layer, part)); !slices.Equal(got, want) {
							t.Errorf("layer %d part %d:\n got %v\nwant %v", layer, part, got, want)
						}
					}
				}
			default:
				t.Fatalf("unknown kind %q", c.Kind)
			}
		})
	}
	if kinds["transpose"] == 0 || kinds["cat_kv_cache"] == 0 {
		t.Errorf("case kinds %v", kinds)
	}
}

// naiveStitch is the reference: element by element, straight from the
// seed's view(num_blocks, P, block_size, -1).transpose(1, 2): output
// [t][q][j] = input [q][t][j], j over the slice's bytes.
func naiveStitch(block []byte, rows, p int) []byte {
	chunk := len(block) / rows / p
	out := make([]byte, len(block))
	for tok := range rows {
		for q := range p {
			for j := range chunk {
				out[(tok*p+q)*chunk+j] = block[(q*rows+tok)*chunk+j]
			}
		}
	}
	return out
}

func fillRandom(r *rand.Rand, b []byte) {
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], r.Uint64())
	}
	for i := len(b) &^ 7; i < len(b); i++ {
		b[i] = byte(r.Uint32())
	}
}

// TestStitchProperty compares Stitch with naiveStitch on random shapes,
// dtypes, block subsets and worker counts; unlisted blocks and the padding
// between caches must not change.
func TestStitchProperty(t *testing.T) {
	r := rand.New(rand.NewPCG(4, 2026))
	dtypes := []DType{BF16, FP16, FP32, INT8, FP8}
	iters := 40
	if testing.Short() {
		iters = 10
	}
	for it := range iters {
		p := []int{2, 4, 8}[r.IntN(3)]
		bs := []int{16, 64, 128}[r.IntN(3)]
		var heads, hd int
		if r.IntN(4) == 0 { // fewer heads than P: slices split a head
			heads, hd = 1+r.IntN(p-1), p*(1+r.IntN(8))
		} else {
			heads, hd = p*(1+r.IntN(2)), []int{8, 16, 64, 128}[r.IntN(4)]
		}
		s := Shape{NumLayers: 1 + r.IntN(3), NumBlocks: 2 + r.IntN(6), BlockSize: bs, NumKVHeads: heads, HeadDim: hd, DType: dtypes[r.IntN(len(dtypes))], Flat: r.IntN(2) == 0}
		if (heads*hd)%p != 0 {
			continue
		}
		workers := 1 + r.IntN(4)
		name := fmt.Sprintf("%d_p%d_bs%d_h%d_d%d_%v_L%d_N%d_w%d", it, p, bs, heads, hd, s.DType, s.NumLayers, s.NumBlocks, workers)
		t.Run(name, func(t *testing.T) {
			h := newTestHost(t, s, HostOptions{NoHugePages: true, StitchWorkers: workers})
			l := h.Layout()
			fillRandom(r, h.Data())
			before := bytes.Clone(h.Data())
			ids := r.Perm(s.NumBlocks)[:1+r.IntN(s.NumBlocks)]
			if err := h.Stitch(context.Background(), ids, p); err != nil {
				t.Fatal(err)
			}
			listed := map[int]bool{}
			for _, b := range ids {
				listed[b] = true
			}
			want := bytes.Clone(before)
			for k := range l.NumCaches() {
				layer, part := l.CacheOf(k)
				bl := l.BlockLen(part)
				for _, b := range ids {
					off := int(l.Offset(layer, part)) + b*bl
					copy(want[off:off+bl], naiveStitch(before[off:off+bl], bs, p))
				}
			}
			if !bytes.Equal(h.Data(), want) {
				for k := range l.NumCaches() {
					layer, part := l.CacheOf(k)
					for b := range s.NumBlocks {
						g, w := h.Block(layer, part, b), want[int(l.Offset(layer, part))+b*l.BlockLen(part):][:l.BlockLen(part)]
						if !bytes.Equal(g, w) {
							t.Errorf("layer %d part %d block %d (listed %v) differs", layer, part, b, listed[b])
						}
					}
				}
				t.Fatal("memory differs from the reference (padding?)")
			}
		})
	}
}

func TestStitchBlock(t *testing.T) {
	block := []byte("aabbccddAABBCCDD") // P=2 planes of 4 rows of 2 bytes
	if err := StitchBlock(block, make([]byte, 16), 4, 2); err != nil {
		t.Fatal(err)
	}
	if got := string(block); got != "aaAAbbBBccCCddDD" {
		t.Errorf("got %q", got)
	}
	for _, c := range []struct {
		n, scratch, rows, p int
		want                string
	}{
		{16, 16, 0, 2, "rows 0"},
		{16, 16, 4, 0, "p 0"},
		{0, 16, 4, 2, "0 bytes"},
		{15, 16, 4, 2, "not 4 rows"},
		{12, 16, 4, 2, "do not split"},
		{16, 8, 4, 2, "scratch"},
	} {
		b := bytes.Repeat([]byte{7}, c.n)
		err := StitchBlock(b, make([]byte, c.scratch), c.rows, c.p)
		if !errors.Is(err, ErrInvalidStitch) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v", c, err)
		}
		if !bytes.Equal(b, bytes.Repeat([]byte{7}, c.n)) {
			t.Errorf("%+v: block changed", c)
		}
	}
	b := []byte("abcd")
	if err := StitchBlock(b, make([]byte, 4), 2, 1); err != nil || string(b) != "abcd" {
		t.Errorf("p=1: %q %v", b, err)
	}
}

// TestStitchBadInput: every rejected request leaves memory as it was.
func TestStitchBadInput(t *testing.T) {
	gqa := Shape{NumLayers: 2, NumBlocks: 4, BlockSize: 16, NumKVHeads: 2, HeadDim: 6, DType: BF16}
	mla := Shape{NumLayers: 2, NumBlocks: 4, BlockSize: 16, DType: BF16, MLA: true, KVLoraRank: 512, QKRopeHeadDim: 64}
	sparse := mla
	sparse.Sparse, sparse.IndexerDim = true, 128
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, c := range []struct {
		name  string
		shape Shape
		ctx   context.Context
		ids   []int
		p     int
		want  string
		is    error
	}{
		{"p zero", gqa, nil, []int{0}, 0, "must be >= 1", ErrInvalidStitch},
		{"p negative", gqa, nil, []int{0}, -2, "must be >= 1", ErrInvalidStitch},
		{"p does not divide rows", gqa, nil, []int{0}, 5, "do not split into 5", ErrInvalidStitch},
		{"p larger than row", gqa, nil, []int{0}, 24, "do not split", ErrInvalidStitch},
		{"mla p2", mla, nil, []int{0}, 2, "mla layout", ErrInvalidStitch},
		{"sparse p2", sparse, nil, []int{0}, 2, "sparse layout", ErrInvalidStitch},
		{"block out of range", gqa, nil, []int{0, 4}, 2, "block id 4 (index 1) out of range [0, 4)", ErrInvalidStitch},
		{"negative block", gqa, nil, []int{-1}, 2, "block id -1", ErrInvalidStitch},
		{"duplicate block", gqa, nil, []int{1, 2, 1}, 2, "block id 1 listed twice", ErrInvalidStitch},
		{"duplicate block p1", gqa, nil, []int{3, 3}, 1, "listed twice", ErrInvalidStitch},
		{"out of range p1", gqa, nil, []int{9}, 1, "out of range", ErrInvalidStitch},
		{"cancelled", gqa, cancelled, []int{0, 1}, 2, "not started", context.Canceled},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newTestHost(t, c.shape, HostOptions{NoHugePages: true})
			fillRandom(rand.New(rand.NewPCG(1, 2)), h.Data())
			before := bytes.Clone(h.Data())
			ctx := c.ctx
			if ctx == nil {
				ctx = context.Background()
			}
			err := h.Stitch(ctx, c.ids, c.p)
			if err == nil || !errors.Is(err, c.is) || !strings.Contains(err.Error(), c.want) {
				t.Errorf("Stitch(%v, %d) = %v; want %q (%v)", c.ids, c.p, err, c.want, c.is)
			}
			if !bytes.Equal(before, h.Data()) {
				t.Error("memory changed")
			}
		})
	}
	// Valid no-ops.
	h := newTestHost(t, mla, HostOptions{NoHugePages: true})
	fillRandom(rand.New(rand.NewPCG(1, 3)), h.Data())
	before := bytes.Clone(h.Data())
	for _, c := range []struct {
		ids []int
		p   int
	}{{[]int{0, 1, 2, 3}, 1}, {nil, 1}, {nil, 2 - 1}} {
		if err := h.Stitch(context.Background(), c.ids, c.p); err != nil {
			t.Errorf("Stitch(%v, %d) = %v", c.ids, c.p, err)
		}
	}
	g := newTestHost(t, gqa, HostOptions{NoHugePages: true})
	if err := g.Stitch(context.Background(), nil, 2); err != nil {
		t.Errorf("empty block list: %v", err)
	}
	if !bytes.Equal(before, h.Data()) {
		t.Error("p=1 changed memory")
	}
	if err := StitchMemory(context.Background(), g.Layout(), g.Data()[:100], []int{0}, 2, StitchOptions{}); !errors.Is(err, ErrInvalidStitch) {
		t.Errorf("short memory: %v", err)
	}
	if err := (Layout{}).ValidateStitch(nil, 1); !errors.Is(err, ErrInvalidStitch) {
		t.Errorf("zero layout: %v", err)
	}
}

// countdownCtx reports cancellation after its Err has been asked n times.
type countdownCtx struct {
	context.Context
	n atomic.Int64
}

func (c *countdownCtx) Err() error {
	if c.n.Add(-1) < 0 {
		return context.Canceled
	}
	return nil
}

// TestStitchCancelMidway: a cancelled stitch stops, says so, and leaves
// every block either fully stitched or untouched.
func TestStitchCancelMidway(t *testing.T) {
	s := Shape{NumLayers: 3, NumBlocks: 8, BlockSize: 16, NumKVHeads: 4, HeadDim: 8, DType: FP16}
	for _, workers := range []int{1, 3} {
		t.Run(fmt.Sprint("workers", workers), func(t *testing.T) {
			h := newTestHost(t, s, HostOptions{NoHugePages: true, StitchWorkers: workers})
			fillRandom(rand.New(rand.NewPCG(9, 9)), h.Data())
			before := bytes.Clone(h.Data())
			ctx := &countdownCtx{Context: context.Background()}
			ctx.n.Store(10)
			ids := []int{7, 0, 3, 5, 1}
			err := h.Stitch(ctx, ids, 4)
			if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "interrupted") {
				t.Fatalf("Stitch = %v", err)
			}
			l := h.Layout()
			done := 0
			for k := range l.NumCaches() {
				layer, part := l.CacheOf(k)
				bl := l.BlockLen(part)
				for _, b := range ids {
					off := int(l.Offset(layer, part)) + b*bl
					orig := before[off : off+bl]
					switch got := h.Block(layer, part, b); {
					case bytes.Equal(got, naiveStitch(orig, s.BlockSize, 4)):
						done++
					case !bytes.Equal(got, orig):
						t.Errorf("layer %d part %d block %d torn", layer, part, b)
					}
				}
			}
			if done == 0 || done == len(ids)*l.NumCaches() {
				t.Errorf("%d of %d blocks stitched: not midway", done, len(ids)*l.NumCaches())
			}
		})
	}
}

// TestStitchConcurrent: Stitch calls on disjoint blocks may run together,
// and Close waits for them.
func TestStitchConcurrent(t *testing.T) {
	s := Shape{NumLayers: 4, NumBlocks: 16, BlockSize: 64, NumKVHeads: 4, HeadDim: 32, DType: BF16}
	l, _ := NewLayout(s)
	h, err := NewHost(l, HostOptions{StitchWorkers: 2})
	if err != nil {
		t.Fatal(err)
	}
	fillRandom(rand.New(rand.NewPCG(5, 5)), h.Data())
	before := bytes.Clone(h.Data())
	errs := make(chan error, 4)
	for g := range 4 {
		go func() { errs <- h.Stitch(context.Background(), []int{g, g + 4, g + 8, g + 12}, 2) }()
	}
	for range 4 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for k := range l.NumCaches() {
		layer, part := l.CacheOf(k)
		for b := range s.NumBlocks {
			off := int(l.Offset(layer, part)) + b*l.BlockLen(part)
			if !bytes.Equal(h.Block(layer, part, b), naiveStitch(before[off:off+l.BlockLen(part)], s.BlockSize, 2)) {
				t.Fatalf("layer %d part %d block %d wrong", layer, part, b)
			}
		}
	}
	go h.Stitch(context.Background(), []int{0, 1, 2}, 2)
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if err := h.Stitch(context.Background(), []int{0}, 2); !errors.Is(err, ErrClosed) {
		t.Errorf("Stitch after Close = %v", err)
	}
}
