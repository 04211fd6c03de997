package decode

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/kvflow/kvflow/internal/peers"
	"github.com/kvflow/kvflow/pipeline"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/notify"
)

// Peer health (Options.Health): requests to a prefill peer marked down fail
// at once at the handshake and read stages (reason peer_down), and its
// DONEs are not sent (each counted undelivered); reads' and DONEs'
// outcomes, and failed handshakes, feed the tracker.
//
// Blame: a failure counts against the peer(s) whose hop failed, never
// against every peer of the request. The stage names them: the handshake
// and read stages wrap a task's failure in a job.PeerError with its rank's
// endpoint (job.Blame finds them), and the DONEs are recorded one endpoint
// at a time (healthSender). A failure that names no peer, or whose cause
// is this worker's or the request's own (an abort, a shutdown, a plan or
// lease problem here, a stale read refused, an incompatible peer), counts
// against none; so does a refusal by a peer's keyed queue (peer_stalled,
// see peerFailure).

// endpoints is j's side-channel endpoints, each once (before planning:
// none).
func endpoints(j *job.Job) []string {
	eps := make([]string, 0, 1)
	for i := range j.Plan.Tasks {
		if ep := j.HandshakeEndpoint(i); !slices.Contains(eps, ep) {
			eps = append(eps, ep)
		}
	}
	return eps
}

// peerFailure says whether err, a request's failure, says something about
// its peer (it failed or timed out there) rather than about the request
// (aborted, stale, incompatible) or this worker (shutdown).
//
// A stall refusal (peer_stalled: the peer's keyed read or notify queue
// and the park budget are full while none of its items ended well for
// the adaptive stall time, pipeline.ErrKeyStalled) deliberately does not
// count. It measures this worker's offered load, not the peer: how many
// refusals come in a row depends on how many requests arrive while the
// peer is stalled, so counting them would mark a slow but alive peer down
// within a burst, and then fail all its requests (also those its queue
// would have served) until a probe answers — which a peer whose transfer
// engine is slow but whose side channel answers does within a probe
// interval, so it would flap. The evidence is counted already: the reads
// or DONEs the peer holds end, and each that fails or times out counts
// once.
func peerFailure(err error) bool {
	switch failureReason(err, "read") {
	case "timeout", "read", "handshake", "short_read", "notify":
		return true
	}
	return false
}

// blamed is the endpoints err's failure counts against: those of its
// job.PeerErrors whose cause is the peer's (peerFailure), each once.
func blamed(err error) []string {
	var eps []string
	for _, pe := range job.Blame(err) {
		if peerFailure(pe) && !slices.Contains(eps, pe.Endpoint) {
			eps = append(eps, pe.Endpoint)
		}
	}
	return eps
}

// gate puts the handshake and read stages behind the peer-health check
// (the others as they are).
func gate(name string, st pipeline.Stage[*job.Job], h *peers.Tracker) pipeline.Stage[*job.Job] {
	switch name {
	case "handshake":
		return healthGate{Stage: st, h: h, recordFail: true}
	case "read":
		return healthGate{Stage: st, h: h, record: true}
	}
	return st
}

// healthGate is a stage behind the peer-health check. With record, the
// stage's outcome is recorded: a success for every endpoint of the job (each
// answered), a failure for the endpoints it blames (blamed), nothing for
// the others (their reads were canceled or ended well, unseen). With
// recordFail, only failures are (a handshake served from the cache says
// nothing of the peer).
type healthGate struct {
	pipeline.Stage[*job.Job]
	h                  *peers.Tracker
	record, recordFail bool
}

func (g healthGate) Process(ctx context.Context, j *job.Job) error {
	eps := endpoints(j)
	for _, ep := range eps {
		if err := g.h.Check(ep); err != nil {
			return err
		}
	}
	if g.record {
		for _, ep := range eps {
			g.h.Begin(ep)
		}
	}
	err := g.Stage.Process(ctx, j)
	var blame []string
	if err != nil {
		blame = blamed(err)
	}
	switch {
	case g.record:
		for _, ep := range eps {
			switch {
			case err == nil:
				g.h.End(ep, nil)
			case slices.Contains(blame, ep):
				g.h.End(ep, err)
			default:
				g.h.Skip(ep)
			}
		}
	case g.recordFail:
		for _, ep := range blame {
			g.h.Begin(ep)
			g.h.End(ep, err)
		}
	}
	return err
}

// healthSender is a notify.Sender behind the peer-health check: a DONE to a
// peer marked down fails at once; every DONE's outcome is recorded.
type healthSender struct {
	s  notify.Sender
	bs notify.BatchSender // nil when s does not batch
	h  *peers.Tracker
}

// batchingHealthSender is a healthSender whose sender batches.
type batchingHealthSender struct{ healthSender }

func newHealthSender(s notify.Sender, h *peers.Tracker) notify.Sender {
	hs := healthSender{s: s, h: h}
	if bs, ok := s.(notify.BatchSender); ok {
		hs.bs = bs
		return batchingHealthSender{hs}
	}
	return hs
}

func (s healthSender) send(ctx context.Context, endpoint, reqID string, f func(context.Context, string, string) error) error {
	if err := s.h.Check(endpoint); err != nil {
		return fmt.Errorf("DONE %s: %w", reqID, err)
	}
	s.h.Begin(endpoint)
	err := f(ctx, endpoint, reqID)
	if err != nil && (errors.Is(err, context.Canceled) && ctx.Err() != nil) {
		s.h.Skip(endpoint) // this worker gave up (shutdown), not the peer
		return err
	}
	s.h.End(endpoint, err)
	return err
}

func (s healthSender) SendDone(ctx context.Context, endpoint, reqID string) error {
	return s.send(ctx, endpoint, reqID, s.s.SendDone)
}

func (s batchingHealthSender) SendDoneBatched(ctx context.Context, endpoint, reqID string) error {
	return s.send(ctx, endpoint, reqID, s.bs.SendDoneBatched)
}
