package npu

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvflow/kvflow/internal/tooling/testkit"
)

func TestDType(t *testing.T) {
	for _, c := range []struct {
		names []string
		d     DType
		size  int
	}{
		{[]string{"bf16", "bfloat16", "torch.bfloat16", " BF16 "}, BF16, 2},
		{[]string{"fp16", "float16", "half"}, FP16, 2},
		{[]string{"fp32", "float32", "float"}, FP32, 4},
		{[]string{"int8"}, INT8, 1},
		{[]string{"fp8", "fp8_e4m3", "fp8_e5m2", "float8_e4m3fn"}, FP8, 1},
	} {
		for _, n := range c.names {
			d, err := ParseDType(n)
			if err != nil || d != c.d {
				t.Errorf("ParseDType(%q) = %v, %v; want %v", n, d, err, c.d)
			}
		}
		if c.d.Size() != c.size || !c.d.Valid() {
			t.Errorf("%v.Size() = %d, want %d", c.d, c.d.Size(), c.size)
		}
		if d, _ := ParseDType(c.d.String()); d != c.d {
			t.Errorf("String/Parse round trip of %v", c.d)
		}
	}
	if _, err := ParseDType("int4"); err == nil {
		t.Error("ParseDType(int4) succeeded")
	}
	if DType(0).Valid() || DType(0).Size() != 0 || DType(99).Size() != 0 {
		t.Error("invalid DType reported valid")
	}
}

// seedTensor is a cache tensor as register_kv_caches sees it: its shape,
// data_ptr() and element_size().
type seedTensor struct {
	shape []int
	ptr   uint64
	elem  int
}

func prod(xs []int) int {
	p := 1
	for _, x := range xs {
		p *= x
	}
	return p
}

// seedRegister is a line-by-line port of the seed's register_kv_caches
// (block_len, kv_caches_base_addr, and register_buffer's ptrs/lengths).
func seedRegister(layers [][]seedTensor) (blockLen []int, baseAddr, ptrs, lengths []uint64) {
	first := layers[0]
	f0 := first[0]
	useMLA := len(first) == 2 && f0.shape[len(f0.shape)-1] != first[1].shape[len(first[1].shape)-1]
	useSparse := len(first) == 3
	numBlocks := f0.shape[0]
	last3 := func(s []int) []int { return s[len(s)-3:] }
	switch {
	case useMLA:
		blockLen = []int{f0.elem * prod(last3(first[0].shape)), f0.elem * prod(last3(first[1].shape))}
	case useSparse:
		blockLen = []int{f0.elem * prod(last3(first[0].shape)), f0.elem * prod(last3(first[1].shape)), f0.elem * prod(last3(first[2].shape))}
	default:
		rank := len(f0.shape) - 1
		blockLen = []int{f0.elem * prod(f0.shape[len(f0.shape)-rank:])}
	}
	for _, caches := range layers {
		for i, c := range caches {
			var regionLen int
			switch {
			case useMLA:
				regionLen = numBlocks * blockLen[i%2]
			case useSparse:
				regionLen = numBlocks * blockLen[i%3]
			default:
				regionLen = numBlocks * blockLen[0]
			}
			baseAddr = append(baseAddr, c.ptr)
			ptrs = append(ptrs, c.ptr)
			lengths = append(lengths, uint64(regionLen))
		}
	}
	return
}

func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

// seedTensors builds the tensors the serving engine would hand the seed for
// shape s, with data pointers taken from h's (layer, part) memory.
func seedTensors(s Shape, h *Host) [][]seedTensor {
	e := s.DType.Size()
	var dims [][]int
	switch {
	case s.Sparse:
		dims = [][]int{{s.NumBlocks, s.BlockSize, 1, s.KVLoraRank}, {s.NumBlocks, s.BlockSize, 1, s.QKRopeHeadDim}, {s.NumBlocks, s.BlockSize, 1, s.IndexerDim}}
	case s.MLA:
		dims = [][]int{{s.NumBlocks, s.BlockSize, 1, s.KVLoraRank}, {s.NumBlocks, s.BlockSize, 1, s.QKRopeHeadDim}}
	case s.Flat:
		dims = [][]int{{s.NumBlocks, s.BlockSize, s.NumKVHeads * s.HeadDim}, {s.NumBlocks, s.BlockSize, s.NumKVHeads * s.HeadDim}}
	default:
		dims = [][]int{{s.NumBlocks, s.BlockSize, s.NumKVHeads, s.HeadDim}, {s.NumBlocks, s.BlockSize, s.NumKVHeads, s.HeadDim}}
	}
	var out [][]seedTensor
	for layer := range s.NumLayers {
		var ts []seedTensor
		for part, d := range dims {
			ts = append(ts, seedTensor{shape: d, ptr: addrOf(h.Bytes(layer, part)), elem: e})
		}
		out = append(out, ts)
	}
	return out
}

var layoutCases = []struct {
	name      string
	shape     Shape
	blockLens []int
	parts     int
}{
	{"llama3-8b tp2 bf16", Shape{NumLayers: 32, NumBlocks: 7, BlockSize: 128, NumKVHeads: 4, HeadDim: 128, DType: BF16}, []int{128 * 4 * 128 * 2}, 2},
	{"gqa flat fp16", Shape{NumLayers: 3, NumBlocks: 5, BlockSize: 16, NumKVHeads: 2, HeadDim: 64, DType: FP16, Flat: true}, []int{16 * 2 * 64 * 2}, 2},
	{"gqa fp32", Shape{NumLayers: 2, NumBlocks: 3, BlockSize: 64, NumKVHeads: 1, HeadDim: 80, DType: FP32}, []int{64 * 80 * 4}, 2},
	{"gqa int8", Shape{NumLayers: 2, NumBlocks: 3, BlockSize: 16, NumKVHeads: 8, HeadDim: 128, DType: INT8}, []int{16 * 8 * 128}, 2},
	{"gqa fp8 odd", Shape{NumLayers: 1, NumBlocks: 1, BlockSize: 3, NumKVHeads: 3, HeadDim: 5, DType: FP8}, []int{45}, 2},
	{"mla deepseek bf16", Shape{NumLayers: 4, NumBlocks: 6, BlockSize: 16, DType: BF16, MLA: true, KVLoraRank: 512, QKRopeHeadDim: 64}, []int{16384, 2048}, 2},
	{"mla int8 bs128", Shape{NumLayers: 2, NumBlocks: 2, BlockSize: 128, DType: INT8, MLA: true, KVLoraRank: 512, QKRopeHeadDim: 64}, []int{65536, 8192}, 2},
	{"sparse deepseek v3.2", Shape{NumLayers: 3, NumBlocks: 4, BlockSize: 16, DType: BF16, MLA: true, KVLoraRank: 512, QKRopeHeadDim: 64, Sparse: true, IndexerDim: 128}, []int{16384, 2048, 4096}, 3},
	{"sparse fp32", Shape{NumLayers: 2, NumBlocks: 2, BlockSize: 64, DType: FP32, MLA: true, KVLoraRank: 16, QKRopeHeadDim: 8, Sparse: true, IndexerDim: 4}, []int{4096, 2048, 1024}, 3},
}

// TestLayoutMatchesSeed checks block_len, base-address order and region
// lengths against the seed's own register_kv_caches logic over tensors
// whose data pointers are the host backend's (layer, part) memory.
func TestLayoutMatchesSeed(t *testing.T) {
	for _, c := range layoutCases {
		t.Run(c.name, func(t *testing.T) {
			l, err := NewLayout(c.shape)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(l.BlockLens(), c.blockLens) {
				t.Errorf("BlockLens = %v, want %v", l.BlockLens(), c.blockLens)
			}
			if l.NumParts() != c.parts || l.NumCaches() != c.parts*c.shape.NumLayers {
				t.Errorf("parts %d caches %d", l.NumParts(), l.NumCaches())
			}
			h, err := NewHost(l, HostOptions{})
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close()
			blockLen, baseAddr, ptrs, lengths := seedRegister(seedTensors(c.shape, h))
			if !slices.Equal(blockLen, l.BlockLens()) {
				t.Errorf("seed block_len %v, layout %v", blockLen, l.BlockLens())
			}
			if got := h.BaseAddrs(); !slices.Equal(got, baseAddr) {
				t.Errorf("BaseAddrs differ from the seed's kv_caches_base_addr:\n got %#x\nwant %#x", got, baseAddr)
			}
			regs := h.Regions()
			if len(regs) != len(ptrs) {
				t.Fatalf("%d regions, seed registers %d", len(regs), len(ptrs))
			}
			for k, r := range regs {
				layer, part := l.CacheOf(k)
				if r.Addr != ptrs[k] || r.Len != lengths[k] || r.Name != l.CacheName(layer, part) {
					t.Errorf("region %d = %+v, seed (%#x, %d)", k, r, ptrs[k], lengths[k])
				}
				if r.Addr%CacheAlign != 0 {
					t.Errorf("region %d at %#x not %d-aligned", k, r.Addr, CacheAlign)
				}
				if k > 0 && r.Addr < regs[k-1].Addr+regs[k-1].Len {
					t.Errorf("region %d overlaps region %d", k, k-1)
				}
				if l.CacheIndex(layer, part) != k || int64(r.Addr-regs[0].Addr) != l.Offset(layer, part) {
					t.Errorf("cache %d: index/offset mismatch", k)
				}
			}
			last := regs[len(regs)-1]
			if end := int64(last.Addr - regs[0].Addr + last.Len); end > l.Size() {
				t.Errorf("last region ends at %d, past Size %d", end, l.Size())
			}
			for i, p := range l.Parts() {
				if p.BlockLen != l.BlockLen(i) || p.BlockLen != c.shape.BlockSize*p.RowBytes || p.RowBytes != p.Heads*p.Dim*c.shape.DType.Size() {
					t.Errorf("part %d inconsistent: %+v", i, p)
				}
			}
		})
	}
}

// getPPIndices is vLLM's get_pp_indices (VLLM_PP_LAYER_PARTITION as part).
func getPPIndices(layers, rank, size int, part *string) (int, int) {
	parts := make([]int, size)
	if part != nil {
		for i, s := range strings.Split(*part, ",") {
			parts[i], _ = strconv.Atoi(s)
		}
	} else {
		for i := range parts {
			parts[i] = layers / size
		}
		for i := 2; i < layers%size+2; i++ {
			parts[size-i]++
		}
	}
	start := 0
	for _, p := range parts[:rank] {
		start += p
	}
	return start, start + parts[rank]
}

// TestTransferVectorsUseLayout replays the seed's _transfer_kv_cache address
// arithmetic with this package's BlockLen per cache (part = k % NumParts) on
// every transfer_kv_cache.json case, and checks the recorded reads.
func TestTransferVectorsUseLayout(t *testing.T) {
	type call struct {
		Src []uint64 `json:"src_list"`
		Dst []uint64 `json:"dst_list"`
		Len []uint64 `json:"length_list"`
	}
	type tcase struct {
		Scenario  string  `json:"scenario"`
		Partition *string `json:"vllm_pp_layer_partition"`
		Thread    struct {
			BlockLen       []int    `json:"block_len"`
			Layers         int      `json:"num_hidden_layers"`
			CachesPerLayer int      `json:"num_cache_per_layer"`
			PrefillPP      int      `json:"prefill_pp_size"`
			LocalBaseAddrs []uint64 `json:"local_kv_caches_base_addr"`
		} `json:"thread"`
		Req struct {
			Local  []int `json:"local_block_ids"`
			Remote []int `json:"remote_block_ids"`
			Offset int   `json:"offset"`
			P      int   `json:"tp_num_need_pulls"`
			Port   int   `json:"remote_handshake_port"`
		} `json:"req_meta"`
		Remote struct {
			Base []uint64 `json:"kv_caches_base_addr"`
		} `json:"remote_metadata"`
		Expect struct {
			Calls []call `json:"batch_transfer_sync_read"`
			Cat   []struct {
				BlockIDs [][]int `json:"block_ids"`
				P        int     `json:"tp_num_need_pulls"`
			} `json:"cat_kv_cache"`
		} `json:"expect"`
		Calls []call `json:"batch_transfer_sync_read"`
	}
	var f struct {
		Cases   []tcase `json:"cases"`
		Raising []tcase `json:"raising_cases"`
	}
	testkit.SeedrefJSON(t, "transfer_kv_cache.json", &f)
	checked := 0
	for i, c := range append(f.Cases, f.Raising...) {
		calls := c.Expect.Calls
		if i >= len(f.Cases) {
			calls = c.Calls
		}
		s, err := shapeForBlockLens(c.Thread.BlockLen, c.Thread.CachesPerLayer)
		if err != nil {
			t.Fatalf("case %d: %v", i, err)
		}
		s.NumLayers, s.NumBlocks = c.Thread.Layers, 64
		l, err := NewLayout(s)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(l.BlockLens(), c.Thread.BlockLen) || l.NumParts() != c.Thread.CachesPerLayer || l.NumCaches() != len(c.Thread.LocalBaseAddrs) {
			t.Fatalf("case %d (%s): layout block_len %v parts %d caches %d; seed %v %d %d", i, c.Scenario,
				l.BlockLens(), l.NumParts(), l.NumCaches(), c.Thread.BlockLen, c.Thread.CachesPerLayer, len(c.Thread.LocalBaseAddrs))
		}
		for _, cat := range c.Expect.Cat {
			var ids []int
			for _, g := range cat.BlockIDs {
				ids = append(ids, g...)
			}
			if err := l.ValidateStitch(ids, cat.P); err != nil {
				t.Errorf("case %d: the seed's _cat_kv_cache(%v, %d) is rejected: %v", i, cat.BlockIDs, cat.P, err)
			}
		}
		if len(calls) == 0 {
			continue
		}
		local, remote := c.Req.Local, c.Req.Remote
		if len(local) < len(remote) {
			remote = remote[len(remote)-len(local):]
		}
		var lg, rg [][]int
		if c.Req.P == 1 {
			for j := range local {
				if j > 0 && local[j] == local[j-1]+1 && remote[j] == remote[j-1]+1 {
					lg[len(lg)-1] = append(lg[len(lg)-1], local[j])
					rg[len(rg)-1] = append(rg[len(rg)-1], remote[j])
					continue
				}
				lg, rg = append(lg, []int{local[j]}), append(rg, []int{remote[j]})
			}
		} else {
			for j := range local {
				lg, rg = append(lg, []int{local[j]}), append(rg, []int{remote[j]})
			}
		}
		first, end := getPPIndices(c.Thread.Layers, c.Req.Offset/c.Req.P, c.Thread.PrefillPP, c.Partition)
		inner := c.Req.Offset % c.Req.P
		if c.Remote.Base == nil { // raising cases: the README's synthetic rule
			for j := range (end - first) * l.NumParts() {
				c.Remote.Base = append(c.Remote.Base, 0x70000000+0x40000000*uint64(c.Req.Port-30000)+0x1000000*uint64(j))
			}
		}
		var got call
		for k := first * l.NumParts(); k < end*l.NumParts() && k-first*l.NumParts() < len(c.Remote.Base); k++ {
			_, part := l.CacheOf(k)
			bl := uint64(l.BlockLen(part))
			ibl := bl / uint64(c.Req.P)
			for g := range lg {
				got.Src = append(got.Src, c.Thread.LocalBaseAddrs[k]+uint64(lg[g][0])*bl+uint64(inner)*ibl)
				got.Dst = append(got.Dst, c.Remote.Base[k-first*l.NumParts()]+uint64(rg[g][0])*ibl)
				got.Len = append(got.Len, ibl*uint64(len(lg[g])))
			}
		}
		want := calls[0]
		if !slices.Equal(got.Src, want.Src) || !slices.Equal(got.Dst, want.Dst) || !slices.Equal(got.Len, want.Len) {
			t.Errorf("case %d (%s): reads differ\n got %v\nwant %v", i, c.Scenario, got, want)
		}
		checked++
	}
	if checked < 40 {
		t.Errorf("only %d cases checked", checked)
	}
}

func fmtInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.Itoa(x)
	}
	return "[" + strings.Join(s, " ") + "]"
}

func TestShapeValidate(t *testing.T) {
	good := Shape{NumLayers: 2, NumBlocks: 4, BlockSize: 16, NumKVHeads: 2, HeadDim: 64, DType: BF16}
	mla := Shape{NumLayers: 2, NumBlocks: 4, BlockSize: 16, DType: BF16, MLA: true, KVLoraRank: 512, QKRopeHeadDim: 64}
	for _, c := range []struct {
		name string
		mod  func(*Shape)
		base Shape
		want []string
	}{
		{"zero shape", func(s *Shape) { *s = Shape{} }, good, []string{"num_layers", "num_blocks", "block_size", "dtype", "num_kv_heads", "head_dim"}},
		{"zero layers", func(s *Shape) { s.NumLayers = 0 }, good, []string{"num_layers = 0"}},
		{"negative blocks", func(s *Shape) { s.NumBlocks = -1 }, good, []string{"num_blocks = -1"}},
		{"zero block size", func(s *Shape) { s.BlockSize = 0 }, good, []string{"block_size"}},
		{"zero heads", func(s *Shape) { s.NumKVHeads = 0 }, good, []string{"num_kv_heads"}},
		{"zero head dim", func(s *Shape) { s.HeadDim = 0 }, good, []string{"head_dim"}},
		{"bad dtype", func(s *Shape) { s.DType = 42 }, good, []string{"dtype"}},
		{"mla field on gqa", func(s *Shape) { s.KVLoraRank = 512 }, good, []string{"kv_lora_rank = 512 set without MLA"}},
		{"mla zero rank", func(s *Shape) { s.KVLoraRank = 0 }, mla, []string{"kv_lora_rank"}},
		{"mla zero rope", func(s *Shape) { s.QKRopeHeadDim = 0 }, mla, []string{"qk_rope_head_dim"}},
		{"sparse without mla", func(s *Shape) { s.MLA = false; s.Sparse = true; s.IndexerDim = 128 }, mla, []string{"sparse without MLA"}},
		{"sparse zero indexer", func(s *Shape) { s.Sparse = true }, mla, []string{"indexer_dim"}},
		{"indexer without sparse", func(s *Shape) { s.IndexerDim = 128 }, mla, []string{"indexer_dim = 128 set without sparse"}},
		{"flat mla", func(s *Shape) { s.Flat = true }, mla, []string{"flat"}},
		{"huge dim", func(s *Shape) { s.HeadDim = 1 << 40 }, good, []string{"head_dim"}},
		{"too large", func(s *Shape) { s.NumBlocks, s.HeadDim, s.NumKVHeads = 1<<30, 1<<20, 1<<10 }, good, []string{"exceeds 2^50"}},
		{"too many layers", func(s *Shape) { s.NumBlocks, s.NumLayers = 1<<24, 1<<30 }, good, []string{"layers"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := c.base
			c.mod(&s)
			err := s.Validate()
			if err == nil {
				t.Fatal("Validate accepted it")
			}
			if !errors.Is(err, ErrInvalidShape) {
				t.Errorf("%v does not wrap ErrInvalidShape", err)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			if _, err := NewLayout(s); err == nil {
				t.Error("NewLayout accepted it")
			}
		})
	}
	for _, s := range []Shape{good, mla} {
		if err := s.Validate(); err != nil {
			t.Errorf("%+v: %v", s, err)
		}
	}
	if _, err := NewHost(Layout{}, HostOptions{}); !errors.Is(err, ErrInvalidShape) {
		t.Errorf("NewHost(zero Layout) = %v", err)
	}
}

// shapeForBlockLens builds a shape whose layout has exactly the seed's
// block_len list (one entry for GQA, two for MLA, three for Sparse), for
// any set of vectors: block_len is elem·block_size·width per part, so a
// one-byte dtype and block_size 1 give every width exactly. Only block_len
// and the part count enter _transfer_kv_cache's arithmetic.
func shapeForBlockLens(blockLen []int, partsPerLayer int) (Shape, error) {
	s := Shape{BlockSize: 1, DType: INT8}
	for _, bl := range blockLen {
		if bl < 1 {
			return Shape{}, fmt.Errorf("block_len %v: entries must be >= 1", blockLen)
		}
	}
	switch {
	case len(blockLen) == 1 && partsPerLayer == 2:
		s.NumKVHeads, s.HeadDim = 1, blockLen[0]
	case len(blockLen) == 2 && partsPerLayer == 2:
		s.MLA, s.KVLoraRank, s.QKRopeHeadDim = true, blockLen[0], blockLen[1]
	case len(blockLen) == 3 && partsPerLayer == 3:
		s.MLA, s.KVLoraRank, s.QKRopeHeadDim = true, blockLen[0], blockLen[1]
		s.Sparse, s.IndexerDim = true, blockLen[2]
	default:
		return Shape{}, fmt.Errorf("block_len %v with %d caches per layer is no layout the seed registers", blockLen, partsPerLayer)
	}
	return s, nil
}
