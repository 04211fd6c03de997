package notify

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/internal/tooling/testkit/fakes"
	"github.com/kvflow/kvflow/stages/job"
)

// TestSilentPeerNoDone: after a failure, the DONE to a rank whose side
// channel refused or did not answer this request's GET_META is not sent
// (counted undelivered); every other rank's DONE is, whatever else failed.
func TestSilentPeerNoDone(t *testing.T) {
	const ep1, ep2 = "10.0.0.1:1", "10.0.0.1:2"
	refused := fmt.Errorf("dial: %w", job.ErrRefused)
	noReply := fmt.Errorf("get_meta: %w", job.ErrNoReply)
	for _, tc := range []struct {
		name  string
		cause error
		sent  []string // endpoints that got a DONE
	}{
		{"success", nil, []string{ep1, ep2}},
		{"handshake refused at rank 2", job.AtPeer(job.HopHandshake, ep2, refused), []string{ep1}},
		{"handshake no reply at rank 1", fmt.Errorf("stage handshake: %w", job.AtPeer(job.HopHandshake, ep1, noReply)), []string{ep2}},
		{"both silent", errors.Join(job.AtPeer(job.HopHandshake, ep1, noReply), job.AtPeer(job.HopHandshake, ep2, refused)), nil},
		{"handshake bad reply at rank 2", job.AtPeer(job.HopHandshake, ep2, errors.New("bad metadata")), []string{ep1, ep2}},
		{"read refused at rank 2 (side channel may answer)", job.AtPeer(job.HopRead, ep2, refused), []string{ep1, ep2}},
		{"unnamed no reply", noReply, []string{ep1, ep2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &fakes.Sender{}
			st, err := New(Config{}, Deps{Sender: s})
			if err != nil {
				t.Fatal(err)
			}
			j := testJob([]int{1, 2}, nil)
			if tc.cause == nil {
				err = st.Process(context.Background(), j)
			} else {
				err = st.ProcessFailed(context.Background(), j, tc.cause)
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, d := range s.ByEndpoint() {
				got = append(got, d.Endpoint)
			}
			if !slices.Equal(got, tc.sent) {
				t.Fatalf("DONEs to %v, want %v", got, tc.sent)
			}
			skipped := 2 - len(tc.sent)
			if int(j.DoneUndelivered.Load()) != skipped || testutil.ToFloat64(st.m.undelivered) != float64(skipped) {
				t.Fatalf("undelivered %d / %v, want %d", j.DoneUndelivered.Load(), testutil.ToFloat64(st.m.undelivered), skipped)
			}
		})
	}
}
