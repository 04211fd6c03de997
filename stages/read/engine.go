package read

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"syscall"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/stages/plan"
)

// Engine adapts a transfer engine (hw/mooncake: the TCP engine, the cgo
// engine, or any other mooncake.Engine) to Transfer. The engine's optional
// capabilities (mooncake.StridedReader, GatherReader, LedgerReader) are
// resolved here, once; the batches then go to the form resolved. Failures
// are classified by mooncake's errors (ClassifyFailure).
func Engine(e mooncake.Engine) Transfer {
	t := &engine{e: e}
	t.strided, _ = e.(mooncake.StridedReader)
	t.gather, _ = e.(mooncake.GatherReader)
	t.ledger, _ = e.(mooncake.LedgerReader)
	t.caps = Capabilities{
		LocalStride: t.strided != nil,
		Gather:      t.gather != nil,
		Ledger:      t.ledger != nil,
		Classify:    ClassifyFailure,
	}
	return t
}

type engine struct {
	e       mooncake.Engine
	strided mooncake.StridedReader
	gather  mooncake.GatherReader
	ledger  mooncake.LedgerReader
	caps    Capabilities
}

func (t *engine) Capabilities() Capabilities { return t.caps }

// BatchRead expands b once, straight into the engine's op list: the only
// place the read stage's ops are materialised. The list is new for every
// batch, since a failed batch's *mooncake.BatchError keeps it.
func (t *engine) BatchRead(ctx context.Context, session string, b *Batch) error {
	switch {
	case b.Gather && t.gather != nil && b.Reads != nil:
		row, pitch, ok := b.Reads.GatherStride()
		if !ok {
			return fmt.Errorf("read: gather of reads with no strided form: %w", errNotCapable)
		}
		g := b.Reads.AppendGather(make([]plan.Op, 0, b.Reads.GatherLen()))
		ops := make([]mooncake.Op, len(g))
		for i, op := range g {
			ops[i] = mooncake.Op{Local: op.Local, Remote: op.Remote, Length: op.Len}
		}
		return t.gather.BatchReadGather(ctx, session, ops, mooncake.Stride{Row: row, Pitch: pitch})
	case b.Gather:
		return errNotCapable
	}
	ops := engineOps(b)
	switch {
	case b.Row > 0 && t.strided != nil:
		return t.strided.BatchReadStrided(ctx, session, ops, mooncake.Stride{Row: b.Row, Pitch: b.Pitch})
	case b.Row > 0:
		return errNotCapable
	case b.Landed != nil && t.ledger != nil:
		return t.ledger.BatchReadLedger(ctx, session, ops, b.Landed)
	case b.Landed != nil:
		return errNotCapable
	}
	return t.e.BatchRead(ctx, session, ops)
}

// engineOps is b's plain ops as mooncake ops.
func engineOps(b *Batch) []mooncake.Op {
	if b.Reads != nil {
		return AppendEngineOps(make([]mooncake.Op, 0, b.Reads.Len()), b.Reads)
	}
	ops := make([]mooncake.Op, len(b.List))
	for i, op := range b.List {
		ops[i] = mooncake.Op{Local: op.Local, Remote: op.Remote, Length: op.Len}
	}
	return ops
}

// AppendEngineOps appends r's ops to dst as mooncake ops, in r's order
// (tensor-major, as plan.AppendOps). Like Reads.AppendTo it computes the
// first tensor of each part from the runs and every later tensor as that
// one's ops shifted by the two base-address differences (a copy and two
// adds per op, from ops just written and still in cache).
func AppendEngineOps(dst []mooncake.Op, r *plan.Reads) []mooncake.Op {
	runs, tensors := r.Runs(), r.Tensors()
	dst = slices.Grow(dst, r.Len())
	n0 := len(dst)
	dst = dst[:n0+r.Len()]
	out := dst[n0:]
	parts := min(r.Parts(), tensors)
	for k := range parts {
		tr := r.Tensor(k)
		o := out[k*runs : (k+1)*runs]
		for j := range o {
			op := tr.Op(r.Run(j))
			o[j] = mooncake.Op{Local: op.Local, Remote: op.Remote, Length: op.Len}
		}
	}
	for k := parts; k < tensors; k++ {
		q := k % parts
		tk, tq := r.Tensor(k), r.Tensor(q)
		dl, dr := tk.Local-tq.Local, tk.Remote-tq.Remote
		src := out[q*runs : (q+1)*runs]
		o := out[k*runs : (k+1)*runs]
		o = o[:len(src)]
		for j, op := range src {
			o[j] = mooncake.Op{Local: op.Local + dl, Remote: op.Remote + dr, Length: op.Length}
		}
	}
	return dst
}

// ClassifyFailure tells how a batch of a hw/mooncake engine failed: the
// connection lost (refused at the RPC or data port, or closed or reset by
// the peer: its process may have restarted), refused by the peer, whether
// any op landed first, and whether refusals were all that failed
// (RefusedOnly). It reads the engine's per-op errors (*mooncake.BatchError):
// nil for an op that landed; mooncake.ErrRejected for one the peer
// refused (the TCP engine's v2 reject status: a range not registered or,
// with read grants, not granted); mooncake.ErrNotAttempted for one
// skipped once another op had failed. The cgo engine reports a refused op
// as a plain failed transfer, so its batches are never Refused.
func ClassifyFailure(err error) Failure {
	var f Failure
	var be *mooncake.BatchError
	refusedOnly := false
	if errors.As(err, &be) {
		refusedOnly = true
		for _, e := range be.Errs {
			switch {
			case e == nil:
				f.Moved = true
			case errors.Is(e, mooncake.ErrRejected), errors.Is(e, mooncake.ErrNotAttempted):
			default:
				refusedOnly = false
			}
		}
	}
	f.Refused = errors.Is(err, mooncake.ErrRejected)
	f.RefusedOnly = f.Refused && refusedOnly
	f.ConnLost = errors.Is(err, mooncake.ErrPeerClosed) || errors.Is(err, syscall.ECONNREFUSED) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
	return f
}
