package npu

import (
	"errors"
	"fmt"
	"math"
)

// Kind is the cache family, which decides how many cache tensors ("parts")
// each layer has. It mirrors the seed's use_mla / use_sparse detection in
// register_kv_caches.
type Kind uint8

const (
	// GQA (and MHA): two parts per layer, K and V, each
	// [num_blocks, block_size, heads, head_dim] (or the flat torchair form
	// [num_blocks, block_size, heads*head_dim], which has the same bytes).
	GQA Kind = iota + 1
	// MLA: two parts per layer of different widths, the compressed latent
	// [num_blocks, block_size, 1, kv_lora_rank] and the rotary key
	// [num_blocks, block_size, 1, qk_rope_head_dim].
	MLA
	// Sparse (DeepSeek V3.2 style MLA with a lightning indexer): three parts per
	// layer, MLA's two plus the indexer key [num_blocks, block_size, 1, indexer_dim].
	Sparse
)

func (k Kind) String() string {
	switch k {
	case GQA:
		return "gqa"
	case MLA:
		return "mla"
	case Sparse:
		return "sparse"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// CacheAlign is the byte alignment of every cache tensor (every entry of
// kv_caches_base_addr) inside the host backend's memory: a page, so that each
// cache can be registered, pinned or advised on its own.
const CacheAlign = 4096

// maxBytes bounds every size kvflow computes (1 PiB): far above any real
// cache, far below int64 overflow.
const maxBytes = 1 << 50

// Shape is the model and cache shape of one worker (one TP/PP rank), as the
// serving engine allocates it. It is comparable: two shapes describe the same
// memory iff they are ==.
type Shape struct {
	NumLayers int // layers on this worker (its PP stage), >= 1
	NumBlocks int // blocks per cache tensor, >= 1
	BlockSize int // tokens per block, >= 1
	DType     DType

	// GQA: KV heads on this rank (max(1, num_key_value_heads / tp_size), as
	// the seed computes it) and the head dimension. Ignored for MLA/Sparse,
	// whose caches have a single "head".
	NumKVHeads int
	HeadDim    int
	// Flat records that the engine views GQA caches in the torchair form
	// [num_blocks, block_size, heads*head_dim]. The bytes, block_len and
	// addresses are the same; it is carried only to describe the memory.
	Flat bool

	// MLA selects the two-part MLA layout.
	MLA           bool
	KVLoraRank    int // width of part 0 (the seed's block_shape_norm)
	QKRopeHeadDim int // width of part 1 (the seed's block_shape_pe)

	// Sparse adds the third part (the seed's block_shape_k). It requires MLA:
	// the seed's sparse path is only coherent on MLA models (ARCHITECTURE §5b.8).
	Sparse     bool
	IndexerDim int // width of part 2
}

// Kind is the cache family the shape selects.
func (s Shape) Kind() Kind {
	switch {
	case s.Sparse:
		return Sparse
	case s.MLA:
		return MLA
	}
	return GQA
}

// ErrInvalidShape is wrapped by every error from Shape.Validate and NewLayout.
var ErrInvalidShape = errors.New("npu: invalid cache shape")

// Validate reports every problem with s, joined, each wrapping ErrInvalidShape.
func (s Shape) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidShape}, args...)...))
	}
	pos := func(name string, v int) {
		if v < 1 {
			bad("%s = %d, must be >= 1", name, v)
		} else if v > math.MaxInt32 {
			bad("%s = %d, must be < 2^31", name, v)
		}
	}
	zero := func(name string, v int, why string) {
		if v != 0 {
			bad("%s = %d set %s", name, v, why)
		}
	}
	pos("num_layers", s.NumLayers)
	pos("num_blocks", s.NumBlocks)
	pos("block_size", s.BlockSize)
	if !s.DType.Valid() {
		bad("dtype %v is not one of bf16, fp16, fp32, int8, fp8", s.DType)
	}
	switch s.Kind() {
	case GQA:
		pos("num_kv_heads", s.NumKVHeads)
		pos("head_dim", s.HeadDim)
		zero("kv_lora_rank", s.KVLoraRank, "without MLA")
		zero("qk_rope_head_dim", s.QKRopeHeadDim, "without MLA")
		zero("indexer_dim", s.IndexerDim, "without sparse")
	case MLA:
		pos("kv_lora_rank", s.KVLoraRank)
		pos("qk_rope_head_dim", s.QKRopeHeadDim)
		zero("indexer_dim", s.IndexerDim, "without sparse")
	case Sparse:
		if !s.MLA {
			bad("sparse without MLA is not supported (the seed mixes MLA and GQA head counts there)")
		}
		pos("kv_lora_rank", s.KVLoraRank)
		pos("qk_rope_head_dim", s.QKRopeHeadDim)
		pos("indexer_dim", s.IndexerDim)
	}
	if s.Flat && s.Kind() != GQA {
		bad("flat applies to GQA caches only")
	}
	if len(errs) == 0 {
		if err := s.checkSizes(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// checkSizes bounds every product the layout computes by maxBytes, so that
// no int64 (or 64-bit int) arithmetic on the shape can overflow.
func (s Shape) checkSizes() error {
	mul := func(a, b int64) (int64, bool) {
		if a != 0 && b > maxBytes/a {
			return 0, false
		}
		return a * b, true
	}
	var perLayer int64
	for _, d := range s.partDims() {
		row, ok1 := mul(int64(d[0]), int64(d[1]))
		row, ok2 := mul(row, int64(s.DType.Size()))
		blk, ok3 := mul(row, int64(s.BlockSize))
		c, ok4 := mul(blk, int64(s.NumBlocks))
		if !ok1 || !ok2 || !ok3 || !ok4 {
			return fmt.Errorf("%w: a cache of %d blocks of %d tokens x %d x %d x %d bytes exceeds 2^50 bytes",
				ErrInvalidShape, s.NumBlocks, s.BlockSize, d[0], d[1], s.DType.Size())
		}
		perLayer += alignUp(c, CacheAlign)
	}
	if _, ok := mul(perLayer, int64(s.NumLayers)); !ok {
		return fmt.Errorf("%w: %d layers of %d bytes exceed 2^50 bytes", ErrInvalidShape, s.NumLayers, perLayer)
	}
	return nil
}

// partDims is (heads, dim) of each part of a layer, in order.
func (s Shape) partDims() [][2]int {
	switch s.Kind() {
	case MLA:
		return [][2]int{{1, s.KVLoraRank}, {1, s.QKRopeHeadDim}}
	case Sparse:
		return [][2]int{{1, s.KVLoraRank}, {1, s.QKRopeHeadDim}, {1, s.IndexerDim}}
	}
	return [][2]int{{s.NumKVHeads, s.HeadDim}, {s.NumKVHeads, s.HeadDim}}
}

// Part describes one cache tensor of a layer (K or V; MLA's latent or rope
// key; the sparse indexer key).
type Part struct {
	Name     string // "k", "v"; "kv_lora", "k_rope"; "indexer_k"
	Heads    int    // heads in a token row (1 for MLA/Sparse parts)
	Dim      int    // elements per head
	RowBytes int    // bytes per token: Heads * Dim * element size
	BlockLen int    // bytes per block: BlockSize * RowBytes (the seed's block_len)
}

func (s Shape) parts() []Part {
	// The seed computes every part's block_len with the element size of part
	// 0 (first_kv_cache[0].element_size()); kvflow has one DType per shape,
	// which is the same thing. Sizes were bounded by checkSizes.
	es := s.DType.Size()
	names := [...]string{"k", "v"}
	if s.Kind() != GQA {
		names = [...]string{"kv_lora", "k_rope"}
	}
	dims := s.partDims()
	out := make([]Part, len(dims))
	for i, d := range dims {
		name := "indexer_k"
		if i < 2 {
			name = names[i]
		}
		row := d[0] * d[1] * es
		out[i] = Part{Name: name, Heads: d[0], Dim: d[1], RowBytes: row, BlockLen: row * s.BlockSize}
	}
	return out
}

// Layout is the byte layout of a worker's caches: the parts of each layer,
// their block lengths, and where each cache tensor sits in one contiguous
// allocation. Caches are numbered in the seed's kv_caches_base_addr order:
// layer-major, part-minor (cache k = layer*NumParts + part; its part is
// k % NumParts, which is the seed's block_len[k % 2] / [k % 3] indexing).
// The zero Layout is invalid; build one with NewLayout.
type Layout struct {
	shape   Shape
	parts   []Part
	offsets []int64 // per cache, seed order, from the start of the data
	size    int64
}

// NewLayout validates s and lays its caches out back to back in seed order,
// each aligned to CacheAlign.
func NewLayout(s Shape) (Layout, error) {
	if err := s.Validate(); err != nil {
		return Layout{}, err
	}
	l := Layout{shape: s, parts: s.parts()}
	n := s.NumLayers * len(l.parts)
	l.offsets = make([]int64, n)
	var off int64
	for k := range n {
		l.offsets[k] = off
		off += alignUp(l.CacheLen(k%len(l.parts)), CacheAlign)
	}
	l.size = off
	return l, nil
}

// Shape is the shape the layout was built from.
func (l Layout) Shape() Shape { return l.shape }

// Kind is the cache family.
func (l Layout) Kind() Kind { return l.shape.Kind() }

// NumParts is the number of cache tensors per layer (the seed's
// num_cache_per_layer): 2 for GQA and MLA, 3 for Sparse.
func (l Layout) NumParts() int { return len(l.parts) }

// Parts returns a copy of the per-layer parts, in order.
func (l Layout) Parts() []Part { return append([]Part(nil), l.parts...) }

// Part returns part i.
func (l Layout) Part(i int) Part { return l.parts[i] }

// BlockLen is the byte length of one block of part i.
func (l Layout) BlockLen(part int) int { return l.parts[part].BlockLen }

// BlockLens is the seed's self.block_len list exactly: one entry for GQA
// (K and V share it, indexed [0]), two for MLA, three for Sparse.
func (l Layout) BlockLens() []int {
	if l.Kind() == GQA {
		return []int{l.parts[0].BlockLen}
	}
	out := make([]int, len(l.parts))
	for i, p := range l.parts {
		out[i] = p.BlockLen
	}
	return out
}

// MaxBlockLen is the largest block length of any part (the scratch size the
// stitch kernel needs).
func (l Layout) MaxBlockLen() int {
	m := 0
	for _, p := range l.parts {
		m = max(m, p.BlockLen)
	}
	return m
}

// NumCaches is the number of cache tensors, len(kv_caches_base_addr).
func (l Layout) NumCaches() int { return len(l.offsets) }

// CacheIndex is the position of (layer, part) in kv_caches_base_addr.
func (l Layout) CacheIndex(layer, part int) int { return layer*len(l.parts) + part }

// CacheOf is the inverse of CacheIndex.
func (l Layout) CacheOf(k int) (layer, part int) { return k / len(l.parts), k % len(l.parts) }

// CacheLen is the byte length of one cache tensor of part i: the region the
// seed registers, num_blocks * block_len[i].
func (l Layout) CacheLen(part int) int64 {
	return int64(l.shape.NumBlocks) * int64(l.parts[part].BlockLen)
}

// Offset is the byte offset of cache (layer, part) from the start of the
// layout's memory.
func (l Layout) Offset(layer, part int) int64 { return l.offsets[l.CacheIndex(layer, part)] }

// Size is the total bytes of the layout's memory, padding included.
func (l Layout) Size() int64 { return l.size }

// CacheName names cache (layer, part), e.g. "layer.3.v": the name of its Region.
func (l Layout) CacheName(layer, part int) string {
	return fmt.Sprintf("layer.%d.%s", layer, l.parts[part].Name)
}

// BaseAddrs is kv_caches_base_addr for memory whose layout starts at base.
func (l Layout) BaseAddrs(base uint64) []uint64 {
	out := make([]uint64, len(l.offsets))
	for k, off := range l.offsets {
		out[k] = base + uint64(off)
	}
	return out
}

// Regions are the seed's (ptrs, lengths) for register_buffer, named, for
// memory whose layout starts at base. Padding is not part of any region.
func (l Layout) Regions(base uint64) []Region {
	out := make([]Region, len(l.offsets))
	for k, off := range l.offsets {
		layer, part := l.CacheOf(k)
		out[k] = Region{Addr: base + uint64(off), Len: uint64(l.CacheLen(part)), Name: l.CacheName(layer, part)}
	}
	return out
}

func alignUp(n, a int64) int64 { return (n + a - 1) / a * a }
