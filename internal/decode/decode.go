package decode

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/peers"
	"github.com/kvflow/kvflow/pipeline"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/notify"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/plan/planstage"
	"github.com/kvflow/kvflow/stages/read"
	"github.com/kvflow/kvflow/stages/stitch"
)

// KVTransferParams are the prefill side's kv_transfer_params for a request,
// as vLLM's router hands them to the decode instance.
type KVTransferParams struct {
	RemoteBlockIDs []int  `msgpack:"remote_block_ids" json:"remote_block_ids"`
	RemoteEngineID string `msgpack:"remote_engine_id" json:"remote_engine_id"`
	RemoteHost     string `msgpack:"remote_host" json:"remote_host"`
	RemotePort     int    `msgpack:"remote_port" json:"remote_port"`
	RemotePCPSize  int    `msgpack:"remote_pcp_size" json:"remote_pcp_size"`
	RemoteDCPSize  int    `msgpack:"remote_dcp_size" json:"remote_dcp_size"`
}

// LoadRequest asks for one request's blocks to be pulled.
type LoadRequest struct {
	RequestID     string           `msgpack:"request_id" json:"request_id"`
	LocalBlockIDs []int            `msgpack:"local_block_ids" json:"local_block_ids"`
	Params        KVTransferParams `msgpack:"kv_transfer_params" json:"kv_transfer_params"`
}

// Failure is a request that ended without its blocks: the engine must
// recompute (or drop) BlockIDs.
type Failure struct {
	RequestID string `msgpack:"request_id" json:"request_id"`
	BlockIDs  []int  `msgpack:"block_ids" json:"block_ids"`
	Reason    string `msgpack:"reason" json:"reason"`
}

// Result is how one request ended, for observers (OnFinish).
type Result struct {
	RequestID string
	Err       error // nil: done
	Bytes     uint64
	Latency   time.Duration
	BlockIDs  []int
}

// Options configures the worker.
type Options struct {
	Topology plan.Topology
	Self     plan.Rank
	// LocalEngineID is this decode instance's engine id.
	LocalEngineID string

	Fetcher  handshake.Fetcher
	Transfer read.Transfer
	Kernel   stitch.Kernel
	Sender   notify.Sender
	// Renewer, if set, renews leases at the prefill ranks that advertise
	// them (job.Meta.LeaseTTL > 0), for every request from its admission
	// (Load) until it ends: at once where the ranks' metadata is cached,
	// else once it is fetched (a fetch started at admission), at the
	// latest from its handshake. Nil: never renew (the seed's behaviour).
	Renewer Renewer
	// PeerAbortTimeout is the prefill side's abort timeout (its
	// tracker.abort_request_timeout, vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT),
	// which the metadata does not carry. With it set, a request whose read
	// would start more than this after its admission from a rank that
	// advertised no lease fails instead of reading (ErrStaleRead): the
	// prefill may have force-freed those blocks and reused them, and the
	// read would then land another request's bytes. Ranks this worker
	// renews leases at (Renewer set) are checked by their leases instead
	// (ErrLeaseLost, whatever this setting); without a Renewer every rank
	// is checked by this timeout. 0: no abort-timeout check (the seed's
	// behaviour).
	PeerAbortTimeout time.Duration
	Layout           plan.CacheLayout
	Local            plan.Caches
	// LocalCache is this worker's cache fingerprint: with it the handshake
	// stage checks every peer's cache against it before any read
	// (handshake.Compat), a peer without a fingerprint through
	// PeerBuffers (its transfer engine's registered buffers; nil: such
	// peers go unchecked). nil: no check.
	LocalCache  *npu.Fingerprint
	PeerBuffers handshake.SegmentLister

	Stages StageSizes
	// Peers keys the read and notify stages by prefill peer (peers.go).
	Peers PeerLimits
	// Health, if set, fails requests to prefill peers it marks down at
	// once (reason peer_down) and is fed the reads' and DONEs' outcomes
	// (health.go). Its probe loop is the caller's to run.
	Health *peers.Tracker
	// HandshakeCacheSize, HandshakeTimeout, NotifyTimeout, PerSession:
	// see the stage packages; zero takes their defaults.
	HandshakeCacheSize int
	HandshakeTimeout   time.Duration
	NotifyTimeout      time.Duration
	PerSession         int
	// ReadTimeout bounds one task's batch (0: only the engine's own I/O
	// timeout applies).
	ReadTimeout time.Duration
	// BlockSize is the tokens per block; with it and a
	// read.StridedTransfer the read stage fuses the head transpose into
	// the reads (unless NoFusedStitch) and the stitch stage idles.
	BlockSize     int
	NoFusedStitch bool
	// MaxFinished bounds finished results kept for Finished (an engine that
	// never polls must not grow memory without end); the oldest are dropped
	// and counted. 1 << 16.
	MaxFinished int

	// OnFinish, if set, is called once per request as it ends (after it is
	// recorded for Finished). It must not block.
	OnFinish func(Result)

	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

// StageSizes are each stage's workers and queue capacity.
type StageSizes struct {
	Plan, Handshake, Read, Stitch, Notify StageSize
}

// StageSize is one stage's pool.
type StageSize struct{ Workers, Capacity int }

// DefaultStageSizes: planning is microseconds (1 worker); handshakes are
// mostly cache hits but a miss waits a network round trip (4); reads are
// the long pole and run several requests' batches at once (8, the
// per-session limit keeps one peer from taking them all); stitch is
// CPU-bound and parallel inside (2 = cores here); notify waits for ACKs (8).
func DefaultStageSizes() StageSizes {
	return StageSizes{
		Plan:      StageSize{1, 256},
		Handshake: StageSize{4, 64},
		Read:      StageSize{8, 64},
		Stitch:    StageSize{2, 32},
		Notify:    StageSize{8, 64},
	}
}

// Errors.
var (
	ErrDuplicate = errors.New("decode: request already in flight")
	ErrInvalid   = errors.New("decode: invalid load request")
	ErrClosed    = errors.New("decode: worker closed")
	// ErrStaleRead fails a request whose read would start past the
	// prefill's abort timeout at a rank without a lease
	// (Options.PeerAbortTimeout).
	ErrStaleRead = errors.New("decode: stale read refused")
	// ErrLeaseLost fails a request whose lease at a prefill rank this
	// worker renews cannot be shown to hold: no RENEW of it was
	// acknowledged for the lease TTL less a margin, or an ACK came back
	// only after that (the prefill frees a renewed request one TTL after
	// its last renewal). It is an ErrStaleRead.
	ErrLeaseLost = fmt.Errorf("%w: lease not renewed", ErrStaleRead)
)

// Worker is one decode worker.
type Worker struct {
	opts Options
	log  *slog.Logger
	p    *pipeline.Pipeline[*job.Job]
	hs   *handshake.Cache
	rn   *renewer // nil without Options.Renewer

	// Admission's metadata fetches (prefetch): bgCtx ends at Close, which
	// waits for them.
	bgCtx    context.Context
	bgCancel context.CancelFunc
	bg       sync.WaitGroup

	mu       sync.Mutex
	closing  bool // Close has drained the pipeline: no more prefetches
	inflight map[string]*job.Job
	done     []string
	failed   []Failure
	dropped  int
	// lastDropLog rate-limits the warning about dropped results (w.mu).
	lastDropLog time.Time
	// release: requests canceled by Close before any DONE of theirs could
	// have left (w.mu); Close sends their DONEs so the prefill side frees
	// their blocks now rather than at its abort timeout.
	release []release

	shutdownDones *prometheus.CounterVec
	failures      *prometheus.CounterVec // by failureReason

	requests *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	bytes    prometheus.Counter
	stale    prometheus.Counter
	lost     prometheus.Counter // reads refused or discarded for a lease not shown to hold
}

// New builds and starts the worker's pipeline.
func New(o Options) (*Worker, error) {
	var errs []error
	if o.Fetcher == nil {
		errs = append(errs, errors.New("decode: nil fetcher"))
	}
	if o.Transfer == nil {
		errs = append(errs, errors.New("decode: nil transfer"))
	}
	if o.Sender == nil {
		errs = append(errs, errors.New("decode: nil sender"))
	}
	if o.Kernel == nil && o.Topology.NeedPulls() > 1 {
		errs = append(errs, errors.New("decode: nil stitch kernel with tp_num_need_pulls > 1"))
	}
	if err := o.Topology.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("decode: topology: %w", err))
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	if o.MaxFinished <= 0 {
		o.MaxFinished = 1 << 16
	}
	if o.Stages == (StageSizes{}) {
		o.Stages = DefaultStageSizes()
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	reg := o.Registerer
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	w := &Worker{opts: o, log: log.With("component", "decode"), inflight: map[string]*job.Job{}}
	w.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_decode_requests_total", Help: "Decode requests by outcome (done, failed).",
	}, []string{"outcome"})
	w.latency = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kvflow_decode_request_duration_seconds", Help: "Load to end of a decode request, by outcome.",
		Buckets: pipeline.DurationBuckets,
	}, []string{"outcome"})
	w.bytes = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_decode_bytes_total", Help: "Bytes pulled by requests that ended done.",
	})
	w.stale = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_decode_stale_reads_refused_total",
		Help: "Requests failed instead of read because their read would start past the prefill's abort timeout at a rank without a lease (blocks may have been freed).",
	})
	w.lost = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_decode_lease_lost_reads_total",
		Help: "Requests failed instead of read, or after their read, because no RENEW of theirs at a leased prefill rank was acknowledged within the lease TTL less a margin (the prefill may have freed the blocks).",
	})
	w.shutdownDones = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_decode_shutdown_dones_total",
		Help: "DONEs sent at shutdown for requests canceled before their notify stage (the prefill then frees their blocks at once), by result (acked, failed).",
	}, []string{"result"})
	w.failures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_decode_failures_total",
		Help: "Failed decode requests by reason: aborted, shutdown, timeout, incompatible (peer cache or topology differs), stale (stale read or lost lease refused), peer_restarted, short_read, or the stage that failed (handshake, read, stitch, notify), other.",
	}, []string{"reason"})
	for _, r := range failureReasons {
		w.failures.WithLabelValues(r)
	}
	for _, r := range []string{"acked", "failed"} {
		w.shutdownDones.WithLabelValues(r)
	}
	for _, c := range []prometheus.Collector{w.requests, w.latency, w.bytes, w.stale, w.lost, w.shutdownDones, w.failures} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("decode: register metrics: %w", err)
		}
	}
	for _, oc := range []string{"done", "failed"} {
		w.requests.WithLabelValues(oc)
		w.latency.WithLabelValues(oc)
	}
	hs, err := handshake.NewCache(o.Fetcher, handshake.Options{
		Size: o.HandshakeCacheSize, Timeout: o.HandshakeTimeout, LocalEngineID: o.LocalEngineID, Registerer: reg,
	})
	if err != nil {
		return nil, err
	}
	w.hs = hs
	var compat *handshake.Compat
	if o.LocalCache != nil {
		compat, err = handshake.NewCompat(handshake.CompatOptions{
			Topology: o.Topology, Layout: o.Layout, Local: *o.LocalCache, Segments: o.PeerBuffers, Registerer: reg,
		})
		if err != nil {
			return nil, err
		}
	}
	hsCheck := handshake.Stage{Cache: hs, Compat: compat}
	rd, err := read.New(o.Transfer, read.Options{
		Layout: o.Layout, Local: o.Local, PerSession: o.PerSession, Timeout: o.ReadTimeout, Registerer: reg,
		BlockSize: o.BlockSize, NoFuse: o.NoFusedStitch,
		Invalidate: func(j *job.Job, i int) { hs.Invalidate(handshake.KeyOf(j, i)) },
		// A read that failed because its peer may have restarted re-fetches
		// the peer's metadata (one fetch for all the reads that failed on
		// the same metadata) and is retried once when the new process can
		// hold the request and its deadline allows.
		// A restarted peer's metadata is checked like any other before a
		// byte of it is read: it may have come back with another cache.
		Refetch: func(ctx context.Context, j *job.Job, i int, used job.Meta, failedAt time.Time) (job.Meta, error) {
			fresh, err := hs.Refetch(ctx, handshake.KeyOf(j, i), used, failedAt)
			if err != nil || compat == nil {
				return fresh, err
			}
			held := j.Metas[i]
			j.Metas[i] = fresh
			err = hsCheck.CheckTask(ctx, j, i)
			j.Metas[i] = held
			if err != nil {
				return job.Meta{}, err
			}
			return fresh, nil
		},
		BeforeRetry: func(j *job.Job, i int) error {
			if w.rn == nil && o.PeerAbortTimeout <= 0 {
				return nil
			}
			return w.guard().check(j, i)
		},
	})
	if err != nil {
		return nil, err
	}
	sender := o.Sender
	if o.Health != nil {
		sender = newHealthSender(sender, o.Health)
	}
	nt, err := notify.New(sender, notify.Options{Timeout: o.NotifyTimeout, Logger: log, Registerer: reg})
	if err != nil {
		return nil, err
	}
	st := o.Stages
	var hsStage pipeline.Stage[*job.Job] = hsCheck
	if o.Renewer != nil {
		if w.rn, err = newRenewer(o.Renewer, w.log, reg); err != nil {
			return nil, fmt.Errorf("decode: register metrics: %w", err)
		}
		hsStage = leaseStage{Stage: hsCheck, rn: w.rn}
	}
	var rdStage pipeline.Stage[*job.Job] = rd
	if o.PeerAbortTimeout > 0 || w.rn != nil {
		rdStage = w.guard(rd)
	}
	if o.Health != nil {
		hsStage = healthGate{Stage: hsStage, h: o.Health, recordFail: true}
		rdStage = healthGate{Stage: rdStage, h: o.Health, record: true}
	}
	stages := []pipeline.StageConfig[*job.Job]{
		{Name: "plan", Workers: st.Plan.Workers, Capacity: st.Plan.Capacity, Stage: planstage.Stage{Topology: o.Topology, Self: o.Self}},
		{Name: "handshake", Workers: st.Handshake.Workers, Capacity: st.Handshake.Capacity, Stage: hsStage},
		{Name: "read", Workers: st.Read.Workers, Capacity: st.Read.Capacity, Stage: rdStage},
		{Name: "stitch", Workers: st.Stitch.Workers, Capacity: st.Stitch.Capacity, Stage: stitch.Stage{Kernel: o.Kernel}},
		{Name: "notify", Workers: st.Notify.Workers, Capacity: st.Notify.Capacity, Stage: nt, SeesFailed: true},
	}
	o.Peers.keyed(&stages[2], &stages[4])
	p, err := pipeline.New(pipeline.Config[*job.Job]{
		Stages:     stages,
		Sink:       w.sink,
		Registerer: reg,
		Logger:     log,
	})
	if err != nil {
		if w.rn != nil {
			w.rn.close()
		}
		return nil, err
	}
	w.p = p
	w.bgCtx, w.bgCancel = context.WithCancel(context.Background())
	return w, nil
}

// Load submits requests; it blocks while the pipeline is full (ctx bounds
// the wait). The error at index i is request i's: nil means it was
// accepted and will appear exactly once in Finished.
func (w *Worker) Load(ctx context.Context, reqs []LoadRequest) []error {
	errs := make([]error, len(reqs))
	for i, r := range reqs {
		errs[i] = w.load(ctx, r)
	}
	return errs
}

func (w *Worker) load(ctx context.Context, r LoadRequest) error {
	if err := validate(r); err != nil {
		return err
	}
	j := job.New(plan.Request{
		ID:             r.RequestID,
		LocalBlockIDs:  r.LocalBlockIDs,
		RemoteBlockIDs: r.Params.RemoteBlockIDs,
		RemoteHost:     r.Params.RemoteHost,
		RemotePort:     r.Params.RemotePort,
		RemoteEngineID: r.Params.RemoteEngineID,
		RemotePCPSize:  max(1, r.Params.RemotePCPSize),
		RemoteDCPSize:  max(1, r.Params.RemoteDCPSize),
	}, time.Now())
	w.mu.Lock()
	if _, dup := w.inflight[r.RequestID]; dup {
		w.mu.Unlock()
		return fmt.Errorf("load %q: %w", r.RequestID, ErrDuplicate)
	}
	w.inflight[r.RequestID] = j
	w.mu.Unlock()
	if w.rn != nil {
		// Leased from now: it may wait in a queue longer than the
		// prefill's abort timeout before its handshake.
		w.leaseAtAdmission(j)
	}
	if err := w.p.Submit(ctx, j); err != nil {
		if w.rn != nil {
			w.rn.remove(r.RequestID) // never submitted: no sink will
		}
		w.mu.Lock()
		delete(w.inflight, r.RequestID)
		w.mu.Unlock()
		j.Release()
		if errors.Is(err, pipeline.ErrClosed) {
			return fmt.Errorf("load %q: %w", r.RequestID, ErrClosed)
		}
		return fmt.Errorf("load %q: %w", r.RequestID, err)
	}
	w.log.Debug("request loaded", "request_id", r.RequestID, "blocks", len(r.LocalBlockIDs))
	return nil
}

func validate(r LoadRequest) error {
	var errs []error
	if r.RequestID == "" {
		errs = append(errs, errors.New("request_id: empty"))
	}
	p := r.Params
	if p.RemoteHost == "" {
		errs = append(errs, errors.New("kv_transfer_params.remote_host: empty"))
	}
	if p.RemotePort <= 0 || p.RemotePort > 65535 {
		errs = append(errs, fmt.Errorf("kv_transfer_params.remote_port: %d out of range", p.RemotePort))
	}
	if p.RemoteEngineID == "" {
		errs = append(errs, errors.New("kv_transfer_params.remote_engine_id: empty"))
	}
	if p.RemotePCPSize < 0 || p.RemoteDCPSize < 0 {
		errs = append(errs, fmt.Errorf("kv_transfer_params.remote_pcp_size/remote_dcp_size: negative (%d, %d)", p.RemotePCPSize, p.RemoteDCPSize))
	}
	if len(errs) > 0 {
		return fmt.Errorf("load %q: %w: %w", r.RequestID, ErrInvalid, errors.Join(errs...))
	}
	return nil
}

// Abort cancels in-flight requests; each still ends exactly once (failed,
// reason "aborted", unless it had already finished). Unknown ids are
// ignored; the count of requests aborted is returned.
func (w *Worker) Abort(ids []string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, id := range ids {
		if j, ok := w.inflight[id]; ok {
			j.Abort(job.ErrAborted)
			n++
		}
	}
	return n
}

// Finished returns, and forgets, the requests that ended since the last
// call: done ids and failures.
func (w *Worker) Finished() (done []string, failed []Failure) {
	w.mu.Lock()
	defer w.mu.Unlock()
	done, failed = w.done, w.failed
	w.done, w.failed = nil, nil
	return done, failed
}

// Status is a snapshot of the worker.
type Status struct {
	InFlight       int `msgpack:"in_flight" json:"in_flight"`
	PendingDone    int `msgpack:"pending_done" json:"pending_done"`
	PendingFailed  int `msgpack:"pending_failed" json:"pending_failed"`
	DroppedResults int `msgpack:"dropped_results" json:"dropped_results"`
	CachedPeers    int `msgpack:"cached_peers" json:"cached_peers"`
}

// Status reports counts.
func (w *Worker) Status() Status {
	w.mu.Lock()
	defer w.mu.Unlock()
	return Status{InFlight: len(w.inflight), PendingDone: len(w.done), PendingFailed: len(w.failed),
		DroppedResults: w.dropped, CachedPeers: w.hs.Len()}
}

// Close stops intake and drains in-flight requests until ctx ends; then
// cancels the rest, which end as failed ("canceled"). Leases are renewed
// while requests drain, and renewals stop once the pipeline is closed.
func (w *Worker) Close(ctx context.Context) error {
	err := w.p.Close(ctx)
	w.mu.Lock()
	w.closing = true
	rel := w.release
	w.release = nil
	w.mu.Unlock()
	w.sendReleases(ctx, rel)
	w.bgCancel()
	w.bg.Wait()
	if w.rn != nil {
		w.rn.close()
	}
	return err
}

// release names the DONEs a request canceled at shutdown still owes.
type release struct {
	id        string
	endpoints []string
}

// releaseOf is the release a result owes: a request canceled (by Close,
// past its drain deadline) in a stage before notify has sent no DONE, and
// its reads have stopped (a canceled batch returns only once the engine
// no longer touches its memory), so its DONEs are safe to send. One
// canceled in notify itself may have delivered some already (a DONE
// counted twice could free a block another decode rank still reads): it
// owes none here.
// A request canceled before it was planned is planned here for its
// endpoints.
func (w *Worker) releaseOf(r pipeline.Result[*job.Job]) release {
	j := r.Item
	if r.Outcome != pipeline.Canceled || r.Stage == "notify" {
		return release{}
	}
	if err := planstage.Plan(w.opts.Topology, w.opts.Self, j); err != nil {
		return release{}
	}
	// One DONE per task, as notify sends: the prefill rank counts them
	// (plan.PrefillExpectedDones counts tasks).
	rel := release{id: j.Req.ID}
	for i := range j.Plan.Tasks {
		rel.endpoints = append(rel.endpoints, j.HandshakeEndpoint(i))
	}
	return rel
}

// ReleaseTimeout bounds the DONEs Close sends for requests it canceled,
// beyond Close's own context (which has usually ended by then).
var ReleaseTimeout = 2 * time.Second

// sendReleases sends the DONEs of requests canceled at shutdown, at most 16
// at a time, within ReleaseTimeout. A prefill that misses one frees those
// blocks at its abort timeout (or lease expiry), as it would have anyway.
func (w *Worker) sendReleases(ctx context.Context, rel []release) {
	if len(rel) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ReleaseTimeout)
	defer cancel()
	var g errgroup.Group
	g.SetLimit(16)
	var acked, failed atomic.Int64
	for _, r := range rel {
		for _, ep := range r.endpoints {
			g.Go(func() error {
				if err := w.opts.Sender.SendDone(ctx, ep, r.id); err != nil {
					failed.Add(1)
				} else {
					acked.Add(1)
				}
				return nil
			})
		}
	}
	g.Wait()
	w.shutdownDones.WithLabelValues("acked").Add(float64(acked.Load()))
	w.shutdownDones.WithLabelValues("failed").Add(float64(failed.Load()))
	w.log.Info("sent DONEs for requests canceled at shutdown", "requests", len(rel), "acked", acked.Load(), "failed", failed.Load())
}

// guard is the worker's stale-read guard around stage (nil: the check
// alone, for BeforeRetry).
func (w *Worker) guard(stage ...pipeline.Stage[*job.Job]) staleGuard {
	g := staleGuard{abort: w.opts.PeerAbortTimeout, now: time.Now, refused: w.stale, lost: w.lost}
	if len(stage) > 0 {
		g.Stage = stage[0]
	}
	if w.rn != nil {
		// A lease protects only when this worker renews it.
		g.leases = w.rn
	}
	return g
}

// staleGuard is the read stage behind the stale-read checks: the abort
// timeout at ranks without a lease this worker renews
// (Options.PeerAbortTimeout), the lease at the others (Options.Renewer).
// A read is refused when it would start past either; one that started in
// time and ended past a lease fails too (the prefill may have freed and
// reused the blocks while it ran). Notify still sends the DONEs.
type staleGuard struct {
	pipeline.Stage[*job.Job]
	abort   time.Duration
	now     func() time.Time
	leases  leaseView // nil: no Renewer
	refused prometheus.Counter
	lost    prometheus.Counter
}

func (s staleGuard) Process(ctx context.Context, j *job.Job) error {
	if err := s.checkAll(j, "started"); err != nil {
		return err
	}
	if err := s.Stage.Process(ctx, j); err != nil {
		return err
	}
	return s.checkLeases(j)
}

// check is the guard for task i alone (a read retried after its peer
// restarted: j.Metas[i] is the re-fetched metadata), counted.
func (s staleGuard) check(j *job.Job, i int) error {
	return s.count(staleTask(j, i, s.abort, s.now(), s.leases, "started"))
}

func (s staleGuard) checkAll(j *job.Job, when string) error {
	return s.count(staleRead(j, s.abort, s.now(), s.leases, when))
}

// checkLeases re-checks j's leases once its read ended: the bytes came
// from blocks the prefill held throughout only if the leases still hold.
func (s staleGuard) checkLeases(j *job.Job) error {
	if s.leases == nil {
		return nil
	}
	return s.checkAll(j, "ended")
}

func (s staleGuard) count(err error) error {
	switch {
	case err == nil:
	case errors.Is(err, ErrLeaseLost):
		s.lost.Inc()
	default:
		s.refused.Inc()
	}
	return err
}

// staleRead is ErrStaleRead, with its reason, if j's read starting (or,
// when is "ended", ending) at now cannot be trusted at some task's rank
// (staleTask).
func staleRead(j *job.Job, abort time.Duration, now time.Time, leases leaseView, when string) error {
	for i := range j.Plan.Tasks {
		if err := staleTask(j, i, abort, now, leases, when); err != nil {
			return err
		}
	}
	return nil
}

// staleTask is the guard for task i at now:
//   - a rank that advertised a lease and where this worker renews j's
//     request (leases knows it): ErrLeaseLost once its hold ends — the
//     send time of the last acknowledged RENEW (before any, the lease
//     start) plus the TTL less leaseMargin — or once an ACK came back
//     after that (it may have been an ACK of a request already freed);
//   - any other rank, when read starts: ErrStaleRead once now is past
//     abort after j's admission: the prefill may have force-freed the
//     blocks (it started its own timer before j was admitted here) and
//     given them to another request. When a read ends it is not checked
//     again (no lease says more).
func staleTask(j *job.Job, i int, abort time.Duration, now time.Time, leases leaseView, when string) error {
	if leases != nil && j.Metas[i].LeaseTTL > 0 {
		if h, ok := leases.leaseOf(j.Req.ID, j.HandshakeEndpoint(i)); ok {
			return holdErr(h, now, i, j.HandshakeEndpoint(i), when)
		}
	}
	if when != "started" {
		return nil
	}
	age := now.Sub(j.Submitted)
	if abort <= 0 || age <= abort {
		return nil
	}
	return fmt.Errorf("%w: task %d (%s): read started %v after admission, past the prefill's abort timeout %v; blocks may have been freed",
		ErrStaleRead, i, j.HandshakeEndpoint(i), age.Round(time.Millisecond), abort)
}

// holdErr is ErrLeaseLost, with its reason, if h does not hold at now.
func holdErr(h leaseHold, now time.Time, i int, endpoint, when string) error {
	end := h.until(h.ttl)
	var why string
	switch {
	case h.lapsed:
		why = "a RENEW was acknowledged only after the lease may have run out"
	case now.After(end) && h.acked.IsZero():
		why = fmt.Sprintf("no RENEW acknowledged in the %v since the lease started", now.Sub(h.since).Round(time.Millisecond))
	case now.After(end):
		why = fmt.Sprintf("no RENEW acknowledged in the %v since the last acknowledged one was sent", now.Sub(h.acked).Round(time.Millisecond))
	default:
		return nil
	}
	return fmt.Errorf("%w: task %d (%s): read %s when %s (lease ttl %v, trusted for %v of it); the prefill may have freed the blocks",
		ErrLeaseLost, i, endpoint, when, why, h.ttl, h.ttl-leaseMargin(h.ttl))
}

func (w *Worker) sink(r pipeline.Result[*job.Job]) {
	j := r.Item
	defer j.Release()
	var err error
	switch r.Outcome {
	case pipeline.Done:
		if cause := j.Aborted(); cause != nil {
			// It finished its work as the abort came: the bytes landed but
			// the engine asked to drop it; report what it asked for.
			err = cause
		}
	default:
		err = r.Err
		if cause := j.Aborted(); cause != nil {
			err = fmt.Errorf("%w (%v)", cause, r.Err)
		}
		if r.Stage != "" {
			err = fmt.Errorf("stage %s: %w", r.Stage, err)
		}
	}
	reason := ""
	if err != nil {
		reason = failureReason(err, r.Stage)
	}
	lat := time.Since(j.Submitted)
	if w.rn != nil {
		w.rn.remove(j.Req.ID)
	}
	rel := w.releaseOf(r)
	w.mu.Lock()
	if rel.id != "" {
		w.release = append(w.release, rel)
	}
	delete(w.inflight, j.Req.ID)
	if err == nil {
		w.done = append(w.done, j.Req.ID)
	} else {
		w.failed = append(w.failed, Failure{RequestID: j.Req.ID, BlockIDs: j.Req.LocalBlockIDs, Reason: err.Error()})
	}
	dropLog := false
	if over := len(w.done) + len(w.failed) - w.opts.MaxFinished; over > 0 {
		w.dropOldest(over)
		if now := time.Now(); now.Sub(w.lastDropLog) >= time.Second {
			w.lastDropLog, dropLog = now, true
		}
	}
	dropped := w.dropped
	w.mu.Unlock()
	if dropLog {
		w.log.Warn("finished results dropped: the engine has not polled finished", "kept", w.opts.MaxFinished, "dropped_total", dropped)
	}
	if err == nil {
		w.requests.WithLabelValues("done").Inc()
		w.latency.WithLabelValues("done").Observe(lat.Seconds())
		w.bytes.Add(float64(j.BytesRead.Load()))
		w.log.Debug("request done", "request_id", j.Req.ID, "bytes", j.BytesRead.Load(), "latency", lat)
	} else {
		w.requests.WithLabelValues("failed").Inc()
		w.latency.WithLabelValues("failed").Observe(lat.Seconds())
		w.failures.WithLabelValues(reason).Inc()
		w.log.Warn("request failed", "request_id", j.Req.ID, "blocks", len(j.Req.LocalBlockIDs), "reason", reason, "err", err)
	}
	if w.opts.OnFinish != nil {
		w.opts.OnFinish(Result{RequestID: j.Req.ID, Err: err, Bytes: j.BytesRead.Load(), Latency: lat, BlockIDs: j.Req.LocalBlockIDs})
	}
}

// dropOldest discards n finished results, done ones first (a failure is
// what the engine most needs to see). Called with w.mu held.
func (w *Worker) dropOldest(n int) {
	d := min(n, len(w.done))
	w.done = w.done[d:]
	n -= d
	if n > 0 {
		w.failed = w.failed[n:]
	}
	w.dropped += d + n
}
