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
func peerFailure(err error) bool {
	switch failureReason(err, "read") {
	case "timeout", "read", "handshake", "short_read", "notify":
		return true
	}
	return false
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
// stage's outcome is recorded for every endpoint of the job (a success
// marks them answering); with recordFail, only failures are.
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
	switch {
	case g.record:
		for _, ep := range eps {
			if err == nil || peerFailure(err) {
				g.h.End(ep, err)
			} else {
				g.h.Skip(ep)
			}
		}
	case g.recordFail && err != nil && peerFailure(err):
		for _, ep := range eps {
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
