package planstage

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/pipeline"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/lease"
	"github.com/kvflow/kvflow/stages/plan"
)

// Deps is what the plan stage works with.
type Deps struct {
	Topology plan.Topology
	Self     plan.Rank
	// Renewer, if set, turns leases on: the stage owns the lease.Keeper
	// that renews them (Leases), leases every request at its admission
	// (Admit) and drops its leases when it ends (End). Nil: never renew
	// (the seed's behaviour).
	Renewer lease.Renewer
	// Peers is the handshake stage's metadata cache, which admission
	// peeks at (and fills) to lease a request at once. Needed with
	// Renewer.
	Peers      *handshake.Cache
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// Stage plans jobs for one decode worker: at admission (Admit) when
// leases are on, else on its own worker (Process).
type Stage struct {
	topo  plan.Topology
	self  plan.Rank
	keep  *lease.Keeper // nil: no leases
	peers *handshake.Cache

	// Admission's metadata fetches (prefetch): bgCtx ends at Close, which
	// waits for them.
	bgCtx    context.Context
	bgCancel context.CancelFunc
	bg       sync.WaitGroup
	mu       sync.Mutex
	closing  bool // Close has begun: no more prefetches
}

// New makes the plan stage (and, with d.Renewer, its lease keeper, which
// starts renewing at once; Close stops it).
func New(_ Config, d Deps) (*Stage, error) {
	s := &Stage{topo: d.Topology, self: d.Self, peers: d.Peers}
	if d.Renewer != nil {
		if d.Peers == nil {
			return nil, fmt.Errorf("plan stage: leases need the handshake cache")
		}
		log := d.Logger
		if log == nil {
			log = slog.New(slog.DiscardHandler)
		}
		reg := d.Registerer
		if reg == nil {
			reg = prometheus.NewRegistry()
		}
		k, err := lease.New(d.Renewer, log, reg)
		if err != nil {
			return nil, fmt.Errorf("plan stage: register metrics: %w", err)
		}
		s.keep = k
	}
	s.bgCtx, s.bgCancel = context.WithCancel(context.Background())
	return s, nil
}

// Leases is the stage's lease keeper (nil without leases), which the
// handshake stage sets leases with and the read stage's guard asks.
func (s *Stage) Leases() *lease.Keeper { return s.keep }

// Process sets j.Plan (Plan), unless admission planned it already.
func (s *Stage) Process(ctx context.Context, j *job.Job) error {
	return Plan(s.topo, s.self, j)
}

// Admit is the stage's work at admission, on the caller's goroutine
// before j is submitted. With leases on it plans j and leases its request
// at once, so that a request waiting in a queue (a stalled handshake
// stage, a full read stage) is held by its leases as much as one being
// read: at every endpoint of its plan whose cached metadata advertises
// leases, and at each endpoint not cached as soon as its metadata is
// fetched — a fetch started now, one per endpoint at a time, that the
// handshake stage's shares through the cache. The handshake stage then
// sets the request's leases from its own metadata, which stays the path
// for what admission could not lease. A request the planner rejects is
// left to Process, which fails it. Without leases it does nothing (the
// request is planned on the stage's worker).
func (s *Stage) Admit(j *job.Job) {
	if s.keep == nil {
		return
	}
	// Process keeps this plan.
	if err := Plan(s.topo, s.self, j); err != nil {
		return
	}
	var ats []lease.At
	var seen []string
	for i := range j.Plan.Tasks {
		ep := j.HandshakeEndpoint(i)
		if slices.Contains(seen, ep) {
			continue
		}
		seen = append(seen, ep)
		k := handshake.Key{EngineID: j.Plan.RemoteEngineID, Endpoint: ep}
		if m, ok := s.peers.Cached(k); ok {
			if m.LeaseTTL > 0 {
				ats = append(ats, lease.At{Endpoint: ep, TTL: m.LeaseTTL})
			}
			continue
		}
		if s.keep.Pend(j.Req.ID, k) {
			s.prefetch(k)
		}
	}
	s.keep.Lease(j.Req.ID, ats)
}

// Unadmit forgets what Admit did for j, which was never submitted.
func (s *Stage) Unadmit(j *job.Job) {
	if s.keep != nil {
		s.keep.Remove(j.Req.ID)
	}
}

// End is the stage's word on a request that ended: its leases end. A
// request canceled before it reached notify (shutdown) is planned here if
// it was not yet, so that notify can send the DONEs it owes.
func (s *Stage) End(r pipeline.Result[*job.Job]) {
	if s.keep != nil {
		s.keep.Remove(r.Item.Req.ID)
	}
	if r.Outcome == pipeline.Canceled && r.Stage != "notify" {
		_ = Plan(s.topo, s.self, r.Item) // a plan error: no endpoint, no DONE owed
	}
}

// Close stops admission's fetches and waits for them, then stops renewing
// (the prefill side then force-frees what this worker still held once its
// leases run out) and waits for the RENEWs in flight.
func (s *Stage) Close(context.Context) {
	s.mu.Lock()
	s.closing = true
	s.mu.Unlock()
	s.bgCancel()
	s.bg.Wait()
	if s.keep != nil {
		s.keep.Close()
	}
}

// prefetch fetches k's metadata into the handshake cache on its own
// goroutine and resolves the leases pending on it. After Close it
// resolves at once, with nothing.
func (s *Stage) prefetch(k handshake.Key) {
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		s.keep.Resolve(k, job.Meta{}, false)
		return
	}
	s.bg.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.bg.Done()
		m, err := s.peers.Get(s.bgCtx, k)
		s.keep.Resolve(k, m, err == nil)
	}()
}

// Plan sets j.Plan and sizes j.Metas for it, unless j was planned already
// (at admission; the stage then has nothing left to do).
func Plan(topo plan.Topology, self plan.Rank, j *job.Job) error {
	if j.Plan.Tasks != nil {
		return nil
	}
	p, err := plan.PlanRequest(topo, self, j.Req)
	if err != nil {
		return fmt.Errorf("plan request %q: %w", j.Req.ID, err)
	}
	j.Plan = p
	j.Metas = make([]job.Meta, len(p.Tasks))
	return nil
}
