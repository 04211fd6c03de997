package plan

import "fmt"

// appendOpsRef is AppendOps as it was before the op generation was rewritten
// to copy the first tensor's ops with base deltas (see ops.go): one op
// computed per block and tensor with append. It is the reference the
// property test compares AppendOps with, and the baseline of the *Ref
// benchmarks.
func appendOpsRef(dst []Op, layout CacheLayout, t Task, local, remote Caches) ([]Op, error) {
	nl, nr := len(t.LocalBlockIDs), len(t.RemoteBlockIDs)
	if nl == 0 {
		return dst, nil
	}
	if nl > nr {
		return dst, fmt.Errorf("ops: %d local blocks, only %d remote blocks", nl, nr)
	}
	if err := layout.Validate(); err != nil {
		return dst, err
	}
	if t.P < 1 || t.HeadSlot < 0 || t.HeadSlot >= t.P {
		return dst, fmt.Errorf("ops: task.head_slot %d outside [0, tp_num_need_pulls %d)", t.HeadSlot, t.P)
	}
	if t.LayerStart < 0 || t.LayerEnd < t.LayerStart {
		return dst, fmt.Errorf("ops: task layers [%d, %d) invalid", t.LayerStart, t.LayerEnd)
	}
	cpl := layout.CachesPerLayer
	first, end := t.LayerStart*cpl, t.LayerEnd*cpl
	if end > len(local.Base) {
		return dst, fmt.Errorf("ops: layers [%d, %d) need local tensors up to %d, have %d", t.LayerStart, t.LayerEnd, end, len(local.Base))
	}
	lbase := local.Base[first:end]
	if len(remote.Base) != len(lbase) {
		return dst, fmt.Errorf("ops: %d local tensors for layers [%d, %d), remote has %d", len(lbase), t.LayerStart, t.LayerEnd, len(remote.Base))
	}
	rem := t.RemoteBlockIDs[nr-nl:]
	for i := 0; i < nl; i++ {
		lb, rb := t.LocalBlockIDs[i], rem[i]
		if lb < 0 || rb < 0 {
			return dst, fmt.Errorf("ops: negative block id (local %d, remote %d)", lb, rb)
		}
		if local.NumBlocks > 0 && lb >= local.NumBlocks {
			return dst, fmt.Errorf("ops: local block %d outside [0, %d)", lb, local.NumBlocks)
		}
		if remote.NumBlocks > 0 && rb >= remote.NumBlocks {
			return dst, fmt.Errorf("ops: remote block %d outside [0, %d)", rb, remote.NumBlocks)
		}
	}
	p := uint64(t.P)
	for _, b := range layout.BlockLen {
		if b%p != 0 {
			return dst, fmt.Errorf("ops: block_len %d not divisible by tp_num_need_pulls %d", b, t.P)
		}
	}
	if need := OpCount(t, layout); cap(dst)-len(dst) < need {
		grown := make([]Op, len(dst), len(dst)+need)
		copy(grown, dst)
		dst = grown
	}
	slot := uint64(t.HeadSlot)
	if t.P > 1 {
		for k := range lbase {
			bl := layout.blockLen(k) // the seed indexes parts by the position in the sliced list
			inner := bl / p
			lb0, rb0 := lbase[k]+slot*inner, remote.Base[k]
			for i, b := range t.LocalBlockIDs {
				dst = append(dst, Op{Local: lb0 + uint64(b)*bl, Remote: rb0 + uint64(rem[i])*inner, Len: inner})
			}
		}
		return dst, nil
	}
	// P == 1: group contiguous runs once, then emit one op per run and tensor.
	var small [64]int32
	starts := small[:0]
	for i := 0; i < nl; i++ {
		if i == 0 || t.LocalBlockIDs[i]-t.LocalBlockIDs[i-1] != 1 || rem[i]-rem[i-1] != 1 {
			starts = append(starts, int32(i))
		}
	}
	for k := range lbase {
		bl := layout.blockLen(k)
		lb0, rb0 := lbase[k], remote.Base[k]
		for j, s := range starts {
			e := nl
			if j+1 < len(starts) {
				e = int(starts[j+1])
			}
			dst = append(dst, Op{
				Local:  lb0 + uint64(t.LocalBlockIDs[s])*bl,
				Remote: rb0 + uint64(rem[s])*bl,
				Len:    bl * uint64(e-int(s)),
			})
		}
	}
	return dst, nil
}
