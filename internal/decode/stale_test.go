package decode

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

// leaseMap is a leaseView: request id → endpoint → its hold.
type leaseMap map[string]map[string]leaseHold

func (m leaseMap) leaseOf(id, endpoint string) (leaseHold, bool) {
	h, ok := m[id][endpoint]
	return h, ok
}

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
	// A hold at 127.0.0.1:5000 whose last acknowledged RENEW was sent at
	// admitted+acked (0: none; the lease started at admission).
	const ttl = 10 * time.Second // trusted for 8 s (margin 2 s)
	held := func(acked time.Duration, lapsed bool) leaseMap {
		h := hold{since: admitted, lapsed: lapsed}
		if acked > 0 {
			h.acked = admitted.Add(acked)
		}
		return leaseMap{"r": {"127.0.0.1:5000": {h, ttl}}}
	}
	fresh := held(9*time.Second, false)
	for _, tc := range []struct {
		name   string
		j      *job.Job
		abort  time.Duration
		after  time.Duration
		leases leaseMap // nil: no Renewer (advertised leases are never renewed)
		when   string
		stale  bool
		reason string
	}{
		{"in time", mk(0), abort, abort - time.Millisecond, fresh, "started", false, ""},
		{"at the timeout", mk(0), abort, abort, fresh, "started", false, ""},
		{"past the timeout, no lease", mk(0), abort, abort + time.Millisecond, fresh, "started", true, "past the prefill's abort timeout"},
		{"past the timeout, leased and renewed", mk(ttl), abort, 10 * time.Second, fresh, "started", false, ""},
		{"past the timeout, lease advertised but not renewed", mk(ttl), abort, 2 * abort, nil, "started", true, "past the prefill's abort timeout"},
		{"past the timeout, lease advertised, not renewed here", mk(ttl), abort, 2 * abort, leaseMap{}, "started", true, "past the prefill's abort timeout"},
		{"past the timeout, one rank without a lease", mk(ttl, 0), abort, 2 * abort, fresh, "started", true, "past the prefill's abort timeout"},
		{"no check configured", mk(0), 0, 10 * abort, fresh, "started", false, ""},
		{"nothing to read", mk(), abort, 10 * abort, fresh, "started", false, ""},
		{"no abort check when a read ends", mk(0), abort, 2 * abort, fresh, "ended", false, ""},
		// Leases: trusted for ttl - ttl/5 from the last acknowledged RENEW's send time.
		{"lease: never acked, within the ttl less the margin", mk(ttl), 0, 8 * time.Second, held(0, false), "started", false, ""},
		{"lease: never acked, past the ttl less the margin", mk(ttl), 0, 8*time.Second + time.Millisecond, held(0, false), "started", true, "no RENEW acknowledged in the 8.001s since the lease started"},
		{"lease: acked, within", mk(ttl), 0, 17 * time.Second, fresh, "started", false, ""},
		{"lease: acked, past", mk(ttl), 0, 17*time.Second + time.Millisecond, fresh, "started", true, "no RENEW acknowledged in the 8.001s since the last acknowledged one was sent"},
		{"lease: past when the read ends", mk(ttl), 0, 18 * time.Second, fresh, "ended", true, "read ended when"},
		{"lease: lapsed", mk(ttl), 0, 9 * time.Second, held(9*time.Second, true), "started", true, "acknowledged only after the lease may have run out"},
		{"lease checked without an abort timeout", mk(ttl), 0, time.Hour, fresh, "started", true, "lease ttl 10s, trusted for 8s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var lv leaseView
			if tc.leases != nil {
				lv = tc.leases
			}
			err := staleRead(tc.j, tc.abort, admitted.Add(tc.after), lv, tc.when)
			if got := errors.Is(err, ErrStaleRead); got != tc.stale {
				t.Fatalf("staleRead = %v, want stale %v", err, tc.stale)
			}
			if tc.stale && !strings.Contains(err.Error(), tc.reason) {
				t.Fatalf("reason %q does not say %q", err, tc.reason)
			}
			if lease := strings.Contains(tc.name, "lease:") || strings.Contains(tc.name, "lease checked"); tc.stale && errors.Is(err, ErrLeaseLost) != lease {
				t.Fatalf("%v: ErrLeaseLost %v, want %v", err, errors.Is(err, ErrLeaseLost), lease)
			}
		})
	}
}

// TestHoldRenewed: what acknowledged RENEWs prove. The first ACK starts
// the lease (the prefill held the request by its abort timeout until it
// took one); each later one extends it from its send time, unless it came
// back after the hold had ended: then it may be the ACK of a request the
// prefill already freed, and the hold lapses for good.
func TestHoldRenewed(t *testing.T) {
	const ttl = 10 * time.Second // trusted for 8 s
	t0 := time.Unix(1000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	type ack struct{ sent, acked time.Duration }
	for _, tc := range []struct {
		name   string
		acks   []ack
		until  time.Duration // from t0
		lapsed bool
	}{
		{"none", nil, 8 * time.Second, false},
		{"first ACK late: starts the lease", []ack{{20 * time.Second, 21 * time.Second}}, 28 * time.Second, false},
		{"renewed every third", []ack{{0, 100 * time.Millisecond}, {3 * time.Second, 3100 * time.Millisecond}, {6 * time.Second, 6100 * time.Millisecond}}, 14 * time.Second, false},
		{"one lost renewal", []ack{{0, 100 * time.Millisecond}, {6 * time.Second, 7 * time.Second}}, 14 * time.Second, false},
		{"ACK at the hold's end", []ack{{0, 100 * time.Millisecond}, {7 * time.Second, 8 * time.Second}}, 15 * time.Second, false},
		{"ACK after the hold's end", []ack{{0, 100 * time.Millisecond}, {7 * time.Second, 8*time.Second + time.Millisecond}}, 8 * time.Second, true},
		{"lapsed for good", []ack{{0, 0}, {9 * time.Second, 9 * time.Second}, {10 * time.Second, 10 * time.Second}}, 8 * time.Second, true},
		{"ACKs out of order keep the latest send", []ack{{5 * time.Second, 6 * time.Second}, {4 * time.Second, 7 * time.Second}}, 13 * time.Second, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := hold{since: t0}
			for _, a := range tc.acks {
				h.renewed(ttl, at(a.sent), at(a.acked))
			}
			if h.lapsed != tc.lapsed || !h.until(ttl).Equal(at(tc.until)) {
				t.Fatalf("lapsed %v until %v, want %v %v", h.lapsed, h.until(ttl).Sub(t0), tc.lapsed, tc.until)
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
		{"leased: read", time.Second, false},
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

// cutRenewer acknowledges RENEWs until cut is set, then fails them (the
// side channel is gone).
type cutRenewer struct{ cut atomic.Bool }

func (c *cutRenewer) Renew(ctx context.Context, _ string, _ []string) error {
	if c.cut.Load() {
		return errors.New("side channel cut")
	}
	return nil
}

// A read that started while the lease held and ended after it may have
// run out (RENEWs failing meanwhile) fails: the prefill may have freed and
// reused the blocks while they were read. With RENEWs acknowledged the
// same long read ends done.
func TestLeaseLostDuringRead(t *testing.T) {
	const ttl = time.Second // renewed every 333 ms, trusted for 800 ms after an ACK
	for _, tc := range []struct {
		name string
		cut  bool
	}{
		{"renewals fail during the read", true},
		{"renewals acknowledged", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rn := &cutRenewer{}
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
			rn.cut.Store(tc.cut)
			// Hold the read until the lease is no longer trusted (cut), or
			// for longer than a TTL with renewals going.
			start := time.Now()
			for deadline := start.Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
				h, ok := w.rn.leaseOf("r", ep(portPeer))
				if !ok {
					t.Fatal("r not leased")
				}
				if tc.cut && holdErr(h, time.Now(), 0, "", "ended") != nil || !tc.cut && time.Since(start) > ttl+ttl/5 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("hold %+v still trusted", h)
				}
			}
			close(release)
			done, failed := waitEnded(t, w, "r")
			lost := testutil.ToFloat64(w.lost)
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
		})
	}
}
