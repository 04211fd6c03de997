package read

import (
	"context"
	"errors"

	"github.com/kvflow/kvflow/stages/plan"
)

// Transfer is the read stage's one dependency on a transfer backend: it
// runs one batch of a task's reads. What it can do beyond plain reads it
// states once, in Capabilities, which New reads once; the stage then sets
// only the Batch options the transfer honours. Engine adapts
// hw/mooncake's engines; OpsFunc adapts a function of an op list.
type Transfer interface {
	// BatchRead runs b as one all-or-nothing batch from session
	// "host:rpc_port" into local memory. b, and the lists b.Reads aliases,
	// are valid only during the call: keep nothing of them.
	BatchRead(ctx context.Context, session string, b *Batch) error
	// Capabilities says which of Batch's options the transfer honours.
	// New calls it once; it must not change.
	Capabilities() Capabilities
}

// Capabilities are what a Transfer can do beyond plain reads.
type Capabilities struct {
	// LocalStride: Batch.Row and Batch.Pitch lay every op's bytes out in
	// strided local rows (hw/mooncake's StridedReader). With it the stage
	// fuses the head transpose of P > 1 requests into the read
	// (plan.Reads.Interleave) and the stitch stage has nothing left to do.
	LocalStride bool
	// Gather: Batch.Gather reads a head-split task's rows (decode TP above
	// prefill TP) in their strided form, plan.Reads.AppendGather: a few
	// ops of strided remote rows instead of one op per row
	// (hw/mooncake's GatherReader).
	Gather bool
	// Ledger: Batch.Landed gets, per op, the bytes that landed in local
	// memory (Mooncake's transferred_bytes); the stage reconciles them
	// with what it posted and fails the job on any shortfall, even when
	// the batch reported success.
	Ledger bool
	// Classify tells how a failed batch failed; nil: the transfer cannot
	// tell, and the stage never retries a read (see retry.go).
	Classify func(err error) Failure
}

// Batch is one batch of reads: a task's reads in compact form (Reads),
// or, when Reads is nil, an op list (List: a fault injector's prefix).
// At most one of the stride options is set, and only those the
// transfer's Capabilities allow.
type Batch struct {
	Reads *plan.Reads
	List  []plan.Op
	// Row and Pitch, when Row > 0 (Capabilities.LocalStride): every op's
	// bytes land in rows of Row bytes, Pitch apart, from its Local.
	Row, Pitch uint64
	// Gather (Capabilities.Gather, Reads of a head-split task): read the
	// strided form, Reads.AppendGather, under Reads.GatherStride.
	Gather bool
	// Landed, when not nil (Capabilities.Ledger, plain reads only): one
	// entry per op (Len), set to the bytes of that op that landed.
	Landed []uint64
	// Request is the id of the request the reads are for, as its prefill
	// knows it (what DONE_RECVING carries); "" when unknown. A transfer
	// that checks grants per request itself (node.te_backend shm's
	// same-host reads) refuses blocks its request no longer holds; others
	// ignore it.
	Request string
}

// Len is the number of ops of the batch's plain form (Landed's length).
func (b *Batch) Len() int {
	if b.Reads != nil {
		return b.Reads.Len()
	}
	return len(b.List)
}

// AppendTo appends the batch's ops to dst, in the form the transfer is
// asked to run: the strided form with Gather, the plain ops otherwise
// (compact reads expanded).
func (b *Batch) AppendTo(dst []plan.Op) []plan.Op {
	switch {
	case b.Reads == nil:
		return append(dst, b.List...)
	case b.Gather:
		return b.Reads.AppendGather(dst)
	}
	return b.Reads.AppendTo(dst)
}

// At is op i of the plain form, 0 <= i < Len().
func (b *Batch) At(i int) plan.Op {
	if b.Reads != nil {
		return b.Reads.At(i)
	}
	return b.List[i]
}

// OpsFunc adapts a function that reads an op list to a Transfer with no
// capabilities (tests, fakes, an engine without a Go op type of its own).
type OpsFunc func(ctx context.Context, session string, ops []plan.Op) error

// BatchRead expands b's ops and calls f.
func (f OpsFunc) BatchRead(ctx context.Context, session string, b *Batch) error {
	if b.Row > 0 || b.Gather || b.Landed != nil {
		return errNotCapable
	}
	return f(ctx, session, b.AppendTo(nil))
}

// Capabilities is none.
func (OpsFunc) Capabilities() Capabilities { return Capabilities{} }

// errNotCapable: a Batch asked for an option its transfer did not state.
var errNotCapable = errors.New("read: batch option the transfer does not support")
