package decode

import (
	"context"
	"errors"

	"github.com/kvflow/kvflow/internal/peers"
	"github.com/kvflow/kvflow/pipeline"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/read"
)

// failureReasons is the fixed label set of kvflow_decode_failures_total
// (never a request id or a peer: bounded by construction).
var failureReasons = []string{
	"aborted",        // the engine aborted the request
	"shutdown",       // the worker closed before the request ended
	"timeout",        // a deadline passed (request, read.timeout, handshake)
	"incompatible",   // the peer's cache or topology differs (compatibility check)
	"stale",          // refused as a stale read (abort timeout passed, lease lost)
	"peer_restarted", // the prefill rank restarted and lost the request's blocks (or booted after the epoch its kv_transfer_params name)
	"short_read",     // the byte ledger showed ops not fully landed
	"peer_down",      // its prefill peer was marked down (failed in a row; probed until it answers)
	"peer_stalled",   // its prefill peer's queue and the stage's park budget were full and none of its reads (DONEs) succeeded for the adaptive stall time
	"too_many_peers", // more distinct prefill peers than peers.max_peers at once
	"handshake",      // metadata fetch failed (peer down, bad metadata, ...)
	"read",           // the transfer failed (refused, connection lost, ...)
	"stitch",         // the head transpose failed
	"notify",         // the DONE could not be delivered
	"other",
}

// failureReason classifies a failed request's error (and the pipeline
// stage where it first failed) into one of failureReasons: the most
// specific cause first, then the stage.
func failureReason(err error, stage string) string {
	var mismatch *handshake.MismatchError
	switch {
	case errors.Is(err, job.ErrAborted):
		return "aborted"
	case errors.Is(err, ErrClosed), errors.Is(err, pipeline.ErrClosed), errors.Is(err, pipeline.ErrCanceled):
		return "shutdown"
	case errors.As(err, &mismatch), errors.Is(err, read.ErrPeerNotKvflow):
		return "incompatible"
	case errors.Is(err, ErrStaleRead):
		return "stale"
	case errors.Is(err, read.ErrPeerRestarted), errors.Is(err, job.ErrBootEpoch):
		return "peer_restarted"
	case errors.Is(err, read.ErrShortfall):
		return "short_read"
	case errors.Is(err, peers.ErrPeerDown):
		return "peer_down"
	case errors.Is(err, pipeline.ErrKeyStalled):
		return "peer_stalled"
	case errors.Is(err, pipeline.ErrTooManyKeys):
		return "too_many_peers"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	}
	switch stage {
	case "handshake", "read", "stitch", "notify":
		return stage
	}
	return "other"
}
