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
	"errors"
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

// ErrBootEpoch marks a job whose kv_transfer_params name, for one of its
// prefill ranks, a boot epoch other than the one that rank's metadata
// carries: the process that prefilled the request (and held its blocks)
// is gone, and the one answering now reuses that memory for its own
// requests. The job must fail without reading a byte of it.
var ErrBootEpoch = errors.New("job: prefill restarted since the request was handed over")

// BootEpochError is ErrBootEpoch for one prefill rank.
type BootEpochError struct {
	Endpoint string // the rank's side channel, host:port
	Now      uint64 // the boot epoch the rank's metadata carries
	Request  uint64 // the boot epoch kv_transfer_params.kvflow_boot_epochs gives for it
}

func (e *BootEpochError) Error() string {
	return fmt.Sprintf("prefill %s restarted (boot epoch %d, request from epoch %d): its blocks are gone", e.Endpoint, e.Now, e.Request)
}

// Unwrap makes errors.Is(err, ErrBootEpoch) hold.
func (e *BootEpochError) Unwrap() error { return ErrBootEpoch }

// ErrBootEpochsShort marks kv_transfer_params.kvflow_boot_epochs that have
// no entry for a prefill rank the request reads from (a malformed request:
// a kvflow prefill lists every rank of its instance).
var ErrBootEpochsShort = errors.New("job: kv_transfer_params.kvflow_boot_epochs has no entry for a prefill rank the request reads")

// CheckBootEpochs checks that the request's kvflow_boot_epochs, when it
// has any, covers the prefill rank of every task (a request without them,
// from a seed prefill, passes).
func (j *Job) CheckBootEpochs() error {
	n := len(j.Req.BootEpochs)
	if n == 0 {
		return nil
	}
	for _, t := range j.Plan.Tasks {
		if t.RemoteRank < 0 || t.RemoteRank >= n {
			return fmt.Errorf("%w: %d entries, prefill rank %d (port %d) is read", ErrBootEpochsShort, n, t.RemoteRank, t.HandshakePort)
		}
	}
	return nil
}

// RequestEpoch is the boot epoch the request's kv_transfer_params give
// for task i's prefill rank; 0 when they give none (a seed prefill, or a
// rank whose epoch the prefill's scheduler did not know).
func (j *Job) RequestEpoch(i int) uint64 {
	r := j.Plan.Tasks[i].RemoteRank
	if r < 0 || r >= len(j.Req.BootEpochs) {
		return 0
	}
	return j.Req.BootEpochs[r]
}

// CheckBootEpoch is a *BootEpochError when both the request and m (task
// i's rank's metadata) know a boot epoch for the rank and they differ;
// nil otherwise: a seed prefill sends no epoch in either, so a request
// from one is read as before.
func (j *Job) CheckBootEpoch(i int, m Meta) error {
	want := j.RequestEpoch(i)
	if want == 0 || m.BootEpoch == 0 || want == m.BootEpoch {
		return nil
	}
	return &BootEpochError{Endpoint: j.HandshakeEndpoint(i), Now: m.BootEpoch, Request: want}
}

// OwesDone reports whether task i's rank gets the request's DONE: not
// when its metadata (j.Metas[i], if known) shows another boot epoch than
// the request's. That process never held the request: the one that did is
// gone with its blocks, and a DONE could only free a request of the new
// process that happens to have the same id (a router retrying it there)
// while its own decode still reads it. The seed sends DONE to every task
// regardless (it knows no epochs); kvflow skips only this case, where no
// process that could owe the request anything is left to tell.
func (j *Job) OwesDone(i int) bool {
	if i >= len(j.Metas) {
		return true
	}
	return j.CheckBootEpoch(i, j.Metas[i]) == nil
}

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
