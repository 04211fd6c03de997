package plan

import (
	"errors"
	"fmt"
)

// GroupContiguous is the seed's group_concurrent_contiguous(src, dst): it
// splits both lists wherever src[i+1]-src[i] != 1 or dst[i+1]-dst[i] != 1.
// The groups alias src and dst. Lists of unequal length are an error.
func GroupContiguous(src, dst []int) (srcGroups, dstGroups [][]int, err error) {
	if len(src) != len(dst) {
		return nil, nil, fmt.Errorf("group contiguous: %d src ids, %d dst ids", len(src), len(dst))
	}
	if len(src) == 0 {
		return [][]int{}, [][]int{}, nil
	}
	start := 0
	for i := 1; i <= len(src); i++ {
		if i == len(src) || src[i]-src[i-1] != 1 || dst[i]-dst[i-1] != 1 {
			srcGroups = append(srcGroups, src[start:i:i])
			dstGroups = append(dstGroups, dst[start:i:i])
			start = i
		}
	}
	return srcGroups, dstGroups, nil
}

// CacheLayout is the decode worker's registered KV cache, as the seed's
// register_kv_caches sees it.
//
// BlockLen holds the bytes of one block of each cache part: one entry for
// GQA (K and V alike), two for MLA (latent, rope), three for sparse. The
// cache tensors are flattened layer by layer, CachesPerLayer per layer (2 for
// GQA K/V and MLA, 3 for sparse), and tensor k uses BlockLen[k % len(BlockLen)]
// (the seed's k % 2, k % 3, or [0]).
//
// BlockSize (tokens per block) is needed only by head-split tasks
// (Task.HeadSplit > 1), whose reads are token rows; 0 means unknown.
type CacheLayout struct {
	BlockLen       []uint64
	CachesPerLayer int
	BlockSize      int
}

// Caches is one side's registered cache tensors: base address of every
// tensor in the seed's order (kv_caches_base_addr) and the blocks per tensor.
// NumBlocks 0 skips the bounds check.
type Caches struct {
	Base      []uint64
	NumBlocks int
}

// Op is one read of the batch: Len bytes from the remote address into the
// local one (the seed's src_list = local, dst_list = remote, length_list).
type Op struct {
	Local, Remote, Len uint64
}

// Validate checks the layout on its own.
func (l CacheLayout) Validate() error {
	var errs []error
	if n := len(l.BlockLen); n < 1 || n > 3 {
		errs = append(errs, fmt.Errorf("layout.block_len: %d parts, want 1 (GQA), 2 (MLA) or 3 (sparse)", n))
	}
	for i, b := range l.BlockLen {
		if b == 0 {
			errs = append(errs, fmt.Errorf("layout.block_len[%d]: zero", i))
		}
	}
	if l.CachesPerLayer < 1 {
		errs = append(errs, fmt.Errorf("layout.caches_per_layer: must be >= 1, got %d", l.CachesPerLayer))
	}
	return errors.Join(errs...)
}

func (l CacheLayout) blockLen(k int) uint64 {
	switch len(l.BlockLen) {
	case 2:
		return l.BlockLen[k%2]
	case 3:
		return l.BlockLen[k%3]
	}
	return l.BlockLen[0]
}

// OpCount is the number of ops AppendOps produces for t (0 when t moves no
// block), for sizing buffers.
func OpCount(t Task, layout CacheLayout) int {
	nl := len(t.LocalBlockIDs)
	if nl == 0 || nl > len(t.RemoteBlockIDs) {
		return 0
	}
	groups := nl
	if t.HeadSplit > 1 {
		groups = nl * layout.BlockSize
	} else if t.P == 1 {
		rem := t.RemoteBlockIDs[len(t.RemoteBlockIDs)-nl:]
		groups = 1
		for i := 1; i < nl; i++ {
			if t.LocalBlockIDs[i]-t.LocalBlockIDs[i-1] != 1 || rem[i]-rem[i-1] != 1 {
				groups++
			}
		}
	}
	return groups * (t.LayerEnd - t.LayerStart) * layout.CachesPerLayer
}

// AppendOps appends the reads of task t to dst: the seed's
// _transfer_kv_cache arithmetic. The remote blocks are trimmed to the last
// len(local) (local prefix hit); local caches are sliced to the task's
// layers [LayerStart, LayerEnd) and paired in order with the remote
// worker's tensors (which cover only its PP stage). With P == 1 contiguous
// runs are grouped; with P > 1 there is one op per block. For tensor k with
// block length L and inner = L/P:
//
//	local  = local.Base[k]  + local_block*L + HeadSlot*inner
//	remote = remote.Base[k] + remote_block*inner
//	len    = inner * run_length
//
// A task without local blocks (full prefix hit) produces no op. Unlike the
// seed, mismatched tensor counts, blocks out of range and block lengths not
// divisible by P are errors, never silent truncation.
//
// AppendOps is Reads.Build followed by Reads.AppendTo; consumers that hand
// the ops to a transfer engine use the compact Reads instead and expand it
// once into the engine's own op list.
func AppendOps(dst []Op, layout CacheLayout, t Task, local, remote Caches) ([]Op, error) {
	var small [16]BlockRun // P == 1 runs: no allocation for up to 16 runs
	r := Reads{runs: small[:0]}
	if err := r.Build(layout, t, local, remote); err != nil {
		return dst, err
	}
	return r.AppendTo(dst), nil
}

// shiftOps sets dst[i] to src[i] with dl added to Local and dr to Remote.
// dst and src have the same length and do not overlap.
func shiftOps(dst, src []Op, dl, dr uint64) {
	src = src[:len(dst)]
	for i := range dst {
		dst[i] = Op{Local: src[i].Local + dl, Remote: src[i].Remote + dr, Len: src[i].Len}
	}
}

// Ops is AppendOps into a new slice.
func Ops(layout CacheLayout, t Task, local, remote Caches) ([]Op, error) {
	return AppendOps(nil, layout, t, local, remote)
}
