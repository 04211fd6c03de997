package lease

import (
	"log/slog"
	"slices"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/internal/tooling/testkit/fakes/leasefake"
	"github.com/kvflow/kvflow/stages/job"
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

// TestRenewer runs on synctest's clock: every gap it checks is the
// renewer's own schedule, not the machine's load.
func TestRenewer(t *testing.T) {
	synctest.Test(t, testRenewer)
}

func testRenewer(t *testing.T) {
	const ttl = 150 * time.Millisecond
	f := &leasefake.Renewer{Block: map[string]bool{"127.0.0.1:3": true}}
	rn, err := New(f, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	// a: two tasks on port 1 (one lease there), one on port 2 without leases.
	rn.Add(leaseJob("a", []int{1, 1, 2}, []time.Duration{ttl, ttl, 0}))
	rn.Add(leaseJob("b", []int{1}, []time.Duration{ttl}))
	rn.Add(leaseJob("seed", []int{2}, []time.Duration{0})) // a seed peer: never renewed
	rn.Add(leaseJob("dead", []int{3}, []time.Duration{ttl}))
	if rn.Len() != 3 {
		t.Fatalf("leased %d, want 3", rn.Len())
	}
	time.Sleep(ttl)
	first := f.To("127.0.0.1:1")
	if len(first) == 0 || first[0].At.Sub(start) > 50*time.Millisecond {
		t.Fatalf("first renewal not prompt: %+v", first)
	}
	if !slices.Equal(first[0].IDs, []string{"a", "b"}) {
		t.Fatalf("first batch %v, want [a b] in one message", first[0].IDs)
	}
	if len(f.To("127.0.0.1:2")) != 0 {
		t.Fatal("RENEW sent to a peer that did not advertise leases")
	}
	time.Sleep(2 * ttl)
	calls := f.To("127.0.0.1:1")
	// About every ttl/3 (50 ms) over 450 ms: at least 5, at most ~10.
	if len(calls) < 5 || len(calls) > 12 {
		t.Fatalf("%d renewals of port 1 in %v (ttl %v)", len(calls), time.Since(start), ttl)
	}
	for i := 1; i < len(calls); i++ {
		if gap := calls[i].At.Sub(calls[i-1].At); gap > ttl/2 {
			t.Fatalf("renewal gap %v > ttl/2", gap)
		}
	}
	// The dead peer's calls (each blocked until its timeout) never overlap.
	if n := len(f.To("127.0.0.1:3")); n == 0 || n > 5 {
		t.Fatalf("%d calls to the blocked peer", n)
	}
	rn.Remove("a")
	rn.Remove("b")
	n := len(f.To("127.0.0.1:1"))
	time.Sleep(ttl)
	if got := len(f.To("127.0.0.1:1")); got > n+1 {
		t.Fatalf("renewals went on after remove: %d -> %d", n, got)
	}
	rn.Add(leaseJob("c", []int{1}, []time.Duration{ttl}))
	time.Sleep(20 * time.Millisecond)
	if last := f.To("127.0.0.1:1"); !slices.Equal(last[len(last)-1].IDs, []string{"c"}) {
		t.Fatalf("after remove and add: %v", last[len(last)-1].IDs)
	}
	done := make(chan struct{})
	go func() { rn.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		t.Fatal("close hangs on a blocked call")
	}
	n = len(f.Calls())
	rn.Add(leaseJob("late", []int{1}, []time.Duration{ttl}))
	time.Sleep(ttl)
	if len(f.Calls()) != n {
		t.Fatalf("renewed after close")
	}
	rn.Close() // idempotent
	// synctest.Test fails if a goroutine of the renewer outlives close.
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
