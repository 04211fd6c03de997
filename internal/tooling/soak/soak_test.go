package soak

import (
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/tooling/faults"
)

// soakLeaseTTL is TestSoak's lease TTL: production's mechanism at the soak's
// time scale (the abort timeout is 2 s; renewals go every 667 ms).
const soakLeaseTTL = 2 * time.Second

// TestSoak is `make soak`: KVFLOW_SOAK_DURATION of mixed load (rounds of
// random concurrency, request sizes and fault schedules; every fifth round
// kills a prefill instance with requests in flight and starts a new one)
// on the TestDriver cluster. It prints requests, faults injected by kind,
// failures reported, bytes verified and leaks, and fails on any invariant
// violation or leak. Skipped unless KVFLOW_SOAK_DURATION is set.
//
// Leases are on, as in production (tracker.lease_ttl defaults to 10 s), with
// a TTL of soakLeaseTTL, while the abort timeout stays short (2 s) so that
// faults still reach the force-free paths; every force-free of a block a
// live decode still reads is then a violation. KVFLOW_SOAK_LEASE_TTL
// overrides the TTL; 0 runs the seed's expiry alone (leases off), where
// such force-frees are the seed's own behaviour and not checked.
func TestSoak(t *testing.T) {
	env := os.Getenv("KVFLOW_SOAK_DURATION")
	if env == "" {
		t.Skip("set KVFLOW_SOAK_DURATION (e.g. 10m) to run the soak test")
	}
	dur, err := time.ParseDuration(env)
	if err != nil {
		t.Fatalf("KVFLOW_SOAK_DURATION: %v", err)
	}
	before := Measure()
	s := seed(t)
	rng := rand.New(rand.NewPCG(s, 2))
	ttl := soakLeaseTTL
	if env := os.Getenv("KVFLOW_SOAK_LEASE_TTL"); env != "" {
		if ttl, err = time.ParseDuration(env); err != nil || ttl < 0 {
			t.Fatalf("KVFLOW_SOAK_LEASE_TTL: %q: want a duration >= 0 (%v)", env, err)
		}
	}
	c := startCluster(t, Options{LeaseTTL: ttl})
	t.Logf("lease ttl %v, abort timeout %v", c.Opts.LeaseTTL, c.Opts.AbortTimeout)
	start := time.Now()
	var total Report
	for i := 0; time.Since(start) < dur; i++ {
		left := dur - time.Since(start)
		l := Load{Requests: 100 + rng.IntN(400), Duration: left, Concurrency: 4 + rng.IntN(29), MaxBlocks: 1 + rng.IntN(8),
			Seed: rng.Uint64(), Prefix: "s" + strconv.Itoa(i) + "-"}
		sched := RandomSchedule(rng)
		kind := "random"
		switch {
		case i%5 == 4:
			kind = "kill"
			sched = faults.Schedule{Seed: rng.Uint64(), Read: faults.Rates{Delay: .5 + rng.Float64()/2}, MaxDelay: 300 * time.Millisecond}
			l.KillAfter, l.Replace = 1+rng.IntN(l.Requests/2), true
		case i%7 == 0:
			kind = "clean"
			sched = faults.Schedule{}
		}
		rep := round(t, c, sched, l)
		total.Add(rep)
		for _, v := range rep.Violations {
			t.Errorf("round %d (%s): %s", i, kind, v)
		}
		if kind == "clean" && rep.Failed != 0 {
			t.Errorf("round %d (clean): %d failed: %v", i, rep.Failed, rep.Failures)
		}
		t.Logf("round %d (%s, concurrency %d, ≤%d blocks): %d requests, %d done, %d failed, %d faults, %v",
			i, kind, l.Concurrency, l.MaxBlocks, rep.Requests, rep.Done, rep.Failed, rep.Faults.Total(), rep.Elapsed.Round(time.Millisecond))
		if t.Failed() {
			break
		}
	}
	checkAuth(t, c)
	if err := c.Close(); err != nil {
		t.Errorf("close cluster: %v", err)
	}
	leaks := Leaks(before, 15*time.Second)
	t.Logf("soak %v (seed %d):\n%sleaks: %v", time.Since(start).Round(time.Second), s, total, leaks)
	if leaks != (Resources{}) {
		t.Errorf("leaked after shutdown: %v", leaks)
	}
	if total.Requests == 0 || total.BytesVerified == 0 {
		t.Errorf("soak ran %d requests, verified %d bytes", total.Requests, total.BytesVerified)
	}
}
