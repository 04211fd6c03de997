package npu

// Fingerprint is everything about a worker's KV cache that changes its bytes
// or the address arithmetic of a read from it: the cache family, element
// type, block size, per-rank heads and head dimension (GQA) or part widths
// (MLA, sparse), the layers present on the worker, each part's block_len and
// the blocks per cache tensor; plus the instance sizes and the worker's rank
// as its configuration states them, which decide which worker holds which
// heads and layers.
//
// A prefill worker sends its fingerprint with its metadata; a decode worker
// derives the fingerprint it expects from each peer from its own
// (Layout.Fingerprint) and the plan of the read, and compares the two field
// by field before any byte moves (package handshake).
//
// Zero fields are "not stated". It is a plain value: copy it freely (but
// BlockLens is shared by copies; never edit it in place).
type Fingerprint struct {
	Kind      Kind
	DType     DType
	BlockSize int // tokens per block
	// GQA: KV heads on this rank and the head dimension; 1 and 0 for MLA
	// and sparse caches (a single latent "head").
	KVHeads, HeadDim int
	// MLA and sparse part widths; 0 for GQA.
	KVLoraRank, QKRopeHeadDim, IndexerDim int
	Layers                                int   // layers on this worker (its PP stage)
	BlockLens                             []int // bytes per block of each part, in part order (2 or 3 entries)
	NumBlocks                             int   // blocks per cache tensor

	// Prefill and Decode are the instances' sizes as this worker's
	// configuration states them; Rank is this worker's position.
	Prefill, Decode Sizes
	Rank            RankPos
}

// Sizes are one instance's parallel sizes (0 = not stated; PCP and DCP 1
// when unused).
type Sizes struct{ TP, PP, PCP, DCP int }

// RankPos is a worker's position in its instance.
type RankPos struct{ TP, PP, PCP int }

// Fingerprint is the cache part of l's fingerprint (Prefill, Decode and
// Rank are left for the caller, who knows the topology).
func (l Layout) Fingerprint() Fingerprint {
	s := l.shape
	f := Fingerprint{
		Kind:      s.Kind(),
		DType:     s.DType,
		BlockSize: s.BlockSize,
		Layers:    s.NumLayers,
		NumBlocks: s.NumBlocks,
		BlockLens: make([]int, len(l.parts)),
	}
	for i, p := range l.parts {
		f.BlockLens[i] = p.BlockLen
	}
	if f.Kind == GQA {
		f.KVHeads, f.HeadDim = s.NumKVHeads, s.HeadDim
	} else {
		f.KVHeads = 1
		f.KVLoraRank, f.QKRopeHeadDim = s.KVLoraRank, s.QKRopeHeadDim
		if f.Kind == Sparse {
			f.IndexerDim = s.IndexerDim
		}
	}
	return f
}

// ParseKind is the inverse of Kind.String ("gqa", "mla", "sparse").
func ParseKind(s string) (Kind, bool) {
	for _, k := range []Kind{GQA, MLA, Sparse} {
		if k.String() == s {
			return k, true
		}
	}
	return 0, false
}
