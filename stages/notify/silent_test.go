package notify

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/internal/tooling/testkit/fakes"
	"github.com/kvflow/kvflow/stages/job"
)

// TestSilentPeerDone: after a failure, the DONE to a rank whose side
// channel refused this request's GET_META is not sent (counted
// skipped_refused), the one to a rank that did not answer it gets one
// attempt (a deadline of one attempt's timeout), every other rank's DONE
// is sent with every attempt, whatever else failed.
func TestSilentPeerDone(t *testing.T) {
	const ep1, ep2 = "10.0.0.1:1", "10.0.0.1:2"
	refused := fmt.Errorf("dial: %w", job.ErrRefused)
	noReply := fmt.Errorf("get_meta: %w", job.ErrNoReply)
	for _, tc := range []struct {
		name  string
		cause error
		sent  []string // endpoints that got a DONE
		once  []string // of those, the ones sent with one attempt
	}{
		{"success", nil, []string{ep1, ep2}, nil},
		{"handshake refused at rank 2", job.AtPeer(job.HopHandshake, ep2, refused), []string{ep1}, nil},
		{"handshake no reply at rank 1", fmt.Errorf("stage handshake: %w", job.AtPeer(job.HopHandshake, ep1, noReply)), []string{ep1, ep2}, []string{ep1}},
		{"both silent", errors.Join(job.AtPeer(job.HopHandshake, ep1, noReply), job.AtPeer(job.HopHandshake, ep2, refused)), []string{ep1}, []string{ep1}},
		{"handshake bad reply at rank 2", job.AtPeer(job.HopHandshake, ep2, errors.New("bad metadata")), []string{ep1, ep2}, nil},
		{"read refused at rank 2 (side channel may answer)", job.AtPeer(job.HopRead, ep2, refused), []string{ep1, ep2}, nil},
		{"unnamed no reply", noReply, []string{ep1, ep2}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := &fakes.Sender{}
				var mu sync.Mutex
				var once []string
				cfg := DefaultConfig()
				st, err := New(cfg, Deps{Sender: senderFunc(func(ctx context.Context, ep, id string) error {
					// Synthetic time: the deadline left is exact.
					if d, ok := ctx.Deadline(); ok && time.Until(d) == cfg.Timeout.D()+cfg.RetryBackoff.D()/2 {
						mu.Lock()
						once = append(once, ep)
						mu.Unlock()
					}
					return s.SendDone(ctx, ep, id)
				})})
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
				slices.Sort(once)
				if !slices.Equal(once, tc.once) {
					t.Fatalf("DONEs with one attempt's deadline to %v, want %v", once, tc.once)
				}
				skipped := 2 - len(tc.sent)
				if testutil.ToFloat64(st.m.refused) != float64(skipped) || testutil.ToFloat64(st.m.undelivered) != 0 {
					t.Fatalf("skipped_refused %v, undelivered %v, want %d and 0", testutil.ToFloat64(st.m.refused), testutil.ToFloat64(st.m.undelivered), skipped)
				}
			})
		})
	}
}

// senderFunc adapts a function to Sender.
type senderFunc func(ctx context.Context, endpoint, reqID string) error

func (f senderFunc) SendDone(ctx context.Context, endpoint, reqID string) error {
	return f(ctx, endpoint, reqID)
}
