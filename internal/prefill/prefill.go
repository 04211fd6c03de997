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
	// Grant makes blocks readable (counted: each Grant needs its Revoke).
	Grant(blocks []int) error
	// Revoke ends one Grant of blocks at once — no new read of them is
	// served — and never waits: the channel is closed when no read of
	// them is in flight any more (a stalled reader is cut at the
	// engine's deadline). The blocks are reported free only then.
	Revoke(blocks []int) (<-chan struct{}, error)
	// GrantAll makes every block readable until the matching RevokeAll:
	// for a held request whose send named no blocks (GrantsAuto).
	GrantAll() error
	// RevokeAll ends one GrantAll, at once.
	RevokeAll() error
}

// RequestGrants is Grants that binds each grant to its request (hw/shm's
// grant table, node.te_backend shm): a reader that names its request can
// then tell its own blocks from blocks freed and already granted to
// another request. The worker uses it instead of Grant/Revoke when Grants
// implements it.
type RequestGrants interface {
	Grants
	GrantRequest(id string, blocks []int) error
	RevokeRequest(id string, blocks []int) (<-chan struct{}, error)
}

// GrantMode says what a send without block ids gets when Grants is set.
type GrantMode uint8

const (
	// GrantsAuto (read.grants: auto): a send with block ids grants exactly
	// those blocks; one without (an engine that cannot name them) opens
	// every block for as long as its request is held (GrantAll), with a
	// warning the first time.
	GrantsAuto GrantMode = iota
	// GrantsStrict (read.grants: on): a send without block ids grants
	// nothing, so its decode's reads are refused (warned the first time).
	GrantsStrict
)

// grantRec is what a held request's send granted.
type grantRec struct {
	blocks []int
	all    bool // GrantAll
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
	// GrantMode applies with Grants set.
	GrantMode GrantMode
	// MaxEarly and EarlyTTL bound the early DONEs (DONEs for ids not
	// sent yet) kept waiting for their send; 0 selects the tracker's
	// defaults (tracker.DefaultMaxEarly, tracker.DefaultEarlyTTL).
	MaxEarly int
	EarlyTTL time.Duration
	// HeldAgeAlert is the age past which a held request counts in
	// kvflow_tracker_requests_held_past_age (stranded blocks); 0 = 120 s.
	HeldAgeAlert time.Duration
	Now          func() time.Time
	Registerer   prometheus.Registerer
	Logger       *slog.Logger
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

	// mu orders a send's grant and hold against Finished's revoke, and
	// guards the grant bookkeeping.
	mu      sync.Mutex
	granted map[string]grantRec // what each held request's send granted
	// revoking: revokes whose reads may still be in flight, by request;
	// deferred: requests the tracker freed whose revokes have not
	// completed, reported by a later Finished once they have (in order).
	revoking  map[string][]<-chan struct{}
	deferred  []tracker.Freed
	warnNoIDs sync.Once

	sends     *prometheus.CounterVec
	dones     *prometheus.CounterVec
	renews    *prometheus.CounterVec
	freed     *prometheus.CounterVec
	leaseEnds prometheus.Counter
	heldGage  prometheus.GaugeFunc
	noIDs     prometheus.Counter
	deferGage prometheus.GaugeFunc
	early     []prometheus.Collector
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
	if o.MaxEarly < 0 || o.EarlyTTL < 0 {
		return nil, fmt.Errorf("prefill: early DONE bounds: max %d, ttl %v: negative", o.MaxEarly, o.EarlyTTL)
	}
	// HoldEarly: the engine is told only of requests it sent. An early
	// DONE (before the send) waits for the send, which then finds it and
	// frees the request at once, reported by the next Finished; a DONE
	// for an id never sent is never reported (see doc.go).
	w := &Worker{opts: o, log: log.With("component", "prefill"), now: o.Now, granted: map[string]grantRec{},
		revoking: map[string][]<-chan struct{}{},
		tr: tracker.New(tracker.Options{AbortTimeout: o.AbortTimeout, LeaseTTL: o.LeaseTTL, MaxRecords: o.MaxRecords,
			EarlyQuorum: earlyQuorum(o.Topology, o.Self), HoldEarly: true, MaxEarly: o.MaxEarly, EarlyTTL: o.EarlyTTL})}
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
	w.noIDs = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_prefill_sends_without_block_ids_total",
		Help: "Held requests whose send named no block ids, with read grants on: read.grants auto opened every block while each was held, on granted nothing.",
	})
	w.deferGage = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvflow_prefill_revokes_pending_requests",
		Help: "Requests freed but not yet reported to the engine because a read of their blocks is still in flight (reported when it ends or is cut).",
	}, func() float64 { w.mu.Lock(); defer w.mu.Unlock(); return float64(len(w.deferred)) })
	for _, r := range []struct {
		reason string
		get    func(tracker.Stats) uint64
	}{{"capacity", func(s tracker.Stats) uint64 { return s.EarlyEvicted }}, {"age", func(s tracker.Stats) uint64 { return s.EarlyExpired }}} {
		w.early = append(w.early, prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "kvflow_prefill_early_dones_dropped_total",
			Help:        "DONEs for requests not sent (yet) dropped unreported, by reason (capacity: beyond the bound on kept early DONEs, oldest first; age: their send never came within the early DONE ttl).",
			ConstLabels: prometheus.Labels{"reason": r.reason},
		}, func() float64 { return float64(r.get(w.tr.Stats())) }))
	}
	w.early = append(w.early, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvflow_prefill_early_dones",
		Help: "DONEs for requests not sent yet, kept until their send (bounded by count and age).",
	}, func() float64 { return float64(w.tr.Stats().Early) }))
	if o.Registerer != nil {
		for _, c := range append([]prometheus.Collector{w.sends, w.dones, w.renews, w.freed, w.leaseEnds, w.heldGage, w.noIDs, w.deferGage, w.heldPastGauge()}, w.early...) {
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
	// The grant and the hold are one step against Finished (w.mu): a
	// DONE that frees the request as soon as it is held finds its grant
	// recorded, and Finished revokes it before reporting it.
	w.mu.Lock()
	rec, err := w.grant(r)
	if err != nil {
		w.mu.Unlock()
		w.sends.WithLabelValues("rejected").Inc()
		return fmt.Errorf("send %q: grant blocks: %w", r.RequestID, err)
	}
	if w.tr.AddDelayed(r.RequestID, start, expected, r.BlockIDs) == 0 {
		// Not held: its early DONEs already satisfied it (the tracker
		// reports it by the next Finished, once this revoke is done), or
		// it already finished (a repeated send). Nothing will read these
		// blocks for it: end the grant now.
		w.endGrantLocked(r.RequestID, rec)
	} else if w.opts.Grants != nil {
		w.granted[r.RequestID] = rec
	}
	w.mu.Unlock()
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
//
// A request whose blocks a read may still be serving (its grant was just
// revoked) is held back and returned by a later call, once that read has
// ended or been cut off (the transfer engine's revoke grace): the engine
// never gets blocks back while a peer still reads them. It never waits.
func (w *Worker) Finished() []string {
	w.mu.Lock()
	for _, f := range w.tr.Finished(w.now()) {
		if rec, ok := w.granted[f.ID]; ok {
			delete(w.granted, f.ID)
			w.endGrantLocked(f.ID, rec)
		}
		w.deferred = append(w.deferred, f)
	}
	var freed []tracker.Freed
	keep := w.deferred[:0]
	for _, f := range w.deferred {
		if w.revokedLocked(f.ID) {
			freed = append(freed, f)
		} else {
			keep = append(keep, f)
		}
	}
	clear(w.deferred[len(keep):])
	w.deferred = keep
	for id := range w.revoking { // revokes no report waits for (a repeated send)
		w.revokedLocked(id)
	}
	w.mu.Unlock()
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
		st.Pending = w.uncollected(st)
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

// grant opens what r's send makes readable (w.mu held): its blocks, or
// with none named every block (GrantsAuto) or nothing (GrantsStrict).
func (w *Worker) grant(r SendRequest) (grantRec, error) {
	g := w.opts.Grants
	if g == nil {
		return grantRec{}, nil
	}
	if len(r.BlockIDs) > 0 {
		if rg, ok := g.(RequestGrants); ok {
			return grantRec{blocks: r.BlockIDs}, rg.GrantRequest(r.RequestID, r.BlockIDs)
		}
		return grantRec{blocks: r.BlockIDs}, g.Grant(r.BlockIDs)
	}
	w.noIDs.Inc()
	if w.opts.GrantMode == GrantsStrict {
		w.warnNoIDs.Do(func() {
			w.log.Warn("send without block_ids under read.grants=on: nothing is granted for such a request, so its decode's reads are refused and it fails; send block_ids, or set read.grants=auto",
				"request_id", r.RequestID)
		})
		return grantRec{}, nil
	}
	w.warnNoIDs.Do(func() {
		w.log.Warn("send without block_ids: read grants cannot name this request's blocks, so every registered block is readable while such a request is held: "+
			"any peer that reaches the data port can read any block then, and a decode reading after a forged or early DONE freed its request may get reused blocks and report them done; "+
			"an engine that sends block_ids gets grants on exactly those blocks", "request_id", r.RequestID)
	})
	return grantRec{all: true}, g.GrantAll()
}

// endGrantLocked revokes what rec granted for id, without waiting; the
// revoke's completion is tracked in w.revoking (w.mu held).
func (w *Worker) endGrantLocked(id string, rec grantRec) {
	g := w.opts.Grants
	switch {
	case g == nil:
	case rec.all:
		if err := g.RevokeAll(); err != nil {
			w.log.Error("revoke read grants", "request_id", id, "err", err)
		}
	case len(rec.blocks) > 0:
		var done <-chan struct{}
		var err error
		if rg, ok := g.(RequestGrants); ok {
			done, err = rg.RevokeRequest(id, rec.blocks)
		} else {
			done, err = g.Revoke(rec.blocks)
		}
		if err != nil {
			w.log.Error("revoke read grants", "request_id", id, "err", err)
		}
		if done != nil {
			w.revoking[id] = append(w.revoking[id], done)
		}
	}
}

// revokedLocked reports whether every revoke of id's blocks has completed
// (no read of them in flight), forgetting those that have (w.mu held).
func (w *Worker) revokedLocked(id string) bool {
	chans := w.revoking[id]
	for len(chans) > 0 {
		select {
		case <-chans[0]:
			chans = chans[1:]
			continue
		default:
		}
		w.revoking[id] = chans
		return false
	}
	delete(w.revoking, id)
	return true
}

// uncollected is the number of freed requests the engine has not
// collected yet (the tracker's, and those waiting for their revokes).
func (w *Worker) uncollected(st tracker.Stats) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return st.Pending + len(w.deferred)
}

// Status is a snapshot for the control socket: held requests (leased: those
// a decode renewed), freed ones the engine has not collected yet
// (uncollected), whether the worker is draining, and its boot epoch
// (boot_epoch: what its metadata sends; the engine's scheduler puts it in
// the kv_transfer_params it hands decode, as kvflow_boot_epochs).
func (w *Worker) Status() map[string]any {
	st := w.tr.Stats()
	return map[string]any{"held": st.Held, "leased": st.Leased, "uncollected": w.uncollected(st), "early_dones": st.Early, "draining": w.draining.Load(),
		"engine_id": w.opts.Metadata.EngineID, "num_blocks": w.opts.Metadata.NumBlocks, "te_rpc_port": w.opts.Metadata.TERPCPort,
		"boot_epoch": w.opts.Metadata.Ext.BootEpoch}
}

// BootEpoch is the epoch this worker's metadata sends (its start time in
// unix nanoseconds unless the node was given one): a restart changes it.
func (w *Worker) BootEpoch() uint64 { return w.opts.Metadata.Ext.BootEpoch }

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
