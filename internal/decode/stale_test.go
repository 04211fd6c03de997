package decode

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/internal/tooling/testkit/fakes/leasefake"
	"github.com/kvflow/kvflow/stages/plan"
)

// A request from a peer without leases that waits past the prefill's abort
// timeout before its read fails with the stale-read reason and is never
// read; from a leased peer it is read (the lease held the blocks).
func TestWorkerStaleReadGuard(t *testing.T) {
	const abort = 60 * time.Millisecond
	for _, tc := range []struct {
		name  string
		ttl   time.Duration
		stale bool
	}{
		{"no lease: refused", 0, true},
		{"leased: read", time.Second, false},
	} {
		t.Run(tc.name, inBubble(func(t *testing.T) {
			f := newPeerFetcher(tc.ttl)
			var reads atomic.Int32
			w, reg := admissionWorker(t, f, &leasefake.Renewer{}, &reads, StageSizes{}, func(o *Options) { o.PeerAbortTimeout = abort })
			warm(t, w)
			mustLoad(t, w, loadReq("stall", portStall))
			<-f.stalled
			mustLoad(t, w, loadReq("b", portPeer))
			time.Sleep(2 * abort) // synctest's clock: exactly 2×abort, however loaded the machine
			close(f.stall)
			done, failed := waitEnded(t, w, "stall", "b")
			refused := w.counter(t, "kvflow_decode_stale_reads_refused_total", "")
			if !tc.stale {
				if len(done) != 2 || refused != 0 || reads.Load() != 2 {
					t.Fatalf("done %v failed %+v, %v refused, %d reads", done, failed, refused, reads.Load())
				}
				return
			}
			if len(failed) != 1 || failed[0].RequestID != "b" || !strings.Contains(failed[0].Reason, "past the prefill's abort timeout") ||
				!strings.Contains(failed[0].Reason, "stage read") {
				t.Fatalf("failed %+v, want b refused at its read", failed)
			}
			if refused != 1 || reads.Load() != 1 {
				t.Fatalf("%v refused, %d reads; want 1 refused and only stall read", refused, reads.Load())
			}
			if n, err := testutil.GatherAndCount(reg, "kvflow_decode_stale_reads_refused_total"); err != nil || n != 1 {
				t.Fatalf("metric: %d series, %v", n, err)
			}
		}))
	}
}

// A read that started while the lease held and ended after it may have
// run out (RENEWs failing meanwhile) fails: the prefill may have freed and
// reused the blocks while they were read. With RENEWs acknowledged the
// same long read ends done.
func TestLeaseLostDuringRead(t *testing.T) {
	// On synctest's clock (the read is held exactly as long as the test
	// says, however loaded the machine).
	const ttl = time.Second // renewed every 333 ms, trusted for 800 ms after an ACK
	for _, tc := range []struct {
		name string
		cut  bool
	}{
		{"renewals fail during the read", true},
		{"renewals acknowledged", false},
	} {
		t.Run(tc.name, inBubble(func(t *testing.T) {
			rn := &leasefake.Renewer{}
			started, release := make(chan struct{}), make(chan struct{})
			w, reg := admissionWorker(t, newPeerFetcher(ttl), rn, new(atomic.Int32), StageSizes{}, func(o *Options) {
				o.Transfer = transferFunc(func(ctx context.Context, _ string, _ []plan.Op) error {
					close(started)
					select {
					case <-release:
						return nil
					case <-ctx.Done():
						return ctx.Err()
					}
				})
			})
			mustLoad(t, w, loadReq("r", portPeer))
			<-started
			// On synctest's clock nothing has run past the read's start:
			// the first RENEW (due renewCoalesce after admission) is still
			// to go, and it fails when cut.
			if tc.cut {
				rn.SetErr(errors.New("side channel cut"))
			}
			// Hold the read for longer than a TTL: the lease is no longer
			// trusted when no RENEW was acknowledged (cut), and still
			// trusted when they were (renewed every TTL/3).
			time.Sleep(ttl + ttl/5)
			h, ok := w.rn.LeaseOf("r", ep(portPeer))
			if !ok {
				t.Fatal("r not leased")
			}
			if trusted := !h.Lapsed && time.Now().Before(h.Until()); trusted == tc.cut {
				t.Fatalf("hold %+v trusted %v after %v, want %v", h, trusted, ttl+ttl/5, !tc.cut)
			}
			close(release)
			done, failed := waitEnded(t, w, "r")
			lost := w.counter(t, "kvflow_decode_lease_lost_reads_total", "")
			if !tc.cut {
				if len(done) != 1 || lost != 0 {
					t.Fatalf("done %v failed %+v, %v lost", done, failed, lost)
				}
				return
			}
			if len(failed) != 1 || !strings.Contains(failed[0].Reason, "lease not renewed") || !strings.Contains(failed[0].Reason, "read ended when no RENEW acknowledged") {
				t.Fatalf("done %v failed %+v, want r failed after its read", done, failed)
			}
			if n, err := testutil.GatherAndCount(reg, "kvflow_decode_lease_lost_reads_total"); err != nil || n != 1 || lost != 1 {
				t.Fatalf("metric: %d series, %v lost, %v", n, lost, err)
			}
		}))
	}
}
