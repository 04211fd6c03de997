package prefill

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/stages/notify/tracker"
	"github.com/kvflow/kvflow/stages/plan"
)

// Grants opens and closes the transfer engine's read grants for a held
// request's blocks.
type Grants interface {
	Grant(blocks []int) error
	Revoke(blocks []int) error
}

// Options configures the worker.
type Options struct {
	Topology plan.Topology
	Self     plan.Rank
	// Metadata is what GET_META answers.
	Metadata sidechannel.Metadata
	// AbortTimeout force-frees a held request never DONE. 480 s: vLLM's
	// VLLM_NIXL_ABORT_REQUEST_TIMEOUT default.
	AbortTimeout time.Duration
	// MaxRecords bounds the tracker's records (early DONEs and finished
	// tombstones, by count); 0 = the tracker's default.
	MaxRecords int
	// LeaseTTL turns leases on (0 = off): GET_META advertises it
	// (Metadata.Ext.LeaseTTL) and each RENEW keeps the named held requests
	// from being force-freed for LeaseTTL (tracker.Options.LeaseTTL).
	LeaseTTL time.Duration
	// NoBatchDone stops GET_META from advertising batched DONE
	// (Metadata.Ext.BatchDone), so kvflow decode workers send this worker
	// one DONE_RECVING per request, as seed ones do. The side channel
	// serves done_batch_msg either way (Done once per id); false, the
	// default, lets a busy decode worker share one round trip between
	// many DONEs.
	NoBatchDone bool
	Grants      Grants
	Now         func() time.Time
	Registerer  prometheus.Registerer
	Logger      *slog.Logger
}

// MaxClockSkew is how far in the future a send's delay_start_time may lie:
// the engine's clock and this worker's may disagree a little (NTP keeps
// hosts within milliseconds; a minute covers a badly synced one), but a
// start further ahead is not a time the engine took, and would keep the
// request from expiring for as long.
const MaxClockSkew = 60 * time.Second

// ErrDraining is the error of every send to a worker that is draining
// (Drain: it is shutting down and takes no new requests).
var ErrDraining = errors.New("prefill: draining (shutting down): new requests are refused; send them to another prefill worker")

// Worker is one prefill worker's side of the transfer.
type Worker struct {
	opts Options
	log  *slog.Logger
	tr   *tracker.Tracker
	now  func() time.Time

	// sendMu makes each send's check (held already?) and hold one step.
	sendMu   sync.Mutex
	draining atomic.Bool

	mu     sync.Mutex
	blocks map[string][]int // granted blocks by request

	sends     *prometheus.CounterVec
	dones     *prometheus.CounterVec
	renews    *prometheus.CounterVec
	freed     *prometheus.CounterVec
	leaseEnds prometheus.Counter
	heldGage  prometheus.GaugeFunc
}

// New makes the worker.
func New(o Options) (*Worker, error) {
	if err := o.Topology.Validate(); err != nil {
		return nil, fmt.Errorf("prefill: topology: %w", err)
	}
	if o.AbortTimeout <= 0 {
		o.AbortTimeout = 480 * time.Second
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.LeaseTTL < 0 {
		return nil, fmt.Errorf("prefill: lease ttl %v < 0", o.LeaseTTL)
	}
	// The metadata advertises leases exactly when this worker takes RENEW,
	// and batched DONE unless told not to.
	o.Metadata.Ext.LeaseTTL = o.LeaseTTL
	o.Metadata.Ext.BatchDone = !o.NoBatchDone
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	w := &Worker{opts: o, log: log.With("component", "prefill"), now: o.Now, blocks: map[string][]int{},
		tr: tracker.New(tracker.Options{AbortTimeout: o.AbortTimeout, LeaseTTL: o.LeaseTTL, MaxRecords: o.MaxRecords,
			EarlyQuorum: earlyQuorum(o.Topology, o.Self)})}
	w.sends = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_prefill_requests_total",
		Help: "Requests handed over for sending, by decision (delayed: waits for DONE; immediate: no decode rank reads this worker).",
	}, []string{"decision"})
	w.dones = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_prefill_done_messages_total",
		Help: "DONE_RECVINGs received (plain, or one per id of a done_batch_msg), by result.",
	}, []string{"result"})
	w.renews = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_prefill_lease_renewals_total",
		Help: "Request ids in RENEW messages (leases), by result (renewed; not_held: unknown, not yet held or already freed).",
	}, []string{"result"})
	w.freed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_prefill_freed_total",
		Help: "Requests whose blocks were released, by reason (done, not_transfer, expired = force-freed at the abort timeout or at the end of a lease, aborted).",
	}, []string{"reason"})
	w.leaseEnds = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_prefill_lease_expired_total",
		Help: "Requests force-freed one lease TTL after their last renewal (their decode stopped renewing: dead or cut off); also counted in kvflow_prefill_freed_total{reason=\"expired\"}.",
	})
	w.heldGage = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvflow_prefill_delayed_requests",
		Help: "Requests whose blocks are held waiting for DONE.",
	}, func() float64 { return float64(w.tr.Len()) })
	if o.Registerer != nil {
		for _, c := range []prometheus.Collector{w.sends, w.dones, w.renews, w.freed, w.leaseEnds, w.heldGage} {
			if err := o.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("prefill: register metrics: %w", err)
			}
		}
	}
	for _, d := range []string{"delayed", "immediate", "rejected", "draining"} {
		w.sends.WithLabelValues(d)
	}
	for _, r := range []string{"done", "not_transfer", "expired", "aborted"} {
		w.freed.WithLabelValues(r)
	}
	for _, r := range []string{"renewed", "not_held"} {
		w.renews.WithLabelValues(r)
	}
	return w, nil
}

// Metadata answers GET_META.
func (w *Worker) Metadata() sidechannel.Metadata { return w.opts.Metadata }

// Send registers requests whose blocks are held for decode. For each, this
// worker either waits for the expected DONEs (a decode rank reads from it)
// or reports it finished at once. Each request gets its own error (nil:
// accepted): a bad field, a request id already held, or a worker that is
// draining (ErrDraining).
func (w *Worker) Send(reqs []SendRequest) []error {
	w.sendMu.Lock()
	defer w.sendMu.Unlock()
	errs := make([]error, len(reqs))
	for i, r := range reqs {
		errs[i] = w.send(r)
	}
	return errs
}

func (w *Worker) send(r SendRequest) error {
	if w.draining.Load() {
		w.sends.WithLabelValues("draining").Inc()
		return fmt.Errorf("send %q: %w", r.RequestID, ErrDraining)
	}
	if r.RequestID == "" {
		w.sends.WithLabelValues("rejected").Inc()
		return errors.New("send: request_id: empty")
	}
	if math.IsNaN(r.DelayStartTime) || math.IsInf(r.DelayStartTime, 0) || r.DelayStartTime < 0 {
		w.sends.WithLabelValues("rejected").Inc()
		return fmt.Errorf("send %q: delay_start_time: %v is not a time (want seconds since the Unix epoch, or 0 for now)", r.RequestID, r.DelayStartTime)
	}
	now := w.now()
	if limit := float64(now.Add(MaxClockSkew).UnixNano()) / 1e9; r.DelayStartTime > limit {
		w.sends.WithLabelValues("rejected").Inc()
		return fmt.Errorf("send %q: delay_start_time: %v is %.6g s in the future (now %.3f; at most %v of clock skew is allowed)",
			r.RequestID, r.DelayStartTime, r.DelayStartTime-float64(now.UnixNano())/1e9, float64(now.UnixNano())/1e9, MaxClockSkew)
	}
	if _, _, held := w.tr.Held(r.RequestID); held {
		w.sends.WithLabelValues("rejected").Inc()
		return fmt.Errorf("send %q: request_id: already held (sent before and not freed yet): a request is sent once", r.RequestID)
	}
	for _, b := range r.BlockIDs {
		if b < 0 || b >= w.opts.Metadata.NumBlocks {
			w.sends.WithLabelValues("rejected").Inc()
			return fmt.Errorf("send %q: block_ids: %d out of range [0, %d)", r.RequestID, b, w.opts.Metadata.NumBlocks)
		}
	}
	start := now
	if r.DelayStartTime > 0 {
		sec, frac := math.Modf(r.DelayStartTime)
		start = time.Unix(int64(sec), int64(frac*1e9))
	}
	expected, err := plan.PrefillExpectedDones(w.opts.Topology, w.opts.Self, r.RequestID, len(r.BlockIDs))
	if err != nil {
		w.sends.WithLabelValues("rejected").Inc()
		return fmt.Errorf("send %q: %w", r.RequestID, err)
	}
	if expected == 0 {
		w.tr.AddNotTransfer(r.RequestID)
		w.sends.WithLabelValues("immediate").Inc()
		return nil
	}
	if w.opts.Grants != nil && len(r.BlockIDs) > 0 {
		w.mu.Lock()
		_, dup := w.blocks[r.RequestID]
		w.mu.Unlock()
		if !dup {
			if err := w.opts.Grants.Grant(r.BlockIDs); err != nil {
				w.sends.WithLabelValues("rejected").Inc()
				return fmt.Errorf("send %q: grant blocks: %w", r.RequestID, err)
			}
			w.mu.Lock()
			w.blocks[r.RequestID] = r.BlockIDs
			w.mu.Unlock()
		}
	}
	if w.tr.AddDelayed(r.RequestID, start, expected, r.BlockIDs) == 0 {
		// Not held: its DONEs came first, or it already finished (a
		// repeated send). Nothing will read these blocks for it, and a
		// report may already have been made, so no later Finished would
		// end the grant: end it now.
		w.revoke(r.RequestID)
	}
	w.sends.WithLabelValues("delayed").Inc()
	w.log.Debug("request held for decode", "request_id", r.RequestID, "expected_dones", expected, "blocks", len(r.BlockIDs))
	return nil
}

// Done handles DONE_RECVING (the side channel's handler), and each id of a
// batched done_batch_msg in turn. The side channel ACKs whatever it
// returns; an error is logged and counted there.
func (w *Worker) Done(reqID string) error {
	res, err := w.tr.Done(reqID, w.now())
	if err != nil {
		w.dones.WithLabelValues(res.Status.String()).Inc()
		return fmt.Errorf("done %q: %w", reqID, err)
	}
	w.dones.WithLabelValues(res.Status.String()).Inc()
	return nil
}

// Renew handles RENEW (the side channel's optional Renewer): each held
// request among reqIDs is kept from being force-freed for LeaseTTL from
// now. Ids not held are counted, not an error (a RENEW may cross the
// request's DONE, or come before its AddDelayed). With leases off it
// refuses, and the side channel answers "ERR".
func (w *Worker) Renew(reqIDs []string) error {
	if w.opts.LeaseTTL <= 0 {
		return errors.New("renew: leases are off (tracker.lease_ttl = 0)")
	}
	now := w.now()
	var renewed, missed int
	for _, id := range reqIDs {
		if w.tr.Renew(id, now) {
			renewed++
		} else {
			missed++
		}
	}
	w.renews.WithLabelValues("renewed").Add(float64(renewed))
	w.renews.WithLabelValues("not_held").Add(float64(missed))
	return nil
}

// Abort frees requests at once (the engine aborted them). It returns how
// many were held.
func (w *Worker) Abort(ids []string) int {
	n := 0
	for _, id := range ids {
		if w.tr.Abort(id) {
			n++
		}
	}
	return n
}

// Finished returns, and forgets, the requests whose blocks may be freed:
// DONE'd, not transferred, force-freed at the abort timeout, aborted.
func (w *Worker) Finished() []string {
	freed := w.tr.Finished(w.now())
	ids := make([]string, 0, len(freed))
	for _, f := range freed {
		ids = append(ids, f.ID)
		w.freed.WithLabelValues(f.Reason.String()).Inc()
		switch {
		case f.Reason == tracker.ReasonExpired && f.Lease:
			w.leaseEnds.Inc()
			w.log.Warn("request force-freed at the end of its lease: its decode stopped renewing", "request_id", f.ID, "lease_ttl", w.opts.LeaseTTL)
		case f.Reason == tracker.ReasonExpired:
			w.log.Warn("request force-freed at the abort timeout", "request_id", f.ID, "timeout", w.opts.AbortTimeout, "lease_ttl", w.opts.LeaseTTL)
		}
		w.revoke(f.ID)
	}
	return ids
}

// drainPoll is how often Drain looks at what is still held: small against
// a read's duration, nothing against the CPU (one mutex per poll).
const drainPoll = 10 * time.Millisecond

// Drain is the first phase of a prefill worker's shutdown: from now on
// every send is refused (ErrDraining), while GET_META, the transfer
// engine's reads, DONEs, aborts, renewals and the engine's finished polls
// go on as before (the caller keeps them serving). It returns once no
// request is held any more — each DONE'd, aborted or force-freed (at its
// abort timeout or lease end, by a Finished call) — and the engine has
// collected every freed request with Finished, or collect has passed since
// the last one was freed; or with an error naming how many are still held
// when ctx ends first (the drain deadline). It never frees anything
// itself.
func (w *Worker) Drain(ctx context.Context, collect time.Duration) error {
	// Under sendMu: a send in progress finishes (and its request is held)
	// before the first look below; every later one is refused.
	w.sendMu.Lock()
	w.draining.Store(true)
	w.sendMu.Unlock()
	t := time.NewTicker(drainPoll)
	defer t.Stop()
	var emptySince time.Time
	for {
		st := w.tr.Stats()
		if st.Held == 0 {
			if st.Pending == 0 {
				return nil
			}
			if emptySince.IsZero() {
				emptySince = time.Now()
			} else if time.Since(emptySince) >= collect {
				w.log.Warn("drained; the engine did not collect every freed request", "uncollected", st.Pending)
				return nil
			}
		}
		select {
		case <-ctx.Done():
			if st.Held == 0 {
				return nil
			}
			return fmt.Errorf("prefill: drain: %d requests still held: %w", st.Held, ctx.Err())
		case <-t.C:
		}
	}
}

// Draining reports whether Drain has begun.
func (w *Worker) Draining() bool { return w.draining.Load() }

func (w *Worker) revoke(id string) {
	if w.opts.Grants == nil {
		return
	}
	w.mu.Lock()
	b, ok := w.blocks[id]
	delete(w.blocks, id)
	w.mu.Unlock()
	if ok {
		if err := w.opts.Grants.Revoke(b); err != nil {
			w.log.Error("revoke read grants", "request_id", id, "err", err)
		}
	}
}

// Status is a snapshot for the control socket: held requests (leased: those
// a decode renewed), freed ones the engine has not collected yet
// (uncollected), and whether the worker is draining.
func (w *Worker) Status() map[string]any {
	st := w.tr.Stats()
	return map[string]any{"held": st.Held, "leased": st.Leased, "uncollected": st.Pending, "draining": w.draining.Load(),
		"engine_id": w.opts.Metadata.EngineID, "num_blocks": w.opts.Metadata.NumBlocks, "te_rpc_port": w.opts.Metadata.TERPCPort}
}

// earlyQuorum is how many early DONEs (DONEs before the engine's send)
// free a request on prefill rank self: the DONEs of a request large enough
// that every decode rank reading self does so (§5b.5), so that the first
// decode rank done cannot free blocks the others still read. A smaller
// request expects fewer; its early DONEs then wait for its send, which
// finds them sufficient and frees it at once.
func earlyQuorum(topo plan.Topology, self plan.Rank) func(id string) int {
	// Split mode has at most (prefill PCP × TP) entries; with that many
	// blocks none is empty. Other modes do not depend on the count.
	n := max(topo.Prefill.PCP, 1) * max(topo.Prefill.TP, 1)
	return func(id string) int {
		q, err := plan.PrefillExpectedDones(topo, self, id, n)
		if err != nil {
			return 1 // the seed's rule; send reports the error
		}
		return q
	}
}
