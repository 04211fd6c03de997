package decode

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/stages/job"
)

func TestStaleRead(t *testing.T) {
	const abort = time.Second
	admitted := time.Unix(1000, 0)
	mk := func(ttls ...time.Duration) *job.Job {
		j := leaseJob("r", make([]int, len(ttls)), ttls)
		for i := range j.Plan.Tasks {
			j.Plan.Tasks[i].HandshakePort = 5000 + i
		}
		j.Submitted = admitted
		return j
	}
	for _, tc := range []struct {
		name       string
		j          *job.Job
		abort      time.Duration
		after      time.Duration
		notRenewed bool // no Renewer: advertised leases are never renewed
		stale      bool
	}{
		{"in time", mk(0), abort, abort - time.Millisecond, false, false},
		{"at the timeout", mk(0), abort, abort, false, false},
		{"past the timeout, no lease", mk(0), abort, abort + time.Millisecond, false, true},
		{"past the timeout, leased", mk(time.Second), abort, 10 * abort, false, false},
		{"past the timeout, lease advertised but not renewed", mk(time.Second), abort, 2 * abort, true, true},
		{"past the timeout, one rank without a lease", mk(time.Second, 0), abort, 2 * abort, false, true},
		{"no check configured", mk(0), 0, 10 * abort, false, false},
		{"nothing to read", mk(), abort, 10 * abort, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := staleRead(tc.j, tc.abort, admitted.Add(tc.after), !tc.notRenewed)
			if got := errors.Is(err, ErrStaleRead); got != tc.stale {
				t.Fatalf("staleRead = %v, want stale %v", err, tc.stale)
			}
			if tc.stale && !strings.Contains(err.Error(), "past the prefill's abort timeout") {
				t.Fatalf("reason %q does not say why", err)
			}
		})
	}
}

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
		{"leased: read", 90 * time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newPeerFetcher(tc.ttl)
			var reads atomic.Int32
			w, reg := admissionWorker(t, f, &fakeRenewer{}, &reads, StageSizes{}, func(o *Options) { o.PeerAbortTimeout = abort })
			warm(t, w)
			mustLoad(t, w, loadReq("stall", portStall))
			<-f.stalled
			mustLoad(t, w, loadReq("b", portPeer))
			time.Sleep(2 * abort)
			close(f.stall)
			done, failed := waitEnded(t, w, "stall", "b")
			refused := testutil.ToFloat64(w.stale)
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
		})
	}
}
