package decode

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/kvflow/kvflow/pipeline"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/read"
)

func TestFailureReason(t *testing.T) {
	wrap := func(stage string, err error) error { return fmt.Errorf("stage %s: %w", stage, err) }
	mismatch := &handshake.MismatchError{Peer: "peer P tp 0", Mismatches: []handshake.Mismatch{{Field: "block_size"}}}
	for _, tc := range []struct {
		err   error
		stage string
		want  string
	}{
		{fmt.Errorf("%w (stage read: boom)", job.ErrAborted), "read", "aborted"},
		{wrap("read", pipeline.ErrCanceled), "read", "shutdown"},
		{ErrClosed, "", "shutdown"},
		{wrap("handshake", fmt.Errorf("handshake engine %q: %w", "P", mismatch)), "handshake", "incompatible"},
		{wrap("read", read.ErrPeerNotKvflow), "read", "incompatible"},
		{wrap("read", ErrLeaseLost), "read", "stale"},
		{wrap("read", ErrStaleRead), "read", "stale"},
		{wrap("read", fmt.Errorf("%w; peer closed", read.ErrPeerRestarted)), "read", "peer_restarted"},
		{wrap("handshake", fmt.Errorf("handshake engine %q: %w", "P", &job.BootEpochError{Endpoint: "h:1", Now: 6, Request: 5})), "handshake", "peer_restarted"},
		{wrap("read", read.ErrShortfall), "read", "short_read"},
		{wrap("read", context.DeadlineExceeded), "read", "timeout"},
		{wrap("handshake", errors.New("get_meta: no reply")), "handshake", "handshake"},
		{wrap("read", errors.New("mooncake: request rejected by peer")), "read", "read"},
		{wrap("stitch", errors.New("bad block")), "stitch", "stitch"},
		{wrap("notify", errors.New("no ACK")), "notify", "notify"},
		{errors.New("?"), "plan", "other"},
	} {
		got := failureReason(tc.err, tc.stage)
		if got != tc.want {
			t.Errorf("failureReason(%v, %q) = %q, want %q", tc.err, tc.stage, got, tc.want)
		}
		if !slices.Contains(failureReasons, got) {
			t.Errorf("reason %q is not in the fixed label set", got)
		}
	}
}
