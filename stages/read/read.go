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

// Transfer runs one all-or-nothing batch of reads from session
// "host:rpc_port" into local memory.
type Transfer interface {
	BatchRead(ctx context.Context, session string, ops []plan.Op) error
}

// LedgerTransfer is a Transfer that also reports, per op, the bytes that
// landed in local memory (Mooncake's transferred_bytes; the TCP engine's
// received byte counts). The read stage reconciles that ledger with the
// manifest it posted and fails the job on any shortfall, even when the
// batch itself reported success.
type LedgerTransfer interface {
	Transfer
	// BatchReadLedger is BatchRead that sets landed[i] to the bytes of
	// ops[i] that reached local memory; len(landed) == len(ops).
	BatchReadLedger(ctx context.Context, session string, ops []plan.Op, landed []uint64) error
}

// ErrShortfall marks a batch whose ledger shows fewer bytes than posted.
var ErrShortfall = errors.New("read: byte ledger shortfall")

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
	Registerer prometheus.Registerer
}

// Stage is the read stage.
type Stage struct {
	t    Transfer
	opts Options

	mu   sync.Mutex
	sems map[string]chan struct{}

	bytes, ops, failures prometheus.Counter
	shortfalls           prometheus.Counter
	waiting              prometheus.Gauge
}

// New makes the stage.
func New(t Transfer, opts Options) (*Stage, error) {
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
	s := &Stage{t: t, opts: opts, sems: map[string]chan struct{}{}}
	s.bytes = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvflow_read_bytes_total", Help: "Bytes read from prefill ranks (successful batches)."})
	s.ops = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvflow_read_ops_total", Help: "Transfer ops posted (successful batches)."})
	s.failures = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvflow_read_batch_failures_total", Help: "Batches that failed."})
	s.shortfalls = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvflow_read_ledger_shortfalls_total", Help: "Batches that reported success but whose byte ledger showed ops not fully landed (the job fails)."})
	s.waiting = prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvflow_read_session_waiting", Help: "Batches waiting for their session's concurrency limit."})
	if opts.Registerer != nil {
		for _, c := range []prometheus.Collector{s.bytes, s.ops, s.failures, s.shortfalls, s.waiting} {
			if err := opts.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("read: register metrics: %w", err)
			}
		}
	}
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
// cancels the others.
func (s *Stage) Process(ctx context.Context, j *job.Job) error {
	ctx, stop := j.Context(ctx)
	defer stop()
	g, gctx := errgroup.WithContext(ctx)
	for i := range j.Plan.Tasks {
		g.Go(func() error { return s.task(gctx, j, i) })
	}
	return g.Wait()
}

func (s *Stage) task(ctx context.Context, j *job.Job, i int) error {
	t := j.Plan.Tasks[i]
	m := j.Metas[i]
	ops, err := plan.Ops(s.opts.Layout, t, s.opts.Local, plan.Caches{Base: m.BaseAddrs, NumBlocks: m.NumBlocks})
	if err != nil {
		// The remote metadata may be what is wrong (a restarted peer with
		// fewer blocks or other caches): drop it so the next job re-fetches
		// instead of failing on the cached copy for ever.
		if s.opts.Invalidate != nil {
			s.opts.Invalidate(j, i)
		}
		return fmt.Errorf("read task %d (rank %d): %w", i, t.RemoteRank, err)
	}
	if len(ops) == 0 {
		return nil
	}
	session := j.Session(i)
	if s.opts.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, s.opts.Timeout, fmt.Errorf("read: task %d exceeded read.timeout %v", i, s.opts.Timeout))
		defer cancel()
	}
	var n uint64
	for _, op := range ops {
		n += op.Len
	}
	if n > s.opts.SmallBatch {
		sem := s.sem(session)
		select {
		case sem <- struct{}{}:
		default:
			s.waiting.Inc()
			select {
			case sem <- struct{}{}:
				s.waiting.Dec()
			case <-ctx.Done():
				s.waiting.Dec()
				return fmt.Errorf("read task %d session %s: %w", i, session, context.Cause(ctx))
			}
		}
		defer func() { <-sem }()
	}
	if err := s.batch(ctx, session, ops); err != nil {
		s.failures.Inc()
		if s.opts.Invalidate != nil && ctx.Err() == nil {
			s.opts.Invalidate(j, i)
		}
		return fmt.Errorf("read task %d (rank %d) session %s, %d ops: %w", i, t.RemoteRank, session, len(ops), err)
	}
	j.BytesRead.Add(n)
	j.OpsRead.Add(uint64(len(ops)))
	s.bytes.Add(float64(n))
	s.ops.Add(float64(len(ops)))
	return nil
}

// batch runs ops; with a LedgerTransfer it reconciles what landed with the
// manifest (ops) and turns any shortfall into an error naming the first
// short op.
func (s *Stage) batch(ctx context.Context, session string, ops []plan.Op) error {
	lt, ok := s.t.(LedgerTransfer)
	if !ok {
		return s.t.BatchRead(ctx, session, ops)
	}
	landed := make([]uint64, len(ops))
	if err := lt.BatchReadLedger(ctx, session, ops, landed); err != nil {
		return err
	}
	short, missing := 0, uint64(0)
	first := -1
	for i, op := range ops {
		if landed[i] != op.Len {
			short++
			if landed[i] < op.Len {
				missing += op.Len - landed[i]
			}
			if first < 0 {
				first = i
			}
		}
	}
	if short == 0 {
		return nil
	}
	s.shortfalls.Inc()
	op := ops[first]
	return fmt.Errorf("%w: %d of %d ops incomplete, %d bytes missing; first: op %d local %#x remote %#x landed %d of %d bytes",
		ErrShortfall, short, len(ops), missing, first, op.Local, op.Remote, landed[first], op.Len)
}
