package read

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/lease"
	"github.com/kvflow/kvflow/stages/plan"
)

// leaseJob is a job whose task i goes to 127.0.0.1:ports[i], advertising ttls[i].
func leaseJob(id string, ports []int, ttls []time.Duration) *job.Job {
	j := job.New(plan.Request{ID: id}, time.Now())
	j.Plan = plan.Plan{RequestID: id, RemoteHost: "127.0.0.1"}
	for i, p := range ports {
		j.Plan.Tasks = append(j.Plan.Tasks, plan.Task{HandshakePort: p})
		j.Metas = append(j.Metas, job.Meta{LeaseTTL: ttls[i]})
	}
	return j
}

// leaseMap is a LeaseView: request id → endpoint → its hold.
type leaseMap map[string]map[string]lease.Hold

func (m leaseMap) LeaseOf(id, endpoint string) (lease.Hold, bool) {
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
		h := lease.Hold{Since: admitted, Lapsed: lapsed, TTL: ttl}
		if acked > 0 {
			h.Acked = admitted.Add(acked)
		}
		return leaseMap{"r": {"127.0.0.1:5000": h}}
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
			var lv LeaseView
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

// The guard around the stage: a read past the abort timeout is refused
// before any batch, counted; one in time is read; a lease that ran out
// while the read ran fails it after the read, counted as lost.
func TestStageGuard(t *testing.T) {
	const abort = time.Second
	ttl := 10 * time.Second
	for _, tc := range []struct {
		name    string
		after   time.Duration // now, from admission
		leases  LeaseView
		ttl     time.Duration // advertised by the task's rank
		wantErr error
		reads   bool
	}{
		{"in time", abort, nil, 0, nil, true},
		{"past the abort timeout", abort + time.Millisecond, nil, 0, ErrStaleRead, false},
		{"leased, hold ran out", time.Hour, leaseMap{"r": {"127.0.0.1:30000": {Since: testNow, Acked: testNow, TTL: ttl}}}, ttl, ErrLeaseLost, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeTransfer{}
			s, err := build(f, Options{
				Layout: plan.CacheLayout{BlockLen: []uint64{4096}, CachesPerLayer: 2},
				Local:  plan.Caches{Base: []uint64{5 << 30, 6 << 30, 7 << 30, 8 << 30}, NumBlocks: 8},
				Guard:  &Guard{AbortTimeout: abort, Leases: tc.leases, Now: func() time.Time { return testNow.Add(tc.after) }},
			})
			if err != nil {
				t.Fatal(err)
			}
			j := testJob(1)
			j.Metas[0].LeaseTTL = tc.ttl
			err = s.Process(context.Background(), j)
			if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil) != (err == nil) {
				t.Fatalf("Process = %v, want %v", err, tc.wantErr)
			}
			if read := j.BytesRead.Load() > 0; read != tc.reads {
				t.Fatalf("read %v, want %v", read, tc.reads)
			}
			refused, lost := testutil.ToFloat64(s.m.staleRefused), testutil.ToFloat64(s.m.leaseLost)
			if want := errors.Is(tc.wantErr, ErrStaleRead) && !errors.Is(tc.wantErr, ErrLeaseLost); (refused == 1) != want || (lost == 1) != errors.Is(tc.wantErr, ErrLeaseLost) {
				t.Fatalf("refused %v lost %v", refused, lost)
			}
		})
	}
	if (&Guard{}).on() || (*Guard)(nil).on() {
		t.Fatal("a guard that checks nothing is on")
	}
}
