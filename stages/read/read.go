package read

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

// ErrShortfall marks a batch whose ledger shows fewer bytes than posted.
var ErrShortfall = errors.New("read: byte ledger shortfall")

// ErrPeerNotKvflow marks a task of a kvflow-only plan (decode TP > prefill
// TP, or decode PP > 1: plan.Plan.KvflowOnly) whose remote rank's
// metadata carries no kvflow extension (no boot epoch): a seed or Mooncake
// peer, which would not wait for this topology's DONEs (it frees on the
// first, or never). The task is refused before any read.
var ErrPeerNotKvflow = errors.New("read: peer is not kvflow and cannot serve this topology")

// Invalidator drops cached metadata of task i of j (the handshake cache).
type Invalidator func(j *job.Job, task int)

// Options configures the stage.
type Options struct {
	// Layout is the cache layout (block length per part, parts per layer)
	// shared by both sides.
	Layout plan.CacheLayout
	// Local is this worker's caches (base addresses in seed order, block
	// count).
	Local plan.Caches
	// PerSession bounds concurrent batches against one remote session.
	// 4: enough to keep a TCP peer's lanes busy; the rest of the read
	// workers stay free for other peers.
	PerSession int
	// SmallBatch: batches of at most this many bytes skip the per-session
	// limit, so a short request is not queued behind the long requests
	// holding every slot (the transfer engine interleaves batches on its
	// lanes). 0 = 4 MiB: one or two blocks of a Llama-8B-like rank.
	SmallBatch uint64
	// Timeout bounds one task's batch, from the wait for its session's
	// slot to the last byte; 0 = none beyond the engine's I/O timeout.
	Timeout    time.Duration
	Invalidate Invalidator
	// Refetch, with a Transfer that classifies failures, turns on the
	// retry of a read that failed because its peer may have restarted:
	// the task's metadata is re-fetched through it and, when retryVerdict
	// allows, the task is read once more (see retry.go). Nil: a failed
	// read fails the job, and Invalidate drops the metadata for the next.
	Refetch Refetcher
	// RefetchTimeout bounds how long a read worker waits for that
	// re-fetch (the fetch itself, shared with others, runs on to the
	// handshake timeout). 0 = 500 ms: a restarted peer's side channel
	// answers in well under a millisecond once the client has reconnected
	// (ZMQ retries every 100 ms), while a peer that is gone for good must
	// not hold read workers, which reads from live peers wait for, for a
	// whole handshake timeout (3 × 1 s by default).
	RefetchTimeout time.Duration
	// BeforeRetry, if set, may refuse a retry (returning why) just before
	// it starts, with j.Metas[task] already the re-fetched metadata: the
	// request's deadline. The stage's own Guard checks after it.
	BeforeRetry func(j *job.Job, task int) error
	// Guard, if it checks anything, is the stale-read guard around every
	// read and before every retry (stale.go).
	Guard *Guard
	// GrantWait: a batch the peer refused (Failure.Refused) is read
	// again, whole, with backoff, until GrantWait after the job's
	// admission, when no op of it landed or when refusals were all that
	// failed (Failure.RefusedOnly: the grant arrived while the batch was
	// in flight, so some ops landed and the rest were refused). A prefill
	// with read grants serves a request's blocks only once its engine's
	// send has reached it, which can come a scheduler step after the
	// router handed the request to this decode. 0 = 1 s (tens of engine
	// steps); negative: no wait. A request whose blocks were freed fails
	// that much later.
	GrantWait time.Duration
	// BlockSize is the tokens per block (block_size). With a transfer
	// that has LocalStride and P > 1 the stage reads every block straight
	// into its stitched layout and marks the job Stitched; 0, NoFuse, or a
	// layout that does not split into P equal token slices read as the
	// seed does and leave the transpose to the stitch stage.
	BlockSize  int
	NoFuse     bool
	Registerer prometheus.Registerer
}

// Stage is the read stage.
type Stage struct {
	t    Transfer
	caps Capabilities // t's, read once in New
	opts Options
	m    *metrics

	mu   sync.Mutex
	sems map[string]chan struct{}
}

// metrics are the read stage's.
type metrics struct {
	bytes, ops, failures prometheus.Counter
	shortfalls           prometheus.Counter
	fused                prometheus.Counter
	waiting              prometheus.Gauge
	retries              *prometheus.CounterVec
	grantWaits           prometheus.Counter
	// The stale-read guard's (stale.go); their names predate the guard's
	// move from the decode role into this stage.
	staleRefused, leaseLost prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{}
	m.bytes = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvflow_read_bytes_total", Help: "Bytes read from prefill ranks (successful batches)."})
	m.ops = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvflow_read_ops_total", Help: "Transfer ops posted (successful batches)."})
	m.failures = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvflow_read_batch_failures_total", Help: "Batches that failed."})
	m.shortfalls = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvflow_read_ledger_shortfalls_total", Help: "Batches that reported success but whose byte ledger showed ops not fully landed (the job fails)."})
	m.fused = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvflow_read_fused_stitch_jobs_total", Help: "Jobs whose blocks were read straight into their stitched layout (head transpose fused into the read; the stitch stage skips them)."})
	m.waiting = prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvflow_read_session_waiting", Help: "Batches waiting for their session's concurrency limit."})
	m.retries = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvflow_read_retries_total",
		Help: "Failed reads after which the peer's metadata was re-fetched, by result: done (read again and landed), failed (read again and failed), refused (not read again: the peer restarted after the request, part of the batch had landed, the failure was not a lost connection, or the request's deadline had passed), refetch_failed."},
		[]string{"result"})
	for _, r := range []string{"done", "failed", "refused", "refetch_failed"} {
		m.retries.WithLabelValues(r)
	}
	m.grantWaits = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvflow_read_grant_waits_total",
		Help: "Batches read again after the peer refused them (before any byte landed, or with refusals all that failed), within read GrantWait of admission (the prefill's grant for the request may not have arrived yet)."})
	m.staleRefused = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_decode_stale_reads_refused_total",
		Help: "Requests failed instead of read because their read would start past the prefill's abort timeout at a rank without a lease (blocks may have been freed).",
	})
	m.leaseLost = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_decode_lease_lost_reads_total",
		Help: "Requests failed instead of read, or after their read, because no RENEW of theirs at a leased prefill rank was acknowledged within the lease TTL less a margin (the prefill may have freed the blocks).",
	})
	if reg != nil {
		for _, c := range []prometheus.Collector{m.bytes, m.ops, m.failures, m.shortfalls, m.fused, m.waiting, m.retries, m.grantWaits, m.staleRefused, m.leaseLost} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("read: register metrics: %w", err)
			}
		}
	}
	return m, nil
}

// build makes the stage from its full set of options (New builds
// them from a Config and Deps; the tests set the rest).
func build(t Transfer, opts Options) (*Stage, error) {
	if t == nil {
		return nil, errors.New("read: nil transfer")
	}
	if err := opts.Layout.Validate(); err != nil {
		return nil, fmt.Errorf("read: layout: %w", err)
	}
	if opts.PerSession <= 0 {
		opts.PerSession = 4
	}
	if opts.SmallBatch == 0 {
		opts.SmallBatch = 4 << 20
	}
	if opts.Layout.BlockSize == 0 {
		// Head-split tasks (decode TP > prefill TP) read token rows.
		opts.Layout.BlockSize = opts.BlockSize
	}
	if opts.RefetchTimeout <= 0 {
		opts.RefetchTimeout = 500 * time.Millisecond
	}
	if opts.GrantWait == 0 {
		opts.GrantWait = time.Second
	}
	m, err := newMetrics(opts.Registerer)
	if err != nil {
		return nil, err
	}
	if !opts.Guard.on() {
		opts.Guard = nil
	}
	s := &Stage{t: t, caps: t.Capabilities(), opts: opts, m: m, sems: map[string]chan struct{}{}}
	return s, nil
}

func (s *Stage) sem(session string) chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.sems[session]
	if !ok {
		c = make(chan struct{}, s.opts.PerSession)
		s.sems[session] = c
	}
	return c
}

// Process reads every task of j; it fails on the first failed task and
// cancels the others. With a Guard it refuses a stale read before any
// task starts, and fails one whose leases ran out while it read.
func (s *Stage) Process(ctx context.Context, j *job.Job) error {
	if s.opts.Guard != nil {
		if err := s.checkStale(j, "started"); err != nil {
			return err
		}
		if err := s.process(ctx, j); err != nil {
			return err
		}
		// The bytes came from blocks the prefill held throughout only if
		// the leases still hold.
		return s.checkStale(j, "ended")
	}
	return s.process(ctx, j)
}

func (s *Stage) process(ctx context.Context, j *job.Job) error {
	ctx, stop := j.Context(ctx)
	defer stop()
	// Fused or not is decided once per job: every task of it must land
	// its slices the same way for the blocks to come out right.
	j.Stitched = s.fuses(j.Plan)
	if j.Stitched {
		s.m.fused.Inc()
	}
	g, gctx := errgroup.WithContext(ctx)
	for i := range j.Plan.Tasks {
		// A task's failure is blamed on its rank only (peer health); the
		// endpoint string is built only then, not per task read.
		g.Go(func() error {
			if err := s.task(gctx, j, i); err != nil {
				return job.AtPeer(job.HopRead, j.HandshakeEndpoint(i), err)
			}
			return nil
		})
	}
	return g.Wait()
}

// fuses reports whether pl's reads land stitched (the head transpose fused
// into them).
func (s *Stage) fuses(pl plan.Plan) bool {
	if s.opts.NoFuse || !pl.Stitch || pl.P < 2 {
		return false
	}
	if !s.caps.LocalStride {
		return false
	}
	return plan.CanInterleave(s.opts.Layout.BlockLen, s.opts.BlockSize, pl.P) == nil
}

// readsPool holds the per-task compact reads (their run storage is reused).
var readsPool = sync.Pool{New: func() any { return new(plan.Reads) }}

func (s *Stage) task(ctx context.Context, j *job.Job, i int) error {
	if s.opts.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, s.opts.Timeout, fmt.Errorf("read: task %d exceeded read.timeout %v", i, s.opts.Timeout))
		defer cancel()
	}
	err, batchErr := s.attempt(ctx, j, i)
	if batchErr == nil || ctx.Err() != nil {
		return err
	}
	if s.caps.Classify == nil {
		s.invalidate(j, i)
		return err
	}
	f := s.caps.Classify(batchErr)
	for backoff := 2 * time.Millisecond; grantRace(f); backoff = min(2*backoff, 100*time.Millisecond) {
		// The peer may not have had its grant when it checked the refused
		// ops. The whole task is read again: the ops that landed are the
		// granted request's own blocks, which the prefill does not change
		// until our DONE, into this job's own local blocks, which nothing
		// reads before the job ends; so reading them again writes the
		// same bytes.
		if time.Since(j.Submitted)+backoff > s.opts.GrantWait {
			break
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
		s.m.grantWaits.Inc()
		if err, batchErr = s.attempt(ctx, j, i); batchErr == nil || ctx.Err() != nil {
			return err
		}
		f = s.caps.Classify(batchErr)
	}
	if s.opts.Refetch == nil {
		s.invalidate(j, i)
		return err
	}
	return s.recover(ctx, j, i, err, f)
}

// grantRace reports whether a failed batch may have met a prefill whose
// grant for the request had not arrived yet: refused with no op landed
// (as before a grant), or with some ops landed and nothing but refusals
// among the rest (the grant arrived while the batch was in flight). Any
// other failure is not read again here.
func grantRace(f Failure) bool {
	return f.Refused && (!f.Moved || f.RefusedOnly)
}

// recover handles task i's failed batch (err; f, how it failed): it
// re-fetches the rank's metadata (shared with every read that failed on
// the same metadata) and, when retryVerdict and Options.BeforeRetry allow,
// reads once more with it.
func (s *Stage) recover(ctx context.Context, j *job.Job, i int, err error, f Failure) error {
	if f.Moved { // the peer was there: no restart lost this read; not retried
		s.invalidate(j, i)
		s.m.retries.WithLabelValues("refused").Inc()
		return err
	}
	used := j.Metas[i]
	rctx, cancel := context.WithTimeoutCause(ctx, s.opts.RefetchTimeout, fmt.Errorf("read: re-fetch exceeded %v", s.opts.RefetchTimeout))
	fresh, ferr := s.opts.Refetch(rctx, j, i, used, time.Now())
	cancel()
	if ferr != nil {
		s.m.retries.WithLabelValues("refetch_failed").Inc()
		return fmt.Errorf("%w; re-fetching the peer's metadata: %w", err, ferr)
	}
	// The rank's metadata as it is now: what notify's DONE must follow too.
	j.Metas[i] = fresh
	v := retryVerdict(f, used, fresh, j.Submitted)
	if v == nil {
		v = j.CheckBootEpoch(i, fresh) // restarted since the hand-over: not read again
	}
	if v == nil && s.opts.BeforeRetry != nil {
		v = s.opts.BeforeRetry(j, i)
	}
	if v == nil && s.opts.Guard != nil {
		v = s.checkTask(j, i)
	}
	if v != nil {
		s.m.retries.WithLabelValues("refused").Inc()
		if errors.Is(v, ErrPeerRestarted) || errors.Is(v, job.ErrBootEpoch) {
			return fmt.Errorf("%w; %w", v, err)
		}
		return fmt.Errorf("%w; not read again: %w", err, v)
	}
	if err2, _ := s.attempt(ctx, j, i); err2 != nil {
		s.m.retries.WithLabelValues("failed").Inc()
		if ctx.Err() == nil {
			s.invalidate(j, i)
		}
		return fmt.Errorf("%w; retried once with the peer's re-fetched metadata (boot epoch %d → %d): %w", err, used.BootEpoch, fresh.BootEpoch, err2)
	}
	s.m.retries.WithLabelValues("done").Inc()
	return nil
}

func (s *Stage) invalidate(j *job.Job, i int) {
	if s.opts.Invalidate != nil {
		s.opts.Invalidate(j, i)
	}
}

// attempt reads task i of j with j.Metas[i] once. batchErr is the
// transfer's own error when the batch itself failed (nil for a failure
// before it, or success).
func (s *Stage) attempt(ctx context.Context, j *job.Job, i int) (err, batchErr error) {
	t := j.Plan.Tasks[i]
	m := j.Metas[i]
	if err := bootedAfter(m, j.Submitted); err != nil {
		return fmt.Errorf("read task %d (rank %d): %w", i, t.RemoteRank, err), nil
	}
	// The rank restarted since it handed the request over (its boot
	// epoch is not the one kv_transfer_params name): its blocks are gone.
	if err := j.CheckBootEpoch(i, m); err != nil {
		return fmt.Errorf("read task %d (rank %d): %w", i, t.RemoteRank, err), nil
	}
	if j.Plan.KvflowOnly && m.BootEpoch == 0 {
		return fmt.Errorf("read task %d (rank %d, engine %q): %w (decode tp > prefill tp or decode pp > 1 needs a kvflow prefill instance)", i, t.RemoteRank, m.EngineID, ErrPeerNotKvflow), nil
	}
	rd := readsPool.Get().(*plan.Reads)
	defer func() {
		rd.Reset() // drop the references to the job's lists
		readsPool.Put(rd)
	}()
	if err := rd.Build(s.opts.Layout, t, s.opts.Local, plan.Caches{Base: m.BaseAddrs, NumBlocks: m.NumBlocks}); err != nil {
		// The remote metadata may be what is wrong (a restarted peer with
		// fewer blocks or other caches): drop it so the next job re-fetches
		// instead of failing on the cached copy for ever.
		s.invalidate(j, i)
		return fmt.Errorf("read task %d (rank %d): %w", i, t.RemoteRank, err), nil
	}
	nops := rd.Len()
	if nops == 0 {
		return nil, nil
	}
	session := j.Session(i)
	n := rd.Bytes()
	if n > s.opts.SmallBatch {
		sem := s.sem(session)
		select {
		case sem <- struct{}{}:
		default:
			s.m.waiting.Inc()
			select {
			case sem <- struct{}{}:
				s.m.waiting.Dec()
			case <-ctx.Done():
				s.m.waiting.Dec()
				return fmt.Errorf("read task %d session %s: %w", i, session, context.Cause(ctx)), nil
			}
		}
		defer func() { <-sem }()
	}
	// A head-split task's rows go as a few strided reads when the
	// transfer can gather them (the TCP engine: one request per run of
	// blocks and up to 4 MiB, answered contiguously); else one op each.
	gather := t.HeadSplit > 1 && s.caps.Gather && rd.GatherLen() > 0
	if chunks := headSliceChunks(t, nops); len(chunks) > 1 && !gather {
		// A head-split task reads one op per token row: posted whole, a
		// long request's op list would take tens of MiB. Read it a few
		// layers at a time (the same ops, in order; the task still
		// succeeds or fails as one).
		remote := plan.Caches{Base: m.BaseAddrs, NumBlocks: m.NumBlocks}
		for _, c := range chunks {
			if err := rd.Build(s.opts.Layout, c, s.opts.Local, remote); err != nil {
				return fmt.Errorf("read task %d (rank %d) layers [%d, %d): %w", i, t.RemoteRank, c.LayerStart, c.LayerEnd, err), nil
			}
			if err := s.batch(ctx, session, j.Req.ID, rd, false, false); err != nil {
				s.m.failures.Inc()
				return fmt.Errorf("read task %d (rank %d) session %s, layers [%d, %d), %d ops: %w", i, t.RemoteRank, session, c.LayerStart, c.LayerEnd, rd.Len(), err), err
			}
		}
	} else if err := s.batch(ctx, session, j.Req.ID, rd, j.Stitched, gather); err != nil {
		s.m.failures.Inc()
		return fmt.Errorf("read task %d (rank %d) session %s, %d ops: %w", i, t.RemoteRank, session, nops, err), err
	}
	if gather {
		nops = rd.GatherLen() // the ops posted
	}
	j.BytesRead.Add(n)
	j.OpsRead.Add(uint64(nops))
	s.m.bytes.Add(float64(n))
	s.m.ops.Add(float64(nops))
	return nil, nil
}

// maxHeadSliceOps bounds the ops of one batch of a head-split task: 64Ki
// ops (1.5 MiB of engine ops) is what a P = 4 seed task of 64 layers and
// 128 blocks posts at once, while the same request read as head slices is
// block_size (128) times as many.
const maxHeadSliceOps = 1 << 16

// headSliceChunks splits head-split task t, whose reads are nops ops, into
// layer ranges of at most maxHeadSliceOps ops each (at least one layer
// each); any other task, or one small enough, is returned whole.
func headSliceChunks(t plan.Task, nops int) []plan.Task {
	layers := t.LayerEnd - t.LayerStart
	if t.HeadSplit <= 1 || nops <= maxHeadSliceOps || layers < 2 {
		return []plan.Task{t}
	}
	per := max(1, maxHeadSliceOps/(nops/layers))
	if t.RemoteLayers == 0 {
		t.RemoteLayers = layers // the task covers its remote stage
	}
	var out []plan.Task
	for lo := t.LayerStart; lo < t.LayerEnd; lo += per {
		c := t
		c.LayerStart, c.LayerEnd = lo, min(lo+per, t.LayerEnd)
		c.RemoteLayerSkip = t.RemoteLayerSkip + lo - t.LayerStart
		out = append(out, c)
	}
	return out
}

// batch runs rd's ops as one batch of the transfer: interleaved into
// strided local rows when fused, in their strided remote form when
// gather, plainly otherwise. With a ledger (Capabilities.Ledger; plain
// reads only) it reconciles what landed with the manifest (rd) and turns
// any shortfall into an error naming the first short op.
func (s *Stage) batch(ctx context.Context, session, req string, rd *plan.Reads, fused, gather bool) error {
	b := Batch{Reads: rd, Gather: gather, Request: req}
	if fused {
		row, pitch, err := rd.Interleave(s.opts.BlockSize)
		if err != nil { // fuses checked the layout: not reached
			return err
		}
		b.Row, b.Pitch = row, pitch
		return s.t.BatchRead(ctx, session, &b)
	}
	if gather || !s.caps.Ledger {
		return s.t.BatchRead(ctx, session, &b)
	}
	landed := make([]uint64, rd.Len())
	b.Landed = landed
	if err := s.t.BatchRead(ctx, session, &b); err != nil {
		return err
	}
	short, missing := 0, uint64(0)
	first := -1
	i := 0
	for k := range rd.Tensors() {
		tr := rd.Tensor(k)
		for r := range rd.Runs() {
			n := tr.Len * uint64(rd.Run(r).Blocks) // op i's length
			if landed[i] != n {
				short++
				if landed[i] < n {
					missing += n - landed[i]
				}
				if first < 0 {
					first = i
				}
			}
			i++
		}
	}
	if short == 0 {
		return nil
	}
	s.m.shortfalls.Inc()
	op := rd.At(first)
	return fmt.Errorf("%w: %d of %d ops incomplete, %d bytes missing; first: op %d local %#x remote %#x landed %d of %d bytes",
		ErrShortfall, short, rd.Len(), missing, first, op.Local, op.Remote, landed[first], op.Len)
}
