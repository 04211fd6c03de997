package decode

import (
	"context"
	"log/slog"
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

// renewer renews the leases of the jobs between the handshake and the end
// of notify whose remote ranks advertised leases (job.Meta.LeaseTTL > 0):
// every TTL/3 per endpoint (the smallest TTL its metadata advertised), all
// the endpoint's request ids in one message, and once within renewCoalesce
// of a job's arrival. One loop goroutine owns the schedule; each RENEW runs
// on its own short-lived goroutine, at most one per endpoint, so a dead
// peer's timeouts never delay the renewals of others. close stops the
// loop and waits for every call.
type renewer struct {
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

	sent, failed prometheus.Counter
	renewedIDs   prometheus.Counter
}

type leaseEP struct {
	ttl  time.Duration
	ids  map[string]struct{}
	due  time.Time
	busy bool // a RENEW is in flight
}

func newRenewer(r Renewer, log *slog.Logger, reg prometheus.Registerer) (*renewer, error) {
	msgs := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_decode_lease_renewals_total",
		Help: "RENEW calls (lease renewals, one per prefill endpoint and period) by result (acked, failed).",
	}, []string{"result"})
	ids := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_decode_lease_renewed_requests_total",
		Help: "Request ids carried by acknowledged RENEW calls.",
	})
	rn := &renewer{r: r, log: log.With("component", "lease"), kick: make(chan struct{}, 1), done: make(chan struct{}),
		eps: map[string]*leaseEP{}, jobs: map[string][]string{},
		sent: msgs.WithLabelValues("acked"), failed: msgs.WithLabelValues("failed"), renewedIDs: ids}
	leased := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvflow_decode_leased_requests",
		Help: "Requests whose prefill holds this worker renews.",
	}, func() float64 { return float64(rn.len()) })
	for _, c := range []prometheus.Collector{msgs, ids, leased} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	rn.ctx, rn.cancel = context.WithCancel(context.Background())
	go rn.loop()
	return rn, nil
}

func (rn *renewer) len() int {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	return len(rn.jobs)
}

// add leases j's request at every endpoint of its tasks that advertised
// leases. A no-op after close or when no task's peer did.
func (rn *renewer) add(j *job.Job) {
	now := time.Now()
	rn.mu.Lock()
	defer rn.mu.Unlock()
	if rn.closed {
		return
	}
	if _, dup := rn.jobs[j.Req.ID]; dup {
		return
	}
	var eps []string
	for i := range j.Plan.Tasks {
		ttl := j.Metas[i].LeaseTTL
		if ttl <= 0 {
			continue
		}
		key := j.HandshakeEndpoint(i)
		ep := rn.eps[key]
		if ep == nil {
			ep = &leaseEP{ttl: ttl, ids: map[string]struct{}{}, due: now.Add(renewCoalesce)}
			rn.eps[key] = ep
		}
		if _, seen := ep.ids[j.Req.ID]; seen {
			continue // another task on the same rank
		}
		ep.ttl = min(ep.ttl, ttl)
		ep.ids[j.Req.ID] = struct{}{}
		if soon := now.Add(renewCoalesce); ep.due.After(soon) {
			ep.due = soon
		}
		eps = append(eps, key)
	}
	if len(eps) == 0 {
		return
	}
	rn.jobs[j.Req.ID] = eps
	select {
	case rn.kick <- struct{}{}:
	default:
	}
}

// remove ends the leases of request id (it ended: DONEs sent or failed).
func (rn *renewer) remove(id string) {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	for _, key := range rn.jobs[id] {
		if ep := rn.eps[key]; ep != nil {
			delete(ep.ids, id)
			if len(ep.ids) == 0 && !ep.busy {
				delete(rn.eps, key)
			}
		}
	}
	delete(rn.jobs, id)
}

// close stops renewing (the prefill side then force-frees what this worker
// still held once its leases run out) and waits for the calls in flight.
func (rn *renewer) close() {
	rn.once.Do(func() {
		rn.mu.Lock()
		rn.closed = true
		rn.mu.Unlock()
		rn.cancel()
		<-rn.done
		rn.calls.Wait()
	})
}

func (rn *renewer) loop() {
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
func (rn *renewer) fire(now time.Time) time.Time {
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
		go rn.send(key, ep, ep.ttl, ids)
	}
	return next
}

func (rn *renewer) send(key string, ep *leaseEP, ttl time.Duration, ids []string) {
	defer rn.calls.Done()
	ctx, cancel := context.WithTimeout(rn.ctx, max(ttl/3, minRenewTimeout))
	err := rn.r.Renew(ctx, key, ids)
	cancel()
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
	if len(ep.ids) == 0 && rn.eps[key] == ep {
		delete(rn.eps, key)
	}
	rn.mu.Unlock()
	select {
	case rn.kick <- struct{}{}:
	default:
	}
}

// leaseStage is the handshake stage plus lease registration: once every
// task's metadata is known, the job's request is leased at the ranks that
// advertised leases.
type leaseStage struct {
	handshake.Stage
	rn *renewer
}

func (s leaseStage) Process(ctx context.Context, j *job.Job) error {
	if err := s.Stage.Process(ctx, j); err != nil {
		return err
	}
	s.rn.add(j)
	return nil
}
