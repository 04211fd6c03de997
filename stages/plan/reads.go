package plan

import "fmt"

// Reads is one task's reads in compact form: what AppendOps would write,
// as a product of the task's cache tensors and its block runs instead of
// one address triple per (tensor, run). Building it (Build) validates the
// task and costs O(blocks), independent of the number of tensors; the ops
// themselves are produced only when a consumer expands them (AppendTo into
// a []Op, or Tensor/Run straight into a transfer engine's own op type).
//
// Op i, in AppendOps' order (tensor-major), is run j = i % Runs() of tensor
// k = i / Runs():
//
//	Tensor(k).Op(Run(j))
//
// With P == 1 the runs are the groups of GroupContiguous (local and remote
// both contiguous); with P > 1 every block is a run of its own. A Reads
// aliases the task's block-id lists and both sides' base-address lists and
// reuses its own run storage on the next Build, so it is valid while
// those are unchanged and until it is built again; copies share that
// storage. The zero value is an empty Reads (no op).
type Reads struct {
	local, remote   []uint64  // base address of each of the task's tensors
	blockLen, inner [3]uint64 // per part: block length L and L/P
	parts           int
	slot            uint64    // HeadSlot
	p               uint64    // tp_num_need_pulls
	slotOff         [3]uint64 // per part: the head slot's offset in a block (HeadSlot*L/P; Interleave changes it)
	localStride     [3]uint64 // per part: local bytes per run unit (L; a row with HeadSplit)
	remoteStride    [3]uint64 // per part: remote bytes per run unit (L/P; a remote row with HeadSplit)
	remoteOff       [3]uint64 // per part: the head slice's offset in a remote row (HeadSplit)
	rows            int       // HeadSplit: token rows per block, one run each
	loc, rem        []int     // P > 1: the task's local and trimmed remote blocks, one run each
	runs            []BlockRun
	grouped         bool // P == 1: runs holds the runs
	nruns, nblocks  int
	bytes           uint64
}

// BlockRun is a run of Blocks consecutive blocks, local and remote, starting
// at local block Local and remote block Remote.
type BlockRun struct {
	Local, Remote, Blocks int
}

// TensorReads is one cache tensor's part of a Reads: its run of n blocks
// from local block a and remote block b is read by
//
//	Op{Local + a*LocalStride, Remote + b*RemoteStride, n*Len}
//
// Local includes the head slot's offset (HeadSlot*L/P, or HeadSlot*row/P
// after Interleave); LocalStride is the
// block length L, RemoteStride and Len are L/P (L when P == 1).
type TensorReads struct {
	Local, Remote             uint64
	LocalStride, RemoteStride uint64
	Len                       uint64
}

// Op is the read of run.
func (t TensorReads) Op(run BlockRun) Op {
	return Op{
		Local:  t.Local + uint64(run.Local)*t.LocalStride,
		Remote: t.Remote + uint64(run.Remote)*t.RemoteStride,
		Len:    t.Len * uint64(run.Blocks),
	}
}

// Build sets r to the reads of task t, reusing r's run storage: the
// validation and arithmetic of AppendOps (see there), without writing an
// op. On error r is empty. It allocates only when a P == 1 task has more
// runs than any task r was built for before.
func (r *Reads) Build(layout CacheLayout, t Task, local, remote Caches) error {
	r.Reset()
	nl, nr := len(t.LocalBlockIDs), len(t.RemoteBlockIDs)
	if nl == 0 {
		return nil
	}
	if nl > nr {
		return fmt.Errorf("ops: %d local blocks, only %d remote blocks", nl, nr)
	}
	if err := layout.Validate(); err != nil {
		return err
	}
	if t.P < 1 || t.HeadSlot < 0 || t.HeadSlot >= t.P {
		return fmt.Errorf("ops: task.head_slot %d outside [0, tp_num_need_pulls %d)", t.HeadSlot, t.P)
	}
	if t.LayerStart < 0 || t.LayerEnd < t.LayerStart {
		return fmt.Errorf("ops: task layers [%d, %d) invalid", t.LayerStart, t.LayerEnd)
	}
	if t.LocalLayerBase < 0 || t.LocalLayerBase > t.LayerStart || t.RemoteLayerSkip < 0 || t.RemoteLayers < 0 {
		return fmt.Errorf("ops: task layers [%d, %d) with local base %d, remote skip %d of %d layers invalid", t.LayerStart, t.LayerEnd, t.LocalLayerBase, t.RemoteLayerSkip, t.RemoteLayers)
	}
	cpl := layout.CachesPerLayer
	first, end := (t.LayerStart-t.LocalLayerBase)*cpl, (t.LayerEnd-t.LocalLayerBase)*cpl
	if end > len(local.Base) {
		return fmt.Errorf("ops: layers [%d, %d) need local tensors up to %d, have %d", t.LayerStart, t.LayerEnd, end, len(local.Base))
	}
	lbase := local.Base[first:end]
	rfirst, rwant := t.RemoteLayerSkip*cpl, len(lbase)
	if t.RemoteLayers > 0 {
		rwant = t.RemoteLayers * cpl
		if rfirst+len(lbase) > rwant {
			return fmt.Errorf("ops: task layers [%d, %d) skip %d of the remote stage's %d layers: past its end", t.LayerStart, t.LayerEnd, t.RemoteLayerSkip, t.RemoteLayers)
		}
	} else if rfirst != 0 {
		return fmt.Errorf("ops: remote layer skip %d without the remote stage's layer count", t.RemoteLayerSkip)
	}
	if len(remote.Base) != rwant {
		if t.RemoteLayers == 0 {
			return fmt.Errorf("ops: %d local tensors for layers [%d, %d), remote has %d", len(lbase), t.LayerStart, t.LayerEnd, len(remote.Base))
		}
		return fmt.Errorf("ops: remote stage of %d layers needs %d tensors, remote has %d", t.RemoteLayers, rwant, len(remote.Base))
	}
	split := max(1, t.HeadSplit)
	if split > 1 {
		if t.P != 1 {
			return fmt.Errorf("ops: head split %d with tp_num_need_pulls %d", t.HeadSplit, t.P)
		}
		if t.HeadSlice < 0 || t.HeadSlice >= split {
			return fmt.Errorf("ops: task.head_slice %d outside [0, head split %d)", t.HeadSlice, split)
		}
		if layout.BlockSize < 1 {
			return fmt.Errorf("ops: head split %d needs layout.block_size, got %d", split, layout.BlockSize)
		}
		for q, b := range layout.BlockLen {
			if b%uint64(layout.BlockSize) != 0 {
				return fmt.Errorf("ops: part %d: block_len %d not block_size %d rows", q, b, layout.BlockSize)
			}
		}
	}
	loc, rem := t.LocalBlockIDs, t.RemoteBlockIDs[nr-nl:]
	rem = rem[:len(loc)]
	groups := 1
	for i := range loc {
		lb, rb := loc[i], rem[i]
		if lb < 0 || rb < 0 {
			return fmt.Errorf("ops: negative block id (local %d, remote %d)", lb, rb)
		}
		if local.NumBlocks > 0 && lb >= local.NumBlocks {
			return fmt.Errorf("ops: local block %d outside [0, %d)", lb, local.NumBlocks)
		}
		if remote.NumBlocks > 0 && rb >= remote.NumBlocks {
			return fmt.Errorf("ops: remote block %d outside [0, %d)", rb, remote.NumBlocks)
		}
		if i > 0 && (lb-loc[i-1] != 1 || rb-rem[i-1] != 1) {
			groups++
		}
	}
	p := uint64(t.P)
	for _, b := range layout.BlockLen {
		if b%p != 0 {
			return fmt.Errorf("ops: block_len %d not divisible by tp_num_need_pulls %d", b, t.P)
		}
	}
	r.local, r.remote = lbase, remote.Base[rfirst:rfirst+len(lbase)]
	r.parts = len(layout.BlockLen)
	for q, b := range layout.BlockLen {
		r.blockLen[q], r.inner[q] = b, b/p
		r.localStride[q], r.remoteStride[q] = b, b/p
	}
	r.slot, r.p = uint64(t.HeadSlot), p
	for q := range r.parts {
		r.slotOff[q] = r.slot * r.inner[q]
	}
	r.nblocks = nl
	if split > 1 {
		// One op per token row: local rows are contiguous, remote rows
		// are split times longer and the task reads slice HeadSlice of
		// each.
		bs := layout.BlockSize
		for q, b := range layout.BlockLen {
			row := b / uint64(bs)
			r.inner[q], r.localStride[q] = row, row
			r.remoteStride[q], r.remoteOff[q] = row*uint64(split), uint64(t.HeadSlice)*row
		}
		r.loc, r.rem, r.rows, r.nruns = loc, rem, bs, nl*bs
	} else if t.P > 1 {
		r.loc, r.rem, r.nruns = loc, rem, nl
	} else {
		// The writes go through r.runs[i] (never append to r.runs) so
		// that a caller's stack buffer in r.runs stays on the stack.
		if cap(r.runs) < groups {
			r.runs = make([]BlockRun, groups)
		}
		r.runs = r.runs[:groups]
		j, s := 0, 0
		for i := 1; i <= nl; i++ {
			if i == nl || loc[i]-loc[i-1] != 1 || rem[i]-rem[i-1] != 1 {
				r.runs[j] = BlockRun{Local: loc[s], Remote: rem[s], Blocks: i - s}
				j++
				s = i
			}
		}
		r.grouped, r.nruns = true, groups
	}
	// Every tensor reads every block once, L/P bytes each: tensors of part
	// q are k = q, q+parts, ... below len(lbase).
	// (With HeadSplit, inner is a row and every block bs rows.)
	units := uint64(nl)
	if r.rows > 0 {
		units *= uint64(r.rows)
	}
	for q := range r.parts {
		if n := len(lbase) - q; n > 0 {
			r.bytes += r.inner[q] * units * uint64((n+r.parts-1)/r.parts)
		}
	}
	return nil
}

// Reset empties r, keeping its run storage and dropping its references to
// the lists it aliased. (Field by field: assigning a new Reads holding
// r.runs would make escape analysis move a caller's stack buffer in r.runs
// to the heap.)
func (r *Reads) Reset() {
	r.runs = r.runs[:0]
	r.local, r.remote, r.loc, r.rem = nil, nil, nil, nil
	r.blockLen, r.inner = [3]uint64{}, [3]uint64{}
	r.parts, r.slot, r.p, r.grouped = 0, 0, 0, false
	r.slotOff, r.localStride, r.remoteStride, r.remoteOff = [3]uint64{}, [3]uint64{}, [3]uint64{}, [3]uint64{}
	r.rows, r.nruns, r.nblocks, r.bytes = 0, 0, 0, 0
}

// Len is the number of ops (OpCount).
func (r *Reads) Len() int { return r.nruns * len(r.local) }

// Bytes is the total length of the ops.
func (r *Reads) Bytes() uint64 { return r.bytes }

// Tensors is the number of the task's cache tensors (local tensors sliced
// to its layers, paired in order with the remote ones).
func (r *Reads) Tensors() int { return len(r.local) }

// Runs is the number of block runs (ops per tensor).
func (r *Reads) Runs() int { return r.nruns }

// Blocks is the number of blocks each tensor reads.
func (r *Reads) Blocks() int { return r.nblocks }

// Parts is the number of cache parts (len(BlockLen)); 0 for an empty Reads.
// Tensor k uses part k % Parts(), as the seed indexes parts by the position
// in the sliced list, and the tensors of one part differ only in their base
// addresses: for q = k % Parts(), Tensor(k).Op(run) is Tensor(q).Op(run)
// with Tensor(k).Local-Tensor(q).Local added to Local and
// Tensor(k).Remote-Tensor(q).Remote to Remote (uint64 arithmetic wraps, so
// this is exact). Expansions compute the first Parts() tensors and shift
// their ops for the others.
func (r *Reads) Parts() int { return r.parts }

// Tensor is tensor k's part, 0 <= k < Tensors().
func (r *Reads) Tensor(k int) TensorReads {
	q := k % r.parts
	return TensorReads{Local: r.local[k] + r.slotOff[q], Remote: r.remote[k] + r.remoteOff[q],
		LocalStride: r.localStride[q], RemoteStride: r.remoteStride[q], Len: r.inner[q]}
}

// Interleave fuses the head transpose of a P > 1 task into its reads. The
// seed reads prefill rank q's slice of every block, [block_size][row/P],
// contiguously to q*L/P within the block, and once all P slices landed
// reorders the block from [P][block_size][row/P] to [block_size][P][row/P]
// (row = L/block_size bytes: one token's heads). Interleave instead makes
// each op start at q*row/P, its slot's place in the block's first token,
// and returns the stride its bytes must land with: rows of row/P bytes,
// row bytes apart. An engine that lays each op out so (mooncake.Stride)
// leaves every block exactly as the seed's read and transpose would, and
// the stitch is skipped. Remote addresses, lengths and the op count do not
// change.
//
// It fails, leaving r as it was, when r is not a P > 1 task's reads, a
// part's block is not block_size rows of P equal slices, or the parts'
// rows differ (one stride serves the whole batch).
func (r *Reads) Interleave(blockSize int) (row, pitch uint64, err error) {
	if err := CanInterleave(r.blockLen[:r.parts], blockSize, int(r.p)); err != nil {
		return 0, 0, err
	}
	pitch = r.blockLen[0] / uint64(blockSize)
	row = pitch / r.p
	for q := range r.parts {
		r.slotOff[q] = r.slot * row
	}
	return row, pitch, nil
}

// CanInterleave reports whether reads of blocks of blockLen bytes (one per
// cache part) with tp_num_need_pulls p can be interleaved (see
// Reads.Interleave), and if not, why.
func CanInterleave(blockLen []uint64, blockSize, p int) error {
	switch {
	case p < 2:
		return fmt.Errorf("interleave: tp_num_need_pulls %d: nothing to transpose", p)
	case blockSize < 1:
		return fmt.Errorf("interleave: block_size %d", blockSize)
	case len(blockLen) == 0:
		return fmt.Errorf("interleave: no cache parts")
	}
	bs, pp := uint64(blockSize), uint64(p)
	for q, l := range blockLen {
		if l%bs != 0 || (l/bs)%pp != 0 {
			return fmt.Errorf("interleave: part %d: a block of %d bytes is not %d rows of %d equal slices", q, l, blockSize, p)
		}
		if l != blockLen[0] {
			return fmt.Errorf("interleave: part %d: blocks of %d bytes, part 0 has %d (one stride for all parts)", q, l, blockLen[0])
		}
	}
	return nil
}

// Run is block run j, 0 <= j < Runs().
func (r *Reads) Run(j int) BlockRun {
	if r.grouped {
		return r.runs[j]
	}
	if r.rows > 0 {
		b, row := j/r.rows, j%r.rows
		return BlockRun{Local: r.loc[b]*r.rows + row, Remote: r.rem[b]*r.rows + row, Blocks: 1}
	}
	return BlockRun{Local: r.loc[j], Remote: r.rem[j], Blocks: 1}
}

// At is op i, 0 <= i < Len(): AppendTo(nil)[i] without the others.
func (r *Reads) At(i int) Op {
	if i < 0 || i >= r.Len() {
		panic(fmt.Sprintf("plan: Reads.At(%d) of %d ops", i, r.Len()))
	}
	return r.Tensor(i / r.nruns).Op(r.Run(i % r.nruns))
}

// AppendTo appends the ops to dst, in AppendOps' order, growing it at most
// once.
func (r *Reads) AppendTo(dst []Op) []Op {
	need := r.Len()
	if need == 0 {
		return dst
	}
	if cap(dst)-len(dst) < need {
		grown := make([]Op, len(dst), len(dst)+need)
		copy(grown, dst)
		dst = grown
	}
	n0 := len(dst)
	dst = dst[:n0+need]
	out := dst[n0:]
	groups := r.nruns
	// The first tensor of each part is computed in full; every later
	// tensor of that part has the same ops shifted by its base addresses'
	// difference from the first one's, so it is a copy plus two adds per
	// op. uint64 arithmetic wraps, so (b_q + x) + (b_k - b_q) == b_k + x
	// exactly: the ops are the ones Tensor(k).Op gives.
	for k := 0; k < r.parts && k < len(r.local); k++ {
		o := out[k*groups : (k+1)*groups]
		tr := r.Tensor(k)
		if r.grouped {
			for j, run := range r.runs[:len(o)] {
				o[j] = tr.Op(run)
			}
			continue
		}
		if r.rows > 0 {
			for j := range o {
				o[j] = tr.Op(r.Run(j))
			}
			continue
		}
		loc, rem := r.loc[:len(o)], r.rem[:len(o)]
		for j, b := range loc {
			o[j] = Op{Local: tr.Local + uint64(b)*tr.LocalStride, Remote: tr.Remote + uint64(rem[j])*tr.RemoteStride, Len: tr.Len}
		}
	}
	for k := r.parts; k < len(r.local); k++ {
		q := k % r.parts
		shiftOps(out[k*groups:(k+1)*groups], out[q*groups:(q+1)*groups], r.local[k]-r.local[q], r.remote[k]-r.remote[q])
	}
	return dst
}

// GatherStride reports whether r, a head-split task's reads
// (Task.HeadSplit > 1: one op per token row), has a strided form, and its
// stride: every row of a run of blocks consecutive on both sides is row
// bytes, pitch apart on the remote side (the remote row, HeadSplit times
// longer) and back to back on the local side. ok is false for any other
// reads, or when the cache parts' rows differ (one stride serves a batch).
func (r *Reads) GatherStride() (row, pitch uint64, ok bool) {
	if r.rows == 0 || r.parts == 0 {
		return 0, 0, false
	}
	row, pitch = r.inner[0], r.remoteStride[0]
	for q := 1; q < r.parts; q++ {
		if r.inner[q] != row || r.remoteStride[q] != pitch {
			return 0, 0, false
		}
	}
	return row, pitch, true
}

// AppendGather appends the strided form of head-split reads r (see
// GatherStride; nothing for other reads) to dst: per tensor, in tensor
// order, one op per run of blocks consecutive on both sides, Len the
// run's local bytes (blocks × block_size rows), Remote its first row's
// slice. Row i of such an op is Tensor(k).Op(Run(j+i)) for the run's
// first row op j: the same bytes, from the same places, to the same
// places as the per-row ops, in GatherLen() ops instead of Len().
func (r *Reads) AppendGather(dst []Op) []Op {
	if _, _, ok := r.GatherStride(); !ok {
		return dst
	}
	bs := uint64(r.rows)
	for k := range r.local {
		tr := r.Tensor(k)
		blockL, blockR := bs*tr.LocalStride, bs*tr.RemoteStride
		for s := 0; s < len(r.loc); {
			e := s + 1
			for e < len(r.loc) && r.loc[e]-r.loc[e-1] == 1 && r.rem[e]-r.rem[e-1] == 1 {
				e++
			}
			dst = append(dst, Op{
				Local:  tr.Local + uint64(r.loc[s])*blockL,
				Remote: tr.Remote + uint64(r.rem[s])*blockR,
				Len:    uint64(e-s) * bs * tr.Len,
			})
			s = e
		}
	}
	return dst
}

// GatherLen is the number of ops AppendGather appends.
func (r *Reads) GatherLen() int {
	if _, _, ok := r.GatherStride(); !ok {
		return 0
	}
	runs := 0
	for i := range r.loc {
		if i == 0 || r.loc[i]-r.loc[i-1] != 1 || r.rem[i]-r.rem[i-1] != 1 {
			runs++
		}
	}
	return runs * len(r.local)
}
