package soak

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/tooling/faults"
	"github.com/kvflow/kvflow/internal/tooling/verify"
	"github.com/kvflow/kvflow/stages/plan"
)

// Load is one run of the driver against a cluster.
type Load struct {
	// Requests stops submitting after this many requests (0: no limit).
	Requests int
	// Duration stops submitting after this long (0: no limit).
	Duration time.Duration
	// Concurrency bounds requests in flight on the decode side. 16: enough
	// to fill every stage's queue a little on two cores.
	Concurrency int
	// MaxBlocks bounds a request's blocks (1..MaxBlocks; 1 in 20 has none,
	// 1 in 10 of the others has a local prefix hit). 4.
	MaxBlocks int
	// Seed seeds request shapes and routing.
	Seed uint64
	// KillAfter kills the first live prefill instance that has requests in
	// flight once this many requests were submitted (0: never); Replace
	// starts a new instance in its place.
	KillAfter int
	Replace   bool
	// HangAfter is how long a request may take before it counts as hung.
	// 30 s: every timeout of the pipeline is a few seconds.
	HangAfter time.Duration
	// Prefix names the requests ("r" by default); ids are Prefix + number.
	Prefix string
}

// Report is what a run saw.
type Report struct {
	Requests int // submitted (each loaded on every decode rank)
	Ends     int // decode (rank, request) ends seen in Finished
	Done     int // ... done
	Failed   int // ... failed
	// PrefillFreed counts (prefill rank, request) frees seen in Finished.
	PrefillFreed int
	// Expired counts frees after the abort timeout (their DONE was lost).
	Expired int
	// BytesVerified is the bytes of done requests checked against the
	// source pattern.
	BytesVerified uint64
	// BadRequests are done (rank, request) pairs with a byte that differs
	// from the source; BadBytes the differing bytes.
	BadRequests int
	BadBytes    int64
	// Premature counts prefill frees of a request before every decode rank
	// reading that prefill rank sent its DONE, within the abort timeout:
	// blocks freed while still being read.
	Premature int
	// FreedWhileReading counts prefill frees, at any age, before every
	// decode rank reading that prefill rank sent its DONE or ended: with
	// leases (Options.LeaseTTL > 0) each is a violation (a live decode's
	// lease must hold its blocks past the abort timeout); without, those
	// after the abort timeout are the seed's force-frees.
	FreedWhileReading int
	// Killed* are about requests in flight to a killed prefill instance,
	// counted as (decode rank, request) pairs not yet ended at the kill.
	Kills, KilledInFlight, KilledFailed, KilledDone int
	// Failures are failure reasons by class.
	Failures map[string]int
	Faults   faults.Counts
	// Violations are broken invariants (BadRequests and Premature are
	// counted above and listed here too).
	Violations []string
	Elapsed    time.Duration
}

// Add merges o into r.
func (r *Report) Add(o Report) {
	r.Requests += o.Requests
	r.Ends += o.Ends
	r.Done += o.Done
	r.Failed += o.Failed
	r.PrefillFreed += o.PrefillFreed
	r.Expired += o.Expired
	r.BytesVerified += o.BytesVerified
	r.BadRequests += o.BadRequests
	r.BadBytes += o.BadBytes
	r.Premature += o.Premature
	r.FreedWhileReading += o.FreedWhileReading
	r.Kills += o.Kills
	r.KilledInFlight += o.KilledInFlight
	r.KilledFailed += o.KilledFailed
	r.KilledDone += o.KilledDone
	if r.Failures == nil {
		r.Failures = map[string]int{}
	}
	for k, v := range o.Failures {
		r.Failures[k] += v
	}
	r.Faults = r.Faults.Add(o.Faults)
	r.Violations = append(r.Violations, o.Violations...)
	r.Elapsed += o.Elapsed
}

// String is a multi-line summary.
func (r Report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "requests %d in %v: decode ends %d (done %d, failed %d), prefill frees %d (expired %d)\n",
		r.Requests, r.Elapsed.Round(time.Millisecond), r.Ends, r.Done, r.Failed, r.PrefillFreed, r.Expired)
	fmt.Fprintf(&b, "bytes verified %d, bad requests %d (bad bytes %d), premature frees %d, freed while reading %d\n",
		r.BytesVerified, r.BadRequests, r.BadBytes, r.Premature, r.FreedWhileReading)
	fmt.Fprintf(&b, "prefill kills %d: in flight %d, failed %d, done %d\n", r.Kills, r.KilledInFlight, r.KilledFailed, r.KilledDone)
	fmt.Fprintf(&b, "faults injected %d:\n%s", r.Faults.Total(), indent(r.Faults.String()))
	var ks []string
	for k := range r.Failures {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	b.WriteString("failures by reason:\n")
	for _, k := range ks {
		fmt.Fprintf(&b, "  %6d %s\n", r.Failures[k], k)
	}
	fmt.Fprintf(&b, "violations %d\n", len(r.Violations))
	for i, v := range r.Violations {
		if i == 20 {
			fmt.Fprintf(&b, "  ... %d more\n", len(r.Violations)-20)
			break
		}
		fmt.Fprintf(&b, "  %s\n", v)
	}
	return b.String()
}

func indent(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i := range lines {
		lines[i] = "  " + lines[i]
	}
	return strings.Join(lines, "\n") + "\n"
}

// request is one request's state in the driver.
type request struct {
	id             string
	pre            *Prefill
	remote, local  []int
	tag            uint64
	sent           time.Time
	plans          []plan.Plan // by decode rank
	ends           []int       // by decode rank
	freed          []int       // by prefill rank
	nEnded         int
	nFreed         int
	killed         bool // its prefill instance was killed before every rank freed it
	inFlightAtKill bool
	hung           bool
}

func (q *request) decodeDone(nd int) bool { return q.nEnded == nd }

type driver struct {
	c        *Cluster
	l        Load
	rng      *rand.Rand
	rep      Report
	reqs     map[string]*request
	seq      int
	free     []int                 // decode local blocks free
	pfree    map[*Prefill][]int    // remote blocks free per instance
	eps      map[*Prefill][]string // side-channel endpoint per prefill rank
	inflight int                   // requests not yet ended on every decode rank
	rows     []int                 // prefill rank row bytes per part
}

// Run drives load against c until the load's limit, then waits for every
// request to end and be freed, and reports. It uses c's current decode
// workers (Reset builds them) and must be the only user of c meanwhile.
func Run(c *Cluster, l Load) Report {
	if l.Concurrency <= 0 {
		l.Concurrency = 16
	}
	if l.MaxBlocks <= 0 {
		l.MaxBlocks = 4
	}
	if l.HangAfter <= 0 {
		l.HangAfter = 30 * time.Second
	}
	if l.Prefix == "" {
		l.Prefix = "r"
	}
	d := &driver{c: c, l: l, rng: rand.New(rand.NewPCG(l.Seed, 0x50a4)), reqs: map[string]*request{},
		pfree: map[*Prefill][]int{}, eps: map[*Prefill][]string{}}
	d.rep.Failures = map[string]int{}
	for b := range c.Opts.Blocks {
		d.free = append(d.free, b)
	}
	pl := c.Prefill[0].Ranks[0]
	lay := pl.Device.Layout()
	for p := range lay.NumParts() {
		d.rows = append(d.rows, lay.BlockLen(p)/pl.Shape.BlockSize)
	}
	start := time.Now()
	d.loop(start)
	d.rep.Elapsed = time.Since(start)
	for _, dr := range c.Decode {
		d.rep.Faults = d.rep.Faults.Add(dr.Faults.Counts())
	}
	return d.rep
}

func (d *driver) violate(format string, args ...any) {
	d.rep.Violations = append(d.rep.Violations, fmt.Sprintf(format, args...))
}

func (d *driver) loop(start time.Time) {
	var drainSince time.Time
	for {
		submitting := (d.l.Requests == 0 || d.seq < d.l.Requests) && (d.l.Duration == 0 || time.Since(start) < d.l.Duration)
		if d.l.Requests == 0 && d.l.Duration == 0 {
			submitting = false
		}
		progressed := false
		if submitting && d.inflight < d.l.Concurrency {
			progressed = d.submit()
		}
		if d.l.KillAfter > 0 && d.seq >= d.l.KillAfter && d.rep.Kills == 0 {
			d.kill()
		}
		if d.pollDecode() {
			progressed = true
		}
		if d.pollPrefill() {
			progressed = true
		}
		now := time.Now()
		for _, q := range d.reqs {
			if !q.hung && !q.decodeDone(len(d.c.Decode)) && now.Sub(q.sent) > d.l.HangAfter {
				q.hung = true
				d.violate("request %s hung: %d of %d decode ranks ended after %v", q.id, q.nEnded, len(d.c.Decode), d.l.HangAfter)
			}
		}
		if !submitting {
			if len(d.reqs) == 0 {
				return
			}
			if drainSince.IsZero() {
				drainSince = now
			}
			// Every request ends within HangAfter; every prefill rank frees
			// it within the abort timeout after its last DONE could have
			// come.
			if now.Sub(drainSince) > d.l.HangAfter+max(d.c.Opts.AbortTimeout, d.c.Opts.LeaseTTL)+5*time.Second {
				for _, q := range d.reqs {
					if q.decodeDone(len(d.c.Decode)) {
						d.violate("request %s stranded: %d of %d prefill ranks freed it", q.id, q.nFreed, len(q.freed))
					} else if !q.hung {
						d.violate("request %s hung: %d of %d decode ranks ended", q.id, q.nEnded, len(d.c.Decode))
					}
				}
				return
			}
		}
		if !progressed {
			time.Sleep(time.Millisecond)
		}
	}
}

func (d *driver) alive() []*Prefill {
	var out []*Prefill
	for _, p := range d.c.Prefill {
		if !p.Dead {
			out = append(out, p)
		}
	}
	return out
}

func (d *driver) take(free *[]int, n int) []int {
	f := *free
	out := make([]int, n)
	for i := range n {
		j := d.rng.IntN(len(f))
		out[i] = f[j]
		f[j] = f[len(f)-1]
		f = f[:len(f)-1]
	}
	*free = f
	return out
}

// submit starts one request if blocks are free.
func (d *driver) submit() bool {
	live := d.alive()
	if len(live) == 0 {
		return false
	}
	pre := live[d.rng.IntN(len(live))]
	if _, ok := d.pfree[pre]; !ok {
		for b := range d.c.Opts.Blocks {
			d.pfree[pre] = append(d.pfree[pre], b)
		}
		for _, n := range pre.Ranks {
			d.eps[pre] = append(d.eps[pre], net.JoinHostPort("127.0.0.1", strconv.Itoa(n.Config.HandshakePort())))
		}
	}
	nb := 1 + d.rng.IntN(d.l.MaxBlocks)
	if d.rng.IntN(20) == 0 {
		nb = 0
	}
	nl := nb
	if nb > 1 && d.rng.IntN(10) == 0 {
		nl = nb - 1 // local prefix hit: pull only the tail
	}
	pf := d.pfree[pre]
	if len(pf) < nb || len(d.free) < nl {
		return false
	}
	remote := d.take(&pf, nb)
	d.pfree[pre] = pf
	local := d.take(&d.free, nl)
	id := fmt.Sprintf("%s%d", d.l.Prefix, d.seq)
	d.seq++
	q := &request{id: id, pre: pre, remote: remote, local: local, tag: plan.StringToInt64Hash(id),
		ends: make([]int, len(d.c.Decode)), freed: make([]int, len(pre.Ranks))}
	layers := d.c.Opts.Layers
	// Scribble the local blocks: stale bytes must not pass for new ones.
	for _, dr := range d.c.Decode {
		parts := dr.Node.Device.Layout().NumParts()
		for l := range layers {
			for p := range parts {
				for _, b := range local {
					clear(dr.Node.Device.Block(l, p, b))
				}
			}
		}
	}
	for _, n := range pre.Ranks {
		verify.FillBlocks(n.Device, layers, n.Device.Layout().NumParts(), plan.DeviceIndex(n.Config.Topology().Prefill, n.Config.Self()), remote, q.tag)
	}
	preq := plan.Request{ID: id, LocalBlockIDs: local, RemoteBlockIDs: remote, RemoteHost: "127.0.0.1",
		RemotePort: pre.Port, RemoteEngineID: pre.Name, RemotePCPSize: 1, RemoteDCPSize: 1}
	for _, dr := range d.c.Decode {
		pl, err := plan.PlanRequest(dr.Node.Config.Topology(), dr.Node.Config.Self(), preq)
		if err != nil {
			d.violate("plan %s: %v", id, err)
		}
		q.plans = append(q.plans, pl)
	}
	d.reqs[id] = q
	d.rep.Requests++
	d.inflight++
	q.sent = time.Now()
	for i, n := range pre.Ranks {
		if err := n.Prefill.Send([]prefill.SendRequest{{RequestID: id, BlockIDs: remote}})[0]; err != nil {
			d.violate("prefill %s rank %d send %s: %v", pre.Name, i, id, err)
		}
	}
	for r, dr := range d.c.Decode {
		err := dr.Worker.Load(context.Background(), []decode.LoadRequest{{RequestID: id, LocalBlockIDs: local,
			Params: decode.KVTransferParams{RemoteBlockIDs: remote, RemoteEngineID: pre.Name, RemoteHost: "127.0.0.1",
				RemotePort: pre.Port, RemotePCPSize: 1, RemoteDCPSize: 1}}})[0]
		if err != nil {
			d.violate("decode rank %d load %s: %v", r, id, err)
			q.ends[r] = 1 // never loaded: will not end
			q.nEnded++
		}
	}
	d.settle(q)
	return true
}

// lookup finds a request by id; ids of completed requests are known by
// their number.
func (d *driver) lookup(id, what string) *request {
	if q, ok := d.reqs[id]; ok {
		return q
	}
	if n, err := strconv.Atoi(strings.TrimPrefix(id, d.l.Prefix)); err == nil && strings.HasPrefix(id, d.l.Prefix) && n < d.seq {
		d.violate("%s: request %s reported again after it completed", what, id)
	} else {
		d.violate("%s: unknown request %q", what, id)
	}
	return nil
}

func (d *driver) pollDecode() bool {
	got := false
	for r, dr := range d.c.Decode {
		done, failed := dr.Worker.Finished()
		for _, id := range done {
			got = true
			if q := d.lookup(id, fmt.Sprintf("decode rank %d done", r)); q != nil {
				d.ended(q, r, nil)
			}
		}
		for _, f := range failed {
			got = true
			if q := d.lookup(f.RequestID, fmt.Sprintf("decode rank %d failed", r)); q != nil {
				d.ended(q, r, &f)
			}
		}
	}
	return got
}

func (d *driver) ended(q *request, r int, f *decode.Failure) {
	q.ends[r]++
	if q.ends[r] > 1 {
		d.violate("request %s ended %d times on decode rank %d", q.id, q.ends[r], r)
		return
	}
	q.nEnded++
	d.rep.Ends++
	if f != nil {
		d.rep.Failed++
		d.rep.Failures[classify(f.Reason)]++
		if len(f.BlockIDs) != len(q.local) {
			d.violate("request %s failure on rank %d names %d blocks, want %d", q.id, r, len(f.BlockIDs), len(q.local))
		}
		if q.inFlightAtKill {
			d.rep.KilledFailed++
		}
	} else {
		d.rep.Done++
		if q.inFlightAtKill {
			d.rep.KilledDone++
		}
		dev := d.c.Decode[r].Node.Device
		bad, err := verify.Check(dev, q.plans[r], d.rows, q.tag)
		if bad != 0 {
			d.rep.BadRequests++
			d.rep.BadBytes += bad
			d.violate("request %s done on decode rank %d with %d bad bytes: %v", q.id, r, bad, err)
		} else {
			d.rep.BytesVerified += d.planBytes(q.plans[r])
		}
	}
	if q.decodeDone(len(d.c.Decode)) {
		d.inflight--
		d.free = append(d.free, q.local...)
	}
	d.settle(q)
}

// planBytes is the bytes a plan moves into the decode cache.
func (d *driver) planBytes(pl plan.Plan) uint64 {
	var row uint64
	for _, r := range d.rows {
		row += uint64(r)
	}
	block := row * uint64(d.c.Prefill[0].Ranks[0].Shape.BlockSize)
	var n uint64
	for _, t := range pl.Tasks {
		n += uint64(t.LayerEnd-t.LayerStart) * uint64(len(t.LocalBlockIDs)) * block
	}
	return n
}

func (d *driver) pollPrefill() bool {
	got := false
	for _, p := range d.c.Prefill {
		if p.Dead {
			continue
		}
		for i, n := range p.Ranks {
			for _, id := range n.Prefill.Finished() {
				got = true
				if q := d.lookup(id, fmt.Sprintf("prefill %s rank %d freed", p.Name, i)); q != nil {
					d.freedOn(q, i)
				}
			}
		}
	}
	return got
}

func (d *driver) freedOn(q *request, i int) {
	q.freed[i]++
	if q.freed[i] > 1 {
		d.violate("request %s freed %d times on prefill %s rank %d", q.id, q.freed[i], q.pre.Name, i)
		return
	}
	q.nFreed++
	d.rep.PrefillFreed++
	age := time.Since(q.sent)
	expired := age > d.c.Opts.AbortTimeout
	if expired {
		d.rep.Expired++
	}
	// Every decode rank that reads prefill rank i must have sent its DONE
	// to it (or ended) before the blocks were freed: within the abort
	// timeout always, after it too when leases are on.
	ep := d.eps[q.pre][i]
	for r, pl := range q.plans {
		reads := false
		for _, t := range pl.Tasks {
			if t.RemoteRank == i {
				reads = true
			}
		}
		if !reads || q.ends[r] != 0 || d.c.Decode[r].DoneSent(ep, q.id) != 0 {
			continue
		}
		d.rep.FreedWhileReading++
		switch {
		case !expired:
			d.rep.Premature++
			d.violate("request %s freed by prefill %s rank %d after %v while decode rank %d was still reading it (no DONE sent)",
				q.id, q.pre.Name, i, age.Round(time.Millisecond), r)
		case d.c.Opts.LeaseTTL > 0:
			d.violate("request %s force-freed by prefill %s rank %d after %v while decode rank %d was still reading it under a lease",
				q.id, q.pre.Name, i, age.Round(time.Millisecond), r)
		}
	}
	if q.nFreed == len(q.freed) {
		d.pfree[q.pre] = append(d.pfree[q.pre], q.remote...)
	}
	d.settle(q)
}

// settle forgets a request that ended everywhere and was freed everywhere
// (or whose prefill instance is gone).
func (d *driver) settle(q *request) {
	if !q.decodeDone(len(d.c.Decode)) || (q.nFreed < len(q.freed) && !q.killed) {
		return
	}
	delete(d.reqs, q.id)
	for _, dr := range d.c.Decode {
		dr.forget(d.eps[q.pre], q.id)
	}
}

// kill closes a live prefill instance with requests in flight.
func (d *driver) kill() {
	var victim *Prefill
	for _, p := range d.alive() {
		for _, q := range d.reqs {
			if q.pre == p && !q.decodeDone(len(d.c.Decode)) {
				victim = p
				break
			}
		}
		if victim != nil {
			break
		}
	}
	if victim == nil {
		return // nothing in flight yet: try again next turn
	}
	d.rep.Kills++
	for _, q := range d.reqs {
		if q.pre == victim {
			q.killed = true
			if !q.decodeDone(len(d.c.Decode)) {
				q.inFlightAtKill = true
				d.rep.KilledInFlight += len(d.c.Decode) - q.nEnded
			}
		}
	}
	if err := d.c.Kill(victim); err != nil {
		d.violate("kill prefill %s: %v", victim.Name, err)
	}
	if d.l.Replace {
		if _, err := d.c.AddPrefill(); err != nil {
			d.violate("replace prefill %s: %v", victim.Name, err)
		}
	}
	for _, q := range d.reqs {
		d.settle(q)
	}
}

// classify shortens a failure reason to "stage: cause" for the report.
func classify(reason string) string {
	stage := "?"
	if i := strings.Index(reason, "stage "); i >= 0 {
		rest := reason[i+len("stage "):]
		if j := strings.Index(rest, ":"); j >= 0 {
			stage = rest[:j]
		}
	}
	for _, c := range []struct{ sub, cause string }{
		{"stale read refused", "stale read refused (past the abort timeout, no lease)"},
		{"aborted", "aborted"},
		{"canceled", "canceled"},
		{"faults: read truncate", "injected truncate"},
		{"faults: read fail", "injected read failure"},
		{"faults: get_meta fail", "injected get_meta failure"},
		{"engine id mismatch", "engine id mismatch"},
		{"bad metadata", "bad metadata"},
		{"not inside a registered region", "remote range not registered"},
		{"rejected by peer", "rejected by peer"},
		{"out of range", "block out of range"},
		{"outside [", "block outside the peer's num_blocks"},
		{"peer closed", "peer closed"},
		{"connection refused", "connection refused"},
		{"deadline exceeded", "timeout"},
		{"timed out", "timeout"},
		{"timeout", "timeout"},
	} {
		if strings.Contains(reason, c.sub) {
			return stage + ": " + c.cause
		}
	}
	if len(reason) > 100 {
		reason = reason[:100]
	}
	return stage + ": " + reason
}
