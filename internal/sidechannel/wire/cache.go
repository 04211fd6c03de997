package wire

import (
	"math"
	"strconv"

	"github.com/kvflow/kvflow/hw/npu"
)

// Keys of the "kvflow"."cache" map (the cache fingerprint), in the order
// AppendMetadata writes them.
const (
	keyCache         = "cache"
	keyKind          = "kind"
	keyDType         = "dtype"
	keyBlockSize     = "block_size"
	keyKVHeads       = "kv_heads"
	keyHeadDim       = "head_dim"
	keyKVLoraRank    = "kv_lora_rank"
	keyQKRopeHeadDim = "qk_rope_head_dim"
	keyIndexerDim    = "indexer_dim"
	keyLayers        = "layers"
	keyBlockLen      = "block_len"
	keyCacheBlocks   = "num_blocks"
	keyPrefill       = "prefill"
	keyDecode        = "decode"
	keyRank          = "rank"
)

// MaxCacheValue bounds every integer of a cache fingerprint (2^31 - 1, as
// npu.Shape bounds its fields): a larger one is absurd and the metadata is
// malformed.
const MaxCacheValue = math.MaxInt32

// appendCache appends the fingerprint map: kind, dtype, block_size, then
// each non-zero of kv_heads, head_dim, kv_lora_rank, qk_rope_head_dim,
// indexer_dim, then layers, block_len, num_blocks, then prefill and decode
// ([tp, pp, pcp, dcp]) and rank ([tp, pp, pcp]) when prefill or decode is
// stated.
func appendCache(dst []byte, f *npu.Fingerprint) []byte {
	opt := []struct {
		key string
		v   int
	}{
		{keyKVHeads, f.KVHeads}, {keyHeadDim, f.HeadDim}, {keyKVLoraRank, f.KVLoraRank},
		{keyQKRopeHeadDim, f.QKRopeHeadDim}, {keyIndexerDim, f.IndexerDim},
	}
	n := 6
	for _, o := range opt {
		if o.v != 0 {
			n++
		}
	}
	topo := f.Prefill != (npu.Sizes{}) || f.Decode != (npu.Sizes{}) || f.Rank != (npu.RankPos{})
	if topo {
		n += 3
	}
	dst = appendMapLen(dst, n)
	dst = appendStr(appendStr(dst, keyKind), f.Kind.String())
	dst = appendStr(appendStr(dst, keyDType), f.DType.String())
	dst = appendUint(appendStr(dst, keyBlockSize), uint64(f.BlockSize))
	for _, o := range opt {
		if o.v != 0 {
			dst = appendUint(appendStr(dst, o.key), uint64(o.v))
		}
	}
	dst = appendUint(appendStr(dst, keyLayers), uint64(f.Layers))
	dst = appendArrayLen(appendStr(dst, keyBlockLen), len(f.BlockLens))
	for _, b := range f.BlockLens {
		dst = appendUint(dst, uint64(b))
	}
	dst = appendUint(appendStr(dst, keyCacheBlocks), uint64(f.NumBlocks))
	if topo {
		dst = appendInts(appendStr(dst, keyPrefill), f.Prefill.TP, f.Prefill.PP, f.Prefill.PCP, f.Prefill.DCP)
		dst = appendInts(appendStr(dst, keyDecode), f.Decode.TP, f.Decode.PP, f.Decode.PCP, f.Decode.DCP)
		dst = appendInts(appendStr(dst, keyRank), f.Rank.TP, f.Rank.PP, f.Rank.PCP)
	}
	return dst
}

func appendInts(dst []byte, vs ...int) []byte {
	dst = appendArrayLen(dst, len(vs))
	for _, v := range vs {
		dst = appendUint(dst, uint64(v))
	}
	return dst
}

// cache reads the fingerprint map. kind, dtype, block_size, layers,
// block_len and num_blocks are required; every integer is at most
// MaxCacheValue; kind is "gqa", "mla" or "sparse" and block_len has one
// entry per part of that kind (2, 2, 3), each at least 1; block_size,
// layers and num_blocks are at least 1; unknown keys are skipped.
func (r *reader) cache(parent string) (*npu.Fingerprint, error) {
	start := r.off
	n, err := r.mapLen(parent)
	if err != nil {
		return nil, err
	}
	f := &npu.Fingerprint{}
	seen := map[string]bool{}
	for i := 0; i < n; i++ {
		key, err := r.str(parent + " key")
		if err != nil {
			return nil, err
		}
		field := parent + "." + key
		known := true
		switch key {
		case keyKind:
			var s string
			at := r.off
			if s, err = r.str(field); err == nil {
				var ok bool
				if f.Kind, ok = npu.ParseKind(s); !ok {
					r.off = at
					err = r.errf(field, "%q is not gqa, mla or sparse", s)
				}
			}
		case keyDType:
			var s string
			at := r.off
			if s, err = r.str(field); err == nil {
				if f.DType, err = npu.ParseDType(s); err != nil {
					r.off = at
					err = r.errf(field, "%v", err)
				}
			}
		case keyBlockSize:
			f.BlockSize, err = r.small(field, 1)
		case keyKVHeads:
			f.KVHeads, err = r.small(field, 0)
		case keyHeadDim:
			f.HeadDim, err = r.small(field, 0)
		case keyKVLoraRank:
			f.KVLoraRank, err = r.small(field, 0)
		case keyQKRopeHeadDim:
			f.QKRopeHeadDim, err = r.small(field, 0)
		case keyIndexerDim:
			f.IndexerDim, err = r.small(field, 0)
		case keyLayers:
			f.Layers, err = r.small(field, 1)
		case keyCacheBlocks:
			f.NumBlocks, err = r.small(field, 1)
		case keyBlockLen:
			f.BlockLens, err = r.smalls(field, 1, 3, 1)
		case keyPrefill, keyDecode:
			var v []int
			if v, err = r.smalls(field, 4, 4, 0); err == nil {
				s := npu.Sizes{TP: v[0], PP: v[1], PCP: v[2], DCP: v[3]}
				if key == keyPrefill {
					f.Prefill = s
				} else {
					f.Decode = s
				}
			}
		case keyRank:
			var v []int
			if v, err = r.smalls(field, 3, 3, 0); err == nil {
				f.Rank = npu.RankPos{TP: v[0], PP: v[1], PCP: v[2]}
			}
		default:
			known = false
			err = r.skip(field, 3)
		}
		if err != nil {
			return nil, err
		}
		if known {
			if seen[key] {
				return nil, r.errf(field, "duplicate key")
			}
			seen[key] = true
		}
	}
	for _, k := range []string{keyKind, keyDType, keyBlockSize, keyLayers, keyBlockLen, keyCacheBlocks} {
		if !seen[k] {
			r.off = start
			return nil, r.errf(parent, "missing required field %q", k)
		}
	}
	if want := map[npu.Kind]int{npu.GQA: 2, npu.MLA: 2, npu.Sparse: 3}[f.Kind]; len(f.BlockLens) != want {
		r.off = start
		return nil, r.errf(parent+"."+keyBlockLen, "%d entries for a %s cache, want %d", len(f.BlockLens), f.Kind, want)
	}
	return f, nil
}

// small reads a non-negative integer in [lo, MaxCacheValue].
func (r *reader) small(field string, lo int) (int, error) {
	start := r.off
	v, err := r.uint(field)
	if err != nil {
		return 0, err
	}
	if v > MaxCacheValue || v < uint64(lo) {
		r.off = start
		return 0, r.errf(field, "%d outside %d..%d", v, lo, MaxCacheValue)
	}
	return int(v), nil
}

// smalls reads an array of minLen..maxLen integers, each as small(lo).
func (r *reader) smalls(field string, minLen, maxLen, lo int) ([]int, error) {
	start := r.off
	n, err := r.arrayLen(field)
	if err != nil {
		return nil, err
	}
	if n < minLen || n > maxLen {
		r.off = start
		return nil, r.errf(field, "%d entries, want %d..%d", n, minLen, maxLen)
	}
	out := make([]int, n)
	for i := range out {
		if out[i], err = r.small(field+"["+strconv.Itoa(i)+"]", lo); err != nil {
			return nil, err
		}
	}
	return out, nil
}
