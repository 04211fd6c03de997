package decode

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/peers"
	"github.com/kvflow/kvflow/pipeline"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// TestHealthGateBlame: a failure at the handshake or read stage of a
// request that reads two prefill ranks counts against the rank whose hop
// failed (job.PeerError), never against the other, and a failure that is
// not a peer's fault counts against none.
func TestHealthGateBlame(t *testing.T) {
	const ep0, ep1 = "10.0.0.1:20001", "10.0.0.1:20002"
	at := func(hop, ep string, err error) error { return job.AtPeer(hop, ep, err) }
	noReply := fmt.Errorf("sidechannel get_meta %s: timeout: no reply after 3 attempts", ep1)
	refused := fmt.Errorf("side channel %s: %w", ep1, job.ErrRefused)
	type counts struct{ fail0, fail1, ok0, ok1 uint64 }
	for _, tc := range []struct {
		name  string
		stage string // handshake or read
		err   error
		want  counts
	}{
		{"handshake rank 1 no reply", "handshake", at(job.HopHandshake, ep1, noReply), counts{fail1: 1}},
		{"handshake rank 1 refused", "handshake", at(job.HopHandshake, ep1, refused), counts{fail1: 1}},
		{"handshake rank 0 shared failure", "handshake",
			at(job.HopHandshake, ep0, fmt.Errorf("handshake: waited: %w", noReply)), counts{fail0: 1}},
		{"handshake ok", "handshake", nil, counts{}},
		{"handshake aborted", "handshake", at(job.HopHandshake, ep1, job.ErrAborted), counts{}},
		{"handshake shutdown", "handshake", at(job.HopHandshake, ep0, pipeline.ErrCanceled), counts{}},
		{"handshake incompatible", "handshake",
			at(job.HopHandshake, ep1, fmt.Errorf("engine P: %w", read.ErrPeerNotKvflow)), counts{}},
		{"handshake unnamed (plan, local)", "handshake", errors.New("plan: no ranks"), counts{}},
		{"read ok", "read", nil, counts{ok0: 1, ok1: 1}},
		{"read rank 1 lost", "read", at(job.HopRead, ep1, errors.New("connection reset")), counts{fail1: 1}},
		{"read rank 0 timeout", "read", at(job.HopRead, ep0, context.DeadlineExceeded), counts{fail0: 1}},
		{"read rank 1 short", "read", at(job.HopRead, ep1, read.ErrShortfall), counts{fail1: 1}},
		{"read both", "read", errors.Join(at(job.HopRead, ep0, errors.New("reset")), at(job.HopRead, ep1, errors.New("reset"))),
			counts{fail0: 1, fail1: 1}},
		{"read lease lost here", "read", fmt.Errorf("read: %w", ErrLeaseLost), counts{}},
		{"read stale at rank 1", "read", at(job.HopRead, ep1, ErrStaleRead), counts{}},
		{"read restarted rank 1", "read", at(job.HopRead, ep1, read.ErrPeerRestarted), counts{}},
		{"read aborted", "read", at(job.HopRead, ep0, fmt.Errorf("%w: %w", job.ErrAborted, context.Canceled)), counts{}},
		{"read shutdown", "read", pipeline.ErrCanceled, counts{}},
		{"read unnamed", "read", errors.New("read: something local"), counts{}},
		{"stall refusal", "read", fmt.Errorf("stage read: key %q: %w", "P@"+ep1, pipeline.ErrKeyStalled), counts{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := peers.New(peers.Options{DownAfter: 3})
			if err != nil {
				t.Fatal(err)
			}
			j := job.New(plan.Request{ID: "r"}, time.Time{})
			j.Plan = plan.Plan{RemoteHost: "10.0.0.1", Tasks: []plan.Task{{HandshakePort: 20001}, {HandshakePort: 20002}, {HandshakePort: 20001}}}
			st := gate(tc.stage, pipeline.StageFunc[*job.Job](func(context.Context, *job.Job) error { return tc.err }), h)
			if got := st.Process(context.Background(), j); !errors.Is(got, tc.err) {
				t.Fatalf("Process returned %v, want %v", got, tc.err)
			}
			var got counts
			for _, s := range h.Snapshot() {
				if s.InFlight != 0 {
					t.Errorf("%s: %d in flight after the stage", s.Peer, s.InFlight)
				}
				switch s.Peer {
				case ep0:
					got.fail0, got.ok0 = s.Failures, s.Successes
				case ep1:
					got.fail1, got.ok1 = s.Failures, s.Successes
				}
			}
			if got != tc.want {
				t.Fatalf("failures/successes %+v, want %+v", got, tc.want)
			}
		})
	}
}

// TestHealthGateOnlyBlamedGoesDown: requests reading two ranks, of which
// one fails every time, mark that one down after peers.down_after and
// leave the other up with no failure; a request to the down rank then
// fails at once with peer_down, before the stage runs.
func TestHealthGateOnlyBlamedGoesDown(t *testing.T) {
	const ep0, ep1 = "10.0.0.1:20001", "10.0.0.1:20002"
	h, err := peers.New(peers.Options{DownAfter: 3})
	if err != nil {
		t.Fatal(err)
	}
	calls := 0
	st := gate("handshake", pipeline.StageFunc[*job.Job](func(context.Context, *job.Job) error {
		calls++
		return job.AtPeer(job.HopHandshake, ep1, errors.New("no reply"))
	}), h)
	for range 3 {
		j := job.New(plan.Request{ID: "r"}, time.Time{})
		j.Plan = plan.Plan{RemoteHost: "10.0.0.1", Tasks: []plan.Task{{HandshakePort: 20001}, {HandshakePort: 20002}}}
		st.Process(context.Background(), j)
	}
	for _, s := range h.Snapshot() {
		switch {
		case s.Peer == ep0 && (s.State != peers.Up || s.Failures != 0):
			t.Errorf("healthy rank: %+v", s)
		case s.Peer == ep1 && (s.State != peers.Down || s.Consecutive != 3):
			t.Errorf("failing rank: %+v", s)
		}
	}
	j := job.New(plan.Request{ID: "r"}, time.Time{})
	j.Plan = plan.Plan{RemoteHost: "10.0.0.1", Tasks: []plan.Task{{HandshakePort: 20001}, {HandshakePort: 20002}}}
	if err := st.Process(context.Background(), j); !errors.Is(err, peers.ErrPeerDown) || failureReason(err, "handshake") != "peer_down" {
		t.Fatalf("after down: %v", err)
	}
	if calls != 3 {
		t.Fatalf("stage ran %d times, want 3 (not for the request to the down rank)", calls)
	}
}
