package lease

import (
	"context"
	"log/slog"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
)

// Renewer sends kvflow's RENEW for reqIDs to the side channel at endpoint
// ("host:port") and waits for the ACK (sidechannel.Client.Renew).
type Renewer interface {
	Renew(ctx context.Context, endpoint string, reqIDs []string) error
}

// renewCoalesce is how long a newly leased request waits for others before
// the first RENEW of its endpoint goes out: the first renewal must beat the
// prefill side's abort timeout (which may be short), while under load one
// message then carries every request that arrived in the window.
const renewCoalesce = 5 * time.Millisecond

// minRenewTimeout bounds a RENEW call from below (ttl/3 for very short
// leases would not cover one side-channel round trip with its retry).
const minRenewTimeout = 100 * time.Millisecond

// Keeper renews the leases of the jobs whose remote ranks advertised
// leases (job.Meta.LeaseTTL > 0), from their admission (metadata already
// cached, or fetched then: lease, pend, resolve) or at the latest the end
// of their handshake (add) until they end (remove):
// every TTL/3 per endpoint (the smallest TTL its metadata advertised), all
// the endpoint's request ids in one message, and once within renewCoalesce
// of a job's arrival. One loop goroutine owns the schedule; each RENEW runs
// on its own short-lived goroutine, at most one per endpoint, so a dead
// peer's timeouts never delay the renewals of others. close stops the
// loop and waits for every call.
type Keeper struct {
	r   Renewer
	log *slog.Logger

	ctx    context.Context // cancelled by close: aborts calls in flight
	cancel context.CancelFunc
	kick   chan struct{} // cap 1
	done   chan struct{} // loop exited
	calls  sync.WaitGroup
	once   sync.Once

	mu     sync.Mutex
	closed bool
	eps    map[string]*leaseEP
	jobs   map[string][]string // request id → endpoints it is leased at
	// pending[k] exists while a fetch of k's metadata, started at the
	// admission of a request that found k uncached, is in flight; it holds
	// the requests admitted meanwhile that wait for it to be leased at k.
	pending   map[handshake.Key]map[string]struct{}
	pendingOf map[string][]handshake.Key // request id → keys it is pending on

	sent, failed prometheus.Counter
	renewedIDs   prometheus.Counter
}

type leaseEP struct {
	ttl  time.Duration
	ids  map[string]*hold
	due  time.Time
	busy bool // a RENEW is in flight
}

// hold is what this worker knows of one request's lease at one endpoint:
// the only evidence that the prefill still holds the request's blocks
// (the stale-read guard's input, holdErr). The prefill frees a renewed
// request one TTL after it last took a RENEW for it, by its own clock;
// this worker cannot see that moment, only bound it: a RENEW the prefill
// acknowledged was taken no earlier than the call was sent (sent), and no
// later than the ACK came back. An ACK also comes for ids the prefill no
// longer holds (a RENEW may cross a DONE), so an ACK that came back after
// the lease may already have run out proves nothing and the hold is
// lapsed for good.
type hold struct {
	since  time.Time // leased at this endpoint (its first RENEW leaves within renewCoalesce)
	acked  time.Time // when the last acknowledged RENEW carrying it was sent; zero: none yet
	lapsed bool      // an ACK came back after the hold's end: the prefill may have freed it
}

// leaseMargin is how much sooner than the prefill can free a request the
// guard stops trusting the lease: TTL/5 (2 s of the default 10 s TTL).
// Network latency needs none (a hold runs from when the RENEW was sent,
// before the prefill took it); the margin covers the time between the
// guard's check and the read's bytes leaving the prefill (the read stage's
// per-peer slots and the batch itself), scheduling delays, and the two
// hosts' clocks running at slightly different rates. With RENEWs every
// TTL/3 it lets one renewal fail (each call times out within TTL/3) and
// refuses reads after about 2.4 periods without an ACK.
func leaseMargin(ttl time.Duration) time.Duration { return ttl / 5 }

// until is the end of what h proves: its last acknowledged RENEW's send
// time (before any, its lease start) plus ttl less the margin.
func (h hold) until(ttl time.Duration) time.Time {
	from := h.since
	if !h.acked.IsZero() {
		from = h.acked
	}
	return from.Add(ttl - leaseMargin(ttl))
}

// renewed records an acknowledged RENEW of h, sent at sent and acked at
// acked. The first ACK starts the lease at the prefill (until then it
// held the request by its abort timeout); a later one extends it only if
// it came back before the hold's end, else the prefill may have freed the
// request in between and the hold lapses.
func (h *hold) renewed(ttl time.Duration, sent, acked time.Time) {
	if h.lapsed {
		return
	}
	if !h.acked.IsZero() && acked.After(h.until(ttl)) {
		h.lapsed = true
		return
	}
	if sent.After(h.acked) {
		h.acked = sent
	}
}

// Hold is what the stale-read guard (stages/read) is told of one
// request's lease at one endpoint: when it was leased there, when the last
// acknowledged RENEW carrying it was sent (zero: none yet), whether an ACK
// came back too late (Lapsed: for good), and the endpoint's TTL.
type Hold struct {
	Since  time.Time
	Acked  time.Time
	Lapsed bool
	TTL    time.Duration
}

// Until is the end of what h proves: its last acknowledged RENEW's send
// time (before any, its lease start) plus the TTL less Margin.
func (h Hold) Until() time.Time {
	return hold{since: h.Since, acked: h.Acked}.until(h.TTL)
}

// Margin is how much sooner than the prefill can free a request the guard
// stops trusting its lease (leaseMargin).
func Margin(ttl time.Duration) time.Duration { return leaseMargin(ttl) }

// LeaseOf reports request id's lease at endpoint; false when this worker
// does not renew it there (the stale-read guard's view).
func (rn *Keeper) LeaseOf(id, endpoint string) (Hold, bool) {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	ep := rn.eps[endpoint]
	if ep == nil {
		return Hold{}, false
	}
	h := ep.ids[id]
	if h == nil {
		return Hold{}, false
	}
	return Hold{Since: h.since, Acked: h.acked, Lapsed: h.lapsed, TTL: ep.ttl}, true
}

func New(r Renewer, log *slog.Logger, reg prometheus.Registerer) (*Keeper, error) {
	msgs := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_decode_lease_renewals_total",
		Help: "RENEW calls (lease renewals, one per prefill endpoint and period) by result (acked, failed).",
	}, []string{"result"})
	ids := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_decode_lease_renewed_requests_total",
		Help: "Request ids carried by acknowledged RENEW calls.",
	})
	rn := &Keeper{r: r, log: log.With("component", "lease"), kick: make(chan struct{}, 1), done: make(chan struct{}),
		eps: map[string]*leaseEP{}, jobs: map[string][]string{},
		pending: map[handshake.Key]map[string]struct{}{}, pendingOf: map[string][]handshake.Key{},
		sent: msgs.WithLabelValues("acked"), failed: msgs.WithLabelValues("failed"), renewedIDs: ids}
	leased := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvflow_decode_leased_requests",
		Help: "Requests whose prefill holds this worker renews.",
	}, func() float64 { return float64(rn.Len()) })
	for _, c := range []prometheus.Collector{msgs, ids, leased} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	rn.ctx, rn.cancel = context.WithCancel(context.Background())
	go rn.loop()
	return rn, nil
}

func (rn *Keeper) Len() int {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	return len(rn.jobs)
}

// At is one endpoint ("host:port" of a side channel) a request is leased
// at, with the TTL that endpoint's metadata advertised.
type At struct {
	Endpoint string
	TTL      time.Duration
}

// leaseAts are the endpoints of j's tasks whose metadata (j.Metas, set by
// the handshake) advertised leases, each once.
func leaseAts(j *job.Job) []At {
	var out []At
	for i := range j.Plan.Tasks {
		ttl := j.Metas[i].LeaseTTL
		if ttl <= 0 {
			continue
		}
		ep := j.HandshakeEndpoint(i)
		if !slices.ContainsFunc(out, func(a At) bool { return a.Endpoint == ep }) {
			out = append(out, At{ep, ttl})
		}
	}
	return out
}

// add is the handshake's word on j: from now on j's request is leased at
// exactly the endpoints whose metadata (j.Metas) advertised leases — those
// leased at admission from cached metadata stay, new ones are added (the
// request was admitted before their metadata was known), and any whose
// fresh metadata no longer advertises leases are dropped. Fetches its
// admission started no longer matter to it. A no-op after close.
func (rn *Keeper) Add(j *job.Job) {
	ats := leaseAts(j)
	now := time.Now()
	rn.mu.Lock()
	defer rn.mu.Unlock()
	if rn.closed {
		return
	}
	id := j.Req.ID
	rn.unpendLocked(id)
	for _, key := range rn.jobs[id] {
		if !slices.ContainsFunc(ats, func(a At) bool { return a.Endpoint == key }) {
			rn.dropLocked(id, key)
		}
	}
	rn.jobs[id] = slices.DeleteFunc(rn.jobs[id], func(key string) bool {
		return !slices.ContainsFunc(ats, func(a At) bool { return a.Endpoint == key })
	})
	rn.leaseLocked(id, ats, now)
	if len(rn.jobs[id]) == 0 {
		delete(rn.jobs, id)
	}
}

// lease leases request id at ats on top of what it already has (at its
// admission, from cached metadata). A no-op after close.
func (rn *Keeper) Lease(id string, ats []At) {
	now := time.Now()
	rn.mu.Lock()
	defer rn.mu.Unlock()
	if rn.closed {
		return
	}
	rn.leaseLocked(id, ats, now)
}

// leaseLocked adds id at every endpoint of ats it is not leased at yet;
// the first RENEW of each goes out within renewCoalesce. Called with
// rn.mu held.
func (rn *Keeper) leaseLocked(id string, ats []At, now time.Time) {
	added := false
	for _, a := range ats {
		if a.TTL <= 0 || slices.Contains(rn.jobs[id], a.Endpoint) {
			continue
		}
		ep := rn.eps[a.Endpoint]
		if ep == nil {
			ep = &leaseEP{ttl: a.TTL, ids: map[string]*hold{}, due: now.Add(renewCoalesce)}
			rn.eps[a.Endpoint] = ep
		}
		ep.ttl = min(ep.ttl, a.TTL)
		ep.ids[id] = &hold{since: now}
		if soon := now.Add(renewCoalesce); ep.due.After(soon) {
			ep.due = soon
		}
		rn.jobs[id] = append(rn.jobs[id], a.Endpoint)
		added = true
	}
	if !added {
		return
	}
	select {
	case rn.kick <- struct{}{}:
	default:
	}
}

// dropLocked takes id out of endpoint key's renewals. Called with rn.mu
// held; the caller updates rn.jobs.
func (rn *Keeper) dropLocked(id, key string) {
	if ep := rn.eps[key]; ep != nil {
		delete(ep.ids, id)
		if len(ep.ids) == 0 && !ep.busy {
			delete(rn.eps, key)
		}
	}
}

// pend records that request id, admitted while k's metadata was not
// cached, is to be leased at k once it is known (resolve). It reports
// whether the caller must start that fetch (none is in flight for k).
// False after close.
func (rn *Keeper) Pend(id string, k handshake.Key) (fetch bool) {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	if rn.closed {
		return false
	}
	ids, inFlight := rn.pending[k]
	if !inFlight {
		ids = map[string]struct{}{}
		rn.pending[k] = ids
	}
	if _, dup := ids[id]; !dup {
		ids[id] = struct{}{}
		rn.pendingOf[id] = append(rn.pendingOf[id], k)
	}
	return !inFlight
}

// resolve ends the fetch of k's metadata that pend asked for: with m
// (ok) advertising leases, every request still pending on k is leased at
// k's endpoint. Requests that ended meanwhile are not pending any more
// (remove), nor are those whose handshake already decided (add).
func (rn *Keeper) Resolve(k handshake.Key, m job.Meta, ok bool) {
	now := time.Now()
	rn.mu.Lock()
	defer rn.mu.Unlock()
	ids := rn.pending[k]
	delete(rn.pending, k)
	for id := range ids {
		rn.pendingOf[id] = slices.DeleteFunc(rn.pendingOf[id], func(x handshake.Key) bool { return x == k })
		if len(rn.pendingOf[id]) == 0 {
			delete(rn.pendingOf, id)
		}
		if ok && !rn.closed {
			rn.leaseLocked(id, []At{{k.Endpoint, m.LeaseTTL}}, now)
		}
	}
}

// unpendLocked forgets the fetches id waits for (the fetches go on for
// the others). Called with rn.mu held.
func (rn *Keeper) unpendLocked(id string) {
	for _, k := range rn.pendingOf[id] {
		delete(rn.pending[k], id)
	}
	delete(rn.pendingOf, id)
}

// remove ends the leases of request id (it ended: DONEs sent or failed,
// or it was never submitted) and forgets any fetch it waited for.
func (rn *Keeper) Remove(id string) {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	rn.unpendLocked(id)
	for _, key := range rn.jobs[id] {
		rn.dropLocked(id, key)
	}
	delete(rn.jobs, id)
}

// close stops renewing (the prefill side then force-frees what this worker
// still held once its leases run out) and waits for the calls in flight.
func (rn *Keeper) Close() {
	rn.once.Do(func() {
		rn.mu.Lock()
		rn.closed = true
		rn.mu.Unlock()
		rn.cancel()
		<-rn.done
		rn.calls.Wait()
	})
}

func (rn *Keeper) loop() {
	defer close(rn.done)
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		next := rn.fire(time.Now())
		wait := time.Hour
		if !next.IsZero() {
			wait = max(time.Until(next), 0)
		}
		t.Reset(wait)
		select {
		case <-rn.ctx.Done():
			return
		case <-rn.kick:
		case <-t.C:
		}
	}
}

// fire starts a RENEW for every idle endpoint that is due at now and
// returns the earliest due time of the idle ones left (zero: none).
func (rn *Keeper) fire(now time.Time) time.Time {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	var next time.Time
	for key, ep := range rn.eps {
		if ep.busy {
			continue
		}
		if len(ep.ids) == 0 {
			delete(rn.eps, key)
			continue
		}
		if now.Before(ep.due) {
			if next.IsZero() || ep.due.Before(next) {
				next = ep.due
			}
			continue
		}
		ids := make([]string, 0, len(ep.ids))
		for id := range ep.ids {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		ep.busy = true
		ep.due = now.Add(ep.ttl / 3)
		rn.calls.Add(1)
		go rn.send(key, ep, ep.ttl, ids, now)
	}
	return next
}

// send makes one RENEW call of ids at key, started at sent (fire's
// clock, no later than the call leaves), and records an ACK in the holds
// of the ids still leased there.
func (rn *Keeper) send(key string, ep *leaseEP, ttl time.Duration, ids []string, sent time.Time) {
	defer rn.calls.Done()
	ctx, cancel := context.WithTimeout(rn.ctx, max(ttl/3, minRenewTimeout))
	err := rn.r.Renew(ctx, key, ids)
	cancel()
	acked := time.Now()
	if err != nil {
		rn.failed.Inc()
		if rn.ctx.Err() == nil {
			rn.log.Warn("lease renewal failed", "endpoint", key, "requests", len(ids), "ttl", ttl, "err", err)
		}
	} else {
		rn.sent.Inc()
		rn.renewedIDs.Add(float64(len(ids)))
	}
	rn.mu.Lock()
	ep.busy = false
	if err == nil {
		for _, id := range ids {
			if h := ep.ids[id]; h != nil {
				h.renewed(ep.ttl, sent, acked)
			}
		}
	}
	if len(ep.ids) == 0 && rn.eps[key] == ep {
		delete(rn.eps, key)
	}
	rn.mu.Unlock()
	select {
	case rn.kick <- struct{}{}:
	default:
	}
}

// Idle reports whether no RENEW is in flight. A call records its ids
// before its endpoint turns idle, and any later call takes its ids after
// the check, so once it holds, no later RENEW carries a request that had
// already ended (Remove).
func (rn *Keeper) Idle() bool {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	for _, ep := range rn.eps {
		if ep.busy {
			return false
		}
	}
	return true
}

// Tracked counts what the keeper holds: requests leased, fetches pending
// (endpoints whose metadata admission is fetching) and requests waiting
// for one. All three are zero once every request has ended.
func (rn *Keeper) Tracked() (leased, pending, waiting int) {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	return len(rn.jobs), len(rn.pending), len(rn.pendingOf)
}
