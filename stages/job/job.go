// Package job is the item that flows through kvflow's decode pipeline: one
// pull request, its plan, the metadata of its remote ranks and what the
// stages recorded about it.
//
// A stage that fails at one remote rank says which (PeerError, Blame), so
// that the failure is blamed on that rank only.
//
// A Job is owned by one stage at a time (the pipeline hands it on); inside
// a stage, goroutines that work on one task write only that task's slot.
// The package holds data only: it never does I/O and starts no goroutine.
package job

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/stages/plan"
)

// Meta is a remote prefill rank's agent metadata (the seed's
// MooncakeAgentMetadata, plus kvflow's boot epoch, lease TTL and batched
// DONE support when the peer sends them).
type Meta struct {
	EngineID  string
	TERPCPort int
	BaseAddrs []uint64
	NumBlocks int
	BootEpoch uint64
	// LeaseTTL > 0: the peer takes RENEW and holds a renewed request's
	// blocks for LeaseTTL after each renewal (0: a seed peer, or leases
	// off; never send it RENEW).
	LeaseTTL time.Duration
	// BatchDone: the peer takes kvflow's batched DONE (done_batch_msg);
	// false: a seed or older kvflow peer, send it plain DONE_RECVINGs only.
	BatchDone bool
	// Cache is the peer's cache fingerprint (kvflow's metadata extension);
	// nil: a seed or Mooncake peer, or an older kvflow one.
	Cache *npu.Fingerprint
}

// Job is one pull request on its way through the decode pipeline.
type Job struct {
	Req       plan.Request
	Submitted time.Time

	// Plan is set by the plan stage.
	Plan plan.Plan
	// Metas[i] is the metadata of Plan.Tasks[i]'s remote rank, set by the
	// handshake stage.
	Metas []Meta

	// BytesRead counts bytes the read stage moved (atomic: tasks of one
	// request are read concurrently).
	BytesRead atomic.Uint64
	// OpsRead counts transfer ops posted.
	OpsRead atomic.Uint64
	// Stitched is set by the read stage when it read the blocks straight
	// into their stitched layout (the head transpose fused into the read):
	// the stitch stage then leaves them as they are.
	Stitched bool
	// DoneUndelivered counts DONE messages the notify stage could not
	// deliver (does not fail a request whose bytes all landed).
	DoneUndelivered atomic.Int32

	ctx    context.Context
	cancel context.CancelCauseFunc
}

// New makes a job for req. Abort cancels the context the stages derive
// from Context.
func New(req plan.Request, now time.Time) *Job {
	ctx, cancel := context.WithCancelCause(context.Background())
	return &Job{Req: req, Submitted: now, ctx: ctx, cancel: cancel}
}

// ErrAborted is the cause of a job aborted by the engine.
var ErrAborted = fmt.Errorf("job: aborted")

// Abort cancels the job: stages working on it see their context end.
func (j *Job) Abort(cause error) {
	if cause == nil {
		cause = ErrAborted
	}
	j.cancel(cause)
}

// Aborted returns the abort cause, or nil.
func (j *Job) Aborted() error {
	if j.ctx.Err() == nil {
		return nil
	}
	return context.Cause(j.ctx)
}

// Context returns a context that ends when parent ends or the job is
// aborted; call the returned stop when done with it.
func (j *Job) Context(parent context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(parent)
	stop := context.AfterFunc(j.ctx, func() { cancel(context.Cause(j.ctx)) })
	return ctx, func() { stop(); cancel(context.Canceled) }
}

// Release frees the job's context resources; call it when the job ended.
func (j *Job) Release() { j.cancel(context.Canceled) }

// HandshakeEndpoint is "host:port" of task i's side channel.
func (j *Job) HandshakeEndpoint(i int) string {
	return net.JoinHostPort(j.Plan.RemoteHost, strconv.Itoa(j.Plan.Tasks[i].HandshakePort))
}

// Session is the transfer-engine session of task i: the seed's
// "host:te_rpc_port".
func (j *Job) Session(i int) string {
	return net.JoinHostPort(j.Plan.RemoteHost, strconv.Itoa(j.Metas[i].TERPCPort))
}

// StitchBlocks is the set of local blocks the stitch must reorder: the
// local blocks of every task with P > 1, each once, in first-seen order.
func (j *Job) StitchBlocks() []int {
	if !j.Plan.Stitch {
		return nil
	}
	seen := map[int]bool{}
	var out []int
	for _, t := range j.Plan.Tasks {
		for _, b := range t.LocalBlockIDs {
			if !seen[b] {
				seen[b] = true
				out = append(out, b)
			}
		}
	}
	return out
}
