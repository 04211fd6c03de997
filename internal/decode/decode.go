package decode

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/peers"
	"github.com/kvflow/kvflow/pipeline"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/lease"
	"github.com/kvflow/kvflow/stages/notify"
	"github.com/kvflow/kvflow/stages/plan"
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
	// BootEpochs is kvflow's optional kvflow_boot_epochs: entry r is the
	// boot epoch of the prefill rank at remote_port + r when it handed the
	// request over, 0 where its scheduler did not know it. A kvflow decode
	// fails the request, reading nothing, when a rank's metadata carries
	// another epoch (the rank restarted: job.ErrBootEpoch); absent (a seed
	// prefill), nothing is compared. Signed on the wire so that a negative
	// value is refused (validate), not wrapped.
	BootEpochs []int64 `msgpack:"kvflow_boot_epochs,omitempty" json:"kvflow_boot_epochs,omitempty"`
}

// MaxBootEpochs bounds kvflow_boot_epochs: one entry per prefill rank of
// an instance, whose side-channel ports are all below 65536.
const MaxBootEpochs = 65535

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

	// Stages sizes each stage's pool; zero: every stage's DefaultPool.
	Stages StageSizes
	// Handshake, Read and Notify are those stages' configurations; the
	// zero value of each is its package's DefaultConfig.
	Handshake handshake.Config
	Read      read.Config
	Notify    notify.Config
	// Peers keys the read and notify stages by prefill peer (peers.go);
	// the zero value is peers.DefaultConfig.
	Peers peers.Config
	// Health, if set, fails requests to prefill peers it marks down at
	// once (reason peer_down) and is fed the reads' and DONEs' outcomes
	// (health.go). Its probe loop is the caller's to run.
	Health *peers.Tracker
	// BlockSize is the tokens per block; with it and a
	// transfer that lays out strided rows (read.Capabilities.LocalStride)
	// the read stage fuses the head transpose into the reads (unless
	// Read.FusedStitch is off) and the stitch stage idles.
	BlockSize int
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

// Errors.
var (
	ErrDuplicate = errors.New("decode: request already in flight")
	ErrInvalid   = errors.New("decode: invalid load request")
	ErrClosed    = errors.New("decode: worker closed")
	// ErrStaleRead fails a request whose read would start past the
	// prefill's abort timeout at a rank without a lease
	// (Options.PeerAbortTimeout): the read stage's guard.
	ErrStaleRead = read.ErrStaleRead
	// ErrLeaseLost fails a request whose lease at a prefill rank this
	// worker renews cannot be shown to hold (read.ErrLeaseLost). It is an
	// ErrStaleRead.
	ErrLeaseLost = read.ErrLeaseLost
)

// Worker is one decode worker: a thin shell around the chain of stages
// (stages.go) that admits requests, submits them and collects how they
// ended. What a stage does at admission, when a request ends and at
// shutdown is the stage's own (hooks.go).
type Worker struct {
	opts  Options
	log   *slog.Logger
	p     *pipeline.Pipeline[*job.Job]
	hooks hooks

	// For Status (and tests): the handshake stage's metadata cache and
	// the plan stage's lease keeper (nil without Options.Renewer).
	hs  *handshake.Cache
	rn  *lease.Keeper
	reg prometheus.Registerer // the stages' metrics too

	mu       sync.Mutex
	inflight map[string]*job.Job
	done     []string
	failed   []Failure
	dropped  int
	// lastDropLog rate-limits the warning about dropped results (w.mu).
	lastDropLog time.Time

	failures *prometheus.CounterVec // by failureReason
	requests *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	bytes    prometheus.Counter
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
	if o.Handshake == (handshake.Config{}) {
		o.Handshake = handshake.DefaultConfig()
	}
	if o.Read == (read.Config{}) {
		o.Read = read.DefaultConfig()
	}
	if o.Notify == (notify.Config{}) {
		o.Notify = notify.DefaultConfig()
	}
	if o.Peers == (peers.Config{}) {
		o.Peers = peers.DefaultConfig()
	}
	if o.Health != nil {
		o.Sender = newHealthSender(o.Sender, o.Health)
	}
	for _, c := range []struct {
		name string
		err  error
	}{{"handshake", o.Handshake.Validate()}, {"read", o.Read.Validate()}, {"notify", o.Notify.Validate()}, {"peers", o.Peers.Validate()}} {
		if c.err != nil {
			return nil, fmt.Errorf("decode: %s config: %w", c.name, c.err)
		}
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	reg := o.Registerer
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	w := &Worker{opts: o, log: log.With("component", "decode"), reg: reg, inflight: map[string]*job.Job{}}
	if err := w.registerMetrics(reg); err != nil {
		return nil, err
	}
	b := &builder{o: o, reg: reg, log: log}
	var stages []pipeline.StageConfig[*job.Job]
	for _, row := range chain {
		st, err := row.build(b)
		if err != nil {
			b.hooks.close(context.Background())
			return nil, fmt.Errorf("decode: %s stage: %w", row.name, err)
		}
		b.hooks.add(st)
		if o.Health != nil {
			st = gate(row.name, st, o.Health)
		}
		size := *row.size(&o.Stages)
		sc := pipeline.StageConfig[*job.Job]{
			Name: row.name, Workers: size.Workers, Capacity: size.Queue, Stage: st, SeesFailed: row.seesFailed,
		}
		keyed(o.Peers, &sc)
		stages = append(stages, sc)
	}
	w.hooks, w.hs, w.rn = b.hooks, b.hs.Cache, b.pl.Leases()
	p, err := pipeline.New(pipeline.Config[*job.Job]{
		Stages:     stages,
		Sink:       w.sink,
		Registerer: reg,
		Logger:     log,
	})
	if err != nil {
		w.hooks.close(context.Background())
		return nil, err
	}
	w.p = p
	return w, nil
}

func (w *Worker) registerMetrics(reg prometheus.Registerer) error {
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
	w.failures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_decode_failures_total",
		Help: "Failed decode requests by reason: aborted, shutdown, timeout, incompatible (peer cache or topology differs), stale (stale read or lost lease refused), peer_restarted, short_read, or the stage that failed (handshake, read, stitch, notify), other.",
	}, []string{"reason"})
	for _, r := range failureReasons {
		w.failures.WithLabelValues(r)
	}
	for _, c := range []prometheus.Collector{w.requests, w.latency, w.bytes, w.failures} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("decode: register metrics: %w", err)
		}
	}
	for _, oc := range []string{"done", "failed"} {
		w.requests.WithLabelValues(oc)
		w.latency.WithLabelValues(oc)
	}
	return nil
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
		BootEpochs:     bootEpochs(r.Params.BootEpochs),
	}, time.Now())
	w.mu.Lock()
	if _, dup := w.inflight[r.RequestID]; dup {
		w.mu.Unlock()
		return fmt.Errorf("load %q: %w", r.RequestID, ErrDuplicate)
	}
	w.inflight[r.RequestID] = j
	w.mu.Unlock()
	w.hooks.admit(j) // e.g. leased from now: it may queue past the prefill's abort timeout
	if err := w.p.Submit(ctx, j); err != nil {
		w.hooks.unadmit(j) // never submitted: no sink will end it
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
	if n := len(p.BootEpochs); n > MaxBootEpochs {
		errs = append(errs, fmt.Errorf("kv_transfer_params.kvflow_boot_epochs: %d entries, at most %d (one per prefill rank)", n, MaxBootEpochs))
	}
	for i, e := range p.BootEpochs {
		if e < 0 {
			errs = append(errs, fmt.Errorf("kv_transfer_params.kvflow_boot_epochs[%d]: negative boot epoch %d", i, e))
			break
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("load %q: %w: %w", r.RequestID, ErrInvalid, errors.Join(errs...))
	}
	return nil
}

// bootEpochs converts validated kvflow_boot_epochs (none negative); nil
// stays nil (no epochs: nothing compared).
func bootEpochs(in []int64) []uint64 {
	if len(in) == 0 {
		return nil
	}
	out := make([]uint64, len(in))
	for i, e := range in {
		out[i] = uint64(e)
	}
	return out
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
// cancels the rest, which end as failed ("canceled"). Then the stages
// close, last first: notify sends the DONEs owed by requests canceled
// before it, and the plan stage stops its fetches and lease renewals
// (renewed while requests drained).
func (w *Worker) Close(ctx context.Context) error {
	err := w.p.Close(ctx)
	w.hooks.close(ctx)
	return err
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
	w.hooks.end(r)
	w.mu.Lock()
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
