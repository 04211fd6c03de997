package pipeline

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sourcegraph/conc"
)

// Errors returned by the intake.
var (
	// ErrClosed is returned by Submit and TrySubmit once Close has begun.
	ErrClosed = errors.New("pipeline: closed")
	// ErrFull is returned by TrySubmit when the first stage's queue is full.
	ErrFull = errors.New("pipeline: queue full")
	// ErrCanceled is the cause of items that ended because the pipeline was
	// canceled (Close deadline passed) before they could finish.
	ErrCanceled = errors.New("pipeline: canceled")
)

// Stage processes one item. It may mutate the item (items are usually
// pointers). A non-nil error fails the item: it then skips every later stage
// that has not declared SeesFailed.
type Stage[T any] interface {
	Process(ctx context.Context, item T) error
}

// StageFunc adapts a function to Stage.
type StageFunc[T any] func(ctx context.Context, item T) error

// Process calls f(ctx, item).
func (f StageFunc[T]) Process(ctx context.Context, item T) error { return f(ctx, item) }

// FailureAware is implemented by stages that want to treat failed items
// differently from healthy ones. When a stage with SeesFailed set receives a
// failed item it calls ProcessFailed if the stage implements it, Process
// otherwise. An error it returns is joined to the item's cause.
type FailureAware[T any] interface {
	ProcessFailed(ctx context.Context, item T, cause error) error
}

// StageConfig describes one stage of the chain.
type StageConfig[T any] struct {
	// Name labels the stage's metrics and errors; unique within a pipeline.
	Name string
	// Workers is the number of goroutines running Process concurrently.
	Workers int
	// Capacity is the size of the bounded queue in front of the stage.
	Capacity int
	// Stage is the processing function.
	Stage Stage[T]
	// SeesFailed makes failed items visit this stage too (kvflow's notify
	// stage must tell the remote side to free blocks even after a failure).
	SeesFailed bool

	// Key, if set, makes the stage keyed: each item waits in its key's
	// FIFO, at most KeyWorkers items of one key are processed at once, and
	// workers take the next runnable key in turn (round robin), so a key
	// whose items are slow (a wedged peer) holds at most KeyWorkers
	// workers and KeyQueue places in the queue, and the others go on.
	// Capacity still bounds the items waiting in the stage, all keys
	// together (parked ones aside, see KeyPark): a send blocks while it
	// is full, as for an unkeyed stage.
	// Key must be cheap and must not block; it is called once per item,
	// as the item is handed to the stage.
	Key func(T) string
	// KeyWorkers bounds the items of one key in Process at once; 0 means
	// Workers (no bound beyond the stage's).
	KeyWorkers int
	// KeyQueue bounds the items of one key waiting in the stage within
	// Capacity; 0 means Capacity. A send beyond it parks the item (see
	// KeyPark): the sender goes on at once, so a slow key never holds the
	// stage before it. Only when the park budget is spent does the send
	// block until one of the key's items is taken, or is refused when the
	// key is stalled (KeyStall).
	KeyQueue int
	// KeyPark bounds the parked items, all keys together: items that wait
	// beyond their key's KeyQueue and outside Capacity. 0 means Capacity;
	// -1 means none (a send beyond KeyQueue blocks at once).
	KeyPark int
	// KeyStall bounds how long a key may have items in Process none of
	// which ended without error (since the key turned busy or its last
	// such end) before it is stalled; the key is stalled sooner, after
	// KeyStallFactor times its recent service time (never under
	// MinKeyStall). A send that would exceed a stalled key's KeyQueue
	// when the park budget is spent is refused at once with
	// ErrKeyStalled (the item fails at this stage) instead of holding its
	// sender. 0: never refused, the send blocks.
	KeyStall time.Duration
	// MaxKeys bounds the distinct keys with items waiting or in Process;
	// an item with a new key beyond is refused with ErrTooManyKeys.
	// 0 means DefaultMaxKeys.
	MaxKeys int
}

// Outcome is how an item ended.
type Outcome int

// Outcomes.
const (
	Done Outcome = iota
	Failed
	Canceled
)

func (o Outcome) String() string {
	switch o {
	case Done:
		return "done"
	case Failed:
		return "failed"
	case Canceled:
		return "canceled"
	}
	return fmt.Sprintf("outcome(%d)", int(o))
}

// Result is what the sink receives, exactly once per accepted item.
type Result[T any] struct {
	Item    T
	Outcome Outcome
	// Err is nil for Done; the item's cause otherwise (errors.Is(Err,
	// ErrCanceled) for Canceled). Errors from several stages are joined.
	Err error
	// Stage is the name of the stage where the item first failed or was
	// canceled; empty for Done.
	Stage string
}

// Config is a whole pipeline.
type Config[T any] struct {
	Stages []StageConfig[T]
	// Sink receives every accepted item exactly once. It is called from
	// worker goroutines (possibly concurrently) and must not block for long.
	Sink func(Result[T])
	// Registerer receives the pipeline's metrics; nil means no metrics.
	Registerer prometheus.Registerer
	// Logger; nil means discard.
	Logger *slog.Logger
}

// envelope travels through the queues by value: no allocation per item.
type envelope[T any] struct {
	item  T
	fail  *failure // nil while the item is healthy
	start int64    // nanotime at acceptance; 0 when its latency is not sampled
}

// failure is an item's cause and the stage where it first failed; it is
// allocated only for items that fail.
type failure struct {
	err   error
	stage string
}

type stage[T any] struct {
	cfg     StageConfig[T]
	process func(context.Context, T) error        // cfg.Stage.Process
	failed  func(context.Context, T, error) error // its ProcessFailed; nil if none
	idx     int
	next    *stage[T]        // the stage after this one; nil for the last
	queue   chan envelope[T] // nil for a keyed stage
	keyed   *keyed[T]        // nil for an unkeyed stage
	m       stageMetrics
	workers []worker
}

// Timing: every item of a stage is timed when the stage is not saturated
// (its worker waited for the item: low traffic is always measured, so the
// histograms are never empty while items are counted) and while the
// stage's recent items took at least timeAllAbove. Only items that a
// worker takes back to back (a saturated stage) and that are faster than
// that are sampled, one in timeEvery: there the clock reads and histogram
// update would cost more than the work itself (kvflow_stage_items_total
// still counts every item).
// kvflow's real stages (handshake misses, reads, DONE/ACK) take far longer
// and are always timed. Likewise the end-to-end latency
// (kvflow_pipeline_item_duration_seconds) is measured on every item while
// recent items took at least latencyAllAbove from acceptance to the sink,
// and on the first item accepted after a first-stage worker waited for
// work (not saturated); on one item in timeEvery otherwise
// (kvflow_pipeline_items_total still counts every item). A timed item costs two clock reads (about 35 ns each
// on the virtual machines measured) and a histogram update, about 100 ns
// in all: at one in 16 that was a fifth of a no-op chain's per-item cost,
// at one in 64 it is a twentieth, and 64 samples of items that take under
// 20 µs still come every 1.3 ms or sooner.
const (
	timeAllAbove    = 20 * time.Microsecond
	latencyAllAbove = time.Millisecond
	timeEvery       = 64
)

// worker is one worker goroutine's state. Only that goroutine writes it;
// scrapes and Close read the published atomics. It fills two cache lines
// so that workers do not share one.
//
// The worker keeps its counts in plain fields and publishes them (an
// atomic store costs as much as the rest of a no-op stage's bookkeeping)
// only when something may be watching for them:
//   - whenever it is about to wait: for the next item, for room downstream,
//     or, after Close began, for nothing (see end), so they are exact
//     whenever the worker is idle or blocked, and so whenever the pipeline
//     is idle or closed;
//   - when it starts an item after having published itself not busy;
//   - and otherwise at least every publishEvery items while it runs items
//     back to back without waiting.
//
// So under sustained load the published ok and done counts (and with them
// kvflow_stage_items_total{outcome="ok"}, kvflow_pipeline_items_total
// {outcome="done"} and kvflow_pipeline_in_flight) may lag the true ones by
// at most publishEvery items per worker, and a worker that runs back to
// back reads busy throughout, including while it passes a finished item on
// (a send to a queue with room, or the sink) or ends canceled items. Close
// does not depend on the lag: after Close began a worker publishes every
// item it ends as Done, and it publishes before it waits.
type worker struct {
	state atomic.Uint64  // published ok<<1 | busy
	done  atomic.Int64   // published done
	ok    uint64         // items this worker's stage function returned nil for
	ended int64          // items this worker handed to the sink as Done
	fast  bool           // the last timed item took less than timeAllAbove
	busy  bool           // the published state says busy
	burst bool           // the last item was taken without waiting
	skip  int            // items until the next timed one, while fast
	lag   int            // items started since the last publish
	_     [128 - 56]byte // fast, busy and burst share a word
}

// publishEvery bounds how many items a worker running back to back may
// start without publishing its counts (see worker). It makes the cost of
// the atomic store negligible next to the two channel operations per item.
const publishEvery = 32

// publish makes w's counts visible, busy or not.
func (p *Pipeline[T]) publish(w *worker, busy uint64) {
	w.state.Store(w.ok<<1 | busy)
	w.busy, w.lag = busy != 0, 0
	if w.ended != w.done.Load() {
		w.done.Store(w.ended)
		if p.closed.Load() {
			p.checkDrained()
		}
	}
}

// Pipeline is a running chain of stages. Create it with New; it is safe for
// concurrent use.
type Pipeline[T any] struct {
	stages []*stage[T]
	sink   func(Result[T])
	log    *slog.Logger
	m      *metrics

	closed    atomic.Bool
	canceled  atomic.Bool   // set with hardCancel; cheaper to poll than hardCtx.Err
	timeAll   atomic.Bool   // recent items took >= latencyAllAbove end to end
	quiet     atomic.Bool   // a first-stage worker waited for an item since the last timed intake
	closing   chan struct{} // closed when Close begins: stops blocked Submits
	drained   chan struct{} // closed when, after Close began, no item is in flight
	drainOnce sync.Once

	spacers    []chan envelope[T] // never used: see makeQueues
	hardCtx    context.Context    // canceled when Close's deadline passes
	hardCancel context.CancelFunc
	workers    conc.WaitGroup
	closeOnce  sync.Once
	closeErr   error

	// In flight = accepted - ended, where ended is the workers' done
	// counts plus failed and canceledN. accepted is written by the intake
	// only and sits on its own cache lines, away from the read-mostly
	// fields above that every worker reads per item.
	_         [128]byte
	accepted  atomic.Int64 // accepted minus backed out
	_         [128]byte
	failed    atomic.Int64 // items that reached the sink as Failed
	canceledN atomic.Int64 // ... as Canceled
}

// New validates cfg, registers the metrics and starts every stage's workers.
func New[T any](cfg Config[T]) (*Pipeline[T], error) {
	if err := validate(cfg); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	reg := cfg.Registerer
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	p := &Pipeline[T]{
		sink:    cfg.Sink,
		log:     log.With("component", "pipeline"),
		closing: make(chan struct{}),
		drained: make(chan struct{}),
	}
	p.quiet.Store(true) // idle: the first item is timed
	p.hardCtx, p.hardCancel = context.WithCancel(context.Background())
	m, err := newMetrics(reg, func() float64 { return float64(p.InFlight()) })
	if err != nil {
		p.hardCancel()
		return nil, err
	}
	p.m = m
	queues := p.makeQueues(cfg.Stages)
	for i, sc := range cfg.Stages {
		s := &stage[T]{cfg: sc, idx: i, queue: queues[i], workers: make([]worker, sc.Workers)}
		if sc.Key != nil {
			s.keyed = newKeyed(sc, m.keyWait.WithLabelValues(sc.Name))
		}
		// A StageFunc is called directly, not through the interface and
		// its Process wrapper.
		if f, ok := sc.Stage.(StageFunc[T]); ok {
			s.process = f
		} else {
			s.process = sc.Stage.Process
		}
		if fa, ok := sc.Stage.(FailureAware[T]); ok {
			s.failed = fa.ProcessFailed
		}
		depth := func() float64 { return float64(len(s.queue)) }
		var backlogged, parked func() float64
		if s.keyed != nil {
			depth = func() float64 { return float64(s.keyed.waiting.Load()) }
			backlogged = func() float64 { return float64(s.keyed.backlogged.Load()) }
			parked = func() float64 { return float64(s.keyed.parkedN.Load()) }
		}
		s.m = m.forStage(sc.Name, sc.Capacity, depth, backlogged, parked, s.workerStates)
		p.stages = append(p.stages, s)
	}
	for i, s := range p.stages[1:] {
		p.stages[i].next = s
	}
	m.scrape.results = p.results
	if err := reg.Register(m.scrape); err != nil {
		p.hardCancel()
		return nil, fmt.Errorf("pipeline: register metrics: %w", err)
	}
	for _, s := range p.stages {
		for i := range s.workers {
			w := &s.workers[i]
			if s.keyed != nil {
				p.workers.Go(func() { p.runKeyed(s, w) })
				continue
			}
			p.workers.Go(func() { p.run(s, w) })
		}
	}
	return p, nil
}

// makeQueues makes the stages' queues, one channel each, kept apart in
// memory. The runtime allocates the header of a channel whose elements
// hold pointers, as an envelope's always do, apart from its buffer, in a
// small slot of its own (112 bytes in Go 1.26), and headers allocated one
// after the other sit side by side. Two neighbouring queues then share a
// cache line holding the lock and counts that every send and receive
// writes, and the workers of three stages contend for it although each
// touches only its own queues (false sharing). A spare channel allocated
// between consecutive queues, and before the first and after the last,
// keeps every header off its neighbours' lines; the spares are kept in
// p.spacers so that no other, possibly hot, object takes their place.
// This relies on consecutive allocations of one size landing next to each
// other, as they do from a fresh span, and is harmless where they do not.
// On a 2-core machine it cut BenchmarkChain's time per item by over a
// tenth (1.37x to 1.19x the hand-written chain's, under SCHED_FIFO).
func (p *Pipeline[T]) makeQueues(stages []StageConfig[T]) []chan envelope[T] {
	queues := make([]chan envelope[T], len(stages))
	p.spacers = make([]chan envelope[T], 0, len(stages)+1)
	p.spacers = append(p.spacers, make(chan envelope[T], 1))
	for i, sc := range stages {
		if sc.Key != nil {
			continue // a keyed stage has no channel (see keyed)
		}
		queues[i] = make(chan envelope[T], sc.Capacity)
		p.spacers = append(p.spacers, make(chan envelope[T], 1))
	}
	return queues
}

// workerStates sums the stage's workers' ok counts and busy flags.
func (s *stage[T]) workerStates() (ok, busy uint64) {
	for i := range s.workers {
		st := s.workers[i].state.Load()
		ok += st >> 1
		busy += st & 1
	}
	return ok, busy
}

// results is the count of items that reached the sink, by outcome.
func (p *Pipeline[T]) results() (done, failed, canceled int64) {
	for _, s := range p.stages {
		for i := range s.workers {
			done += s.workers[i].done.Load()
		}
	}
	return done, p.failed.Load(), p.canceledN.Load()
}

func validate[T any](cfg Config[T]) error {
	var errs []error
	if len(cfg.Stages) == 0 {
		errs = append(errs, errors.New("pipeline: no stages"))
	}
	if cfg.Sink == nil {
		errs = append(errs, errors.New("pipeline: nil sink"))
	}
	seen := map[string]bool{}
	for i, s := range cfg.Stages {
		switch {
		case s.Name == "":
			errs = append(errs, fmt.Errorf("pipeline: stage %d: empty name", i))
		case seen[s.Name]:
			errs = append(errs, fmt.Errorf("pipeline: stage %d: duplicate name %q", i, s.Name))
		}
		seen[s.Name] = true
		if s.Workers <= 0 {
			errs = append(errs, fmt.Errorf("pipeline: stage %q: workers must be > 0, got %d", s.Name, s.Workers))
		}
		if s.Capacity <= 0 {
			errs = append(errs, fmt.Errorf("pipeline: stage %q: capacity must be > 0, got %d", s.Name, s.Capacity))
		}
		if s.Stage == nil || isNilFunc(s.Stage) {
			errs = append(errs, fmt.Errorf("pipeline: stage %q: nil stage", s.Name))
		}
		errs = append(errs, validateKey(s)...)
	}
	return errors.Join(errs...)
}

func validateKey[T any](s StageConfig[T]) []error {
	var errs []error
	if s.Key == nil {
		if s.KeyWorkers != 0 || s.KeyQueue != 0 || s.KeyStall != 0 || s.KeyPark != 0 || s.MaxKeys != 0 {
			errs = append(errs, fmt.Errorf("pipeline: stage %q: key_workers, key_queue, key_park, key_stall or max_keys set without a key", s.Name))
		}
		return errs
	}
	if s.KeyWorkers < 0 || s.KeyWorkers > s.Workers {
		errs = append(errs, fmt.Errorf("pipeline: stage %q: key workers must be 0 (all) or 1..%d (workers), got %d", s.Name, s.Workers, s.KeyWorkers))
	}
	if s.KeyQueue < 0 || (s.Capacity > 0 && s.KeyQueue > s.Capacity) {
		errs = append(errs, fmt.Errorf("pipeline: stage %q: key queue must be 0 (capacity) or 1..%d (capacity), got %d", s.Name, s.Capacity, s.KeyQueue))
	}
	if s.KeyPark < -1 {
		errs = append(errs, fmt.Errorf("pipeline: stage %q: key park must be -1 (none), 0 (capacity) or more, got %d", s.Name, s.KeyPark))
	}
	if s.KeyStall < 0 {
		errs = append(errs, fmt.Errorf("pipeline: stage %q: key stall must be >= 0, got %v", s.Name, s.KeyStall))
	}
	if s.MaxKeys < 0 {
		errs = append(errs, fmt.Errorf("pipeline: stage %q: max keys must be >= 0, got %d", s.Name, s.MaxKeys))
	}
	return errs
}

func isNilFunc[T any](s Stage[T]) bool {
	f, ok := s.(StageFunc[T])
	return ok && f == nil
}

// takeQuiet reports, once, that a first-stage worker had to wait for an
// item since it was last called: the pipeline is not saturated, so the
// item being accepted is timed end to end. Under load the workers rarely
// wait and the load is one atomic read.
func (p *Pipeline[T]) takeQuiet() bool {
	return p.quiet.Load() && p.quiet.Swap(false)
}

// Submit hands item to the first stage, blocking while its queue is full.
// The time spent blocked is counted. It returns ctx's error if ctx ends
// first, ErrClosed if Close has begun; in both cases the item was not
// accepted and will not reach the sink. A nil error means the item will
// reach the sink exactly once.
func (p *Pipeline[T]) Submit(ctx context.Context, item T) error {
	n, err := p.accept()
	if err != nil {
		return err
	}
	e := envelope[T]{item: item}
	if n%timeEvery == 0 || p.timeAll.Load() || p.takeQuiet() {
		e.start = nanotime()
	}
	first := p.stages[0]
	if first.keyed != nil {
		return p.submitKeyed(ctx, e, true)
	}
	select {
	case first.queue <- e:
		return nil
	default:
	}
	defer first.m.blocked.end(first.m.blocked.begin())
	select {
	case first.queue <- e:
		return nil
	case <-ctx.Done():
		p.unaccept()
		return fmt.Errorf("pipeline: submit: %w", ctx.Err())
	case <-p.closing:
		p.unaccept()
		return ErrClosed
	}
}

// TrySubmit hands item to the first stage without blocking. It returns
// ErrFull (and counts a rejection) when the queue is full, ErrClosed after
// Close; the item was then not accepted.
func (p *Pipeline[T]) TrySubmit(item T) error {
	n, err := p.accept()
	if err != nil {
		return err
	}
	e := envelope[T]{item: item}
	if n%timeEvery == 0 || p.timeAll.Load() || p.takeQuiet() {
		e.start = nanotime()
	}
	first := p.stages[0]
	if first.keyed != nil {
		return p.submitKeyed(nil, e, false)
	}
	select {
	case first.queue <- e:
		return nil
	default:
		p.unaccept()
		first.m.rejected.Inc()
		return ErrFull
	}
}

// accept counts an item in and returns the count. Intake and Close meet
// on atomics (no lock on the hot path): an item counted before Close saw
// the count is waited for; one counted after sees closed and backs out.
func (p *Pipeline[T]) accept() (int64, error) {
	if p.closed.Load() {
		return 0, ErrClosed
	}
	n := p.accepted.Add(1)
	if p.closed.Load() {
		p.unaccept()
		return 0, ErrClosed
	}
	return n, nil
}

func (p *Pipeline[T]) unaccept() {
	p.accepted.Add(-1)
	if p.closed.Load() {
		p.checkDrained()
	}
}

// checkDrained closes drained if no accepted item is in flight. Called
// after Close began, by Close and by whoever ends or backs out an item.
//
// The ended counts are read before accepted: each item counted ended was
// accepted earlier, so ended <= accepted, and equality means every item
// accepted so far has ended; an item accepted later sees closed and backs
// out. Whoever makes the last change sees final values, so one of them
// (or Close) sees equality.
func (p *Pipeline[T]) checkDrained() {
	d, f, c := p.results()
	if d+f+c == p.accepted.Load() {
		p.drainOnce.Do(func() { close(p.drained) })
	}
}

// InFlight is the number of accepted items that have not reached the sink.
func (p *Pipeline[T]) InFlight() int {
	d, f, c := p.results()
	return max(int(p.accepted.Load()-d-f-c), 0)
}

// Close stops intake, waits until every accepted item has reached the sink,
// and returns. If ctx ends first, it cancels the items still in the
// pipeline (they end as Canceled; stages see a canceled context), waits for
// them to reach the sink, and returns ctx's error. No goroutine started by
// the pipeline outlives Close. Close is idempotent.
func (p *Pipeline[T]) Close(ctx context.Context) error {
	p.closeOnce.Do(func() {
		p.closed.Store(true)
		close(p.closing)
		p.checkDrained()
		drained := p.drained
		select {
		case <-drained:
		case <-ctx.Done():
			p.log.Warn("pipeline drain deadline passed; canceling in-flight items",
				"in_flight", p.InFlight())
			p.closeErr = fmt.Errorf("pipeline: drain: %w", ctx.Err())
			p.canceled.Store(true)
			p.hardCancel()
			for _, s := range p.stages {
				if s.keyed != nil {
					s.keyed.wakeAll(false, true)
				}
			}
			<-drained
		}
		// Every accepted item has reached the sink and intake is closed, so
		// nothing can send on a queue any more: closing them is safe and
		// lets the workers return.
		for _, s := range p.stages {
			if s.keyed != nil {
				s.keyed.wakeAll(true, false)
				continue
			}
			close(s.queue)
		}
		p.workers.Wait()
		p.hardCancel()
	})
	return p.closeErr
}

func (p *Pipeline[T]) run(s *stage[T], w *worker) {
	defer p.publish(w, 0)
	for {
		e, t0, err, panicked := p.serve(s, w)
		if !panicked {
			return // the queue was closed
		}
		p.finish(s, w, e, t0, err)
	}
}

// serve runs w's loop over s's queue until the queue is closed, or until
// the stage function panics: serve then returns the item, its start time
// (0 if untimed) and the panic turned into an error, for run to finish the
// item and call serve again. Recovering here, once per panic, rather than
// in a deferred call per item keeps a defer off the per-item path; a panic
// anywhere else in the worker is not recovered (that would be a bug in the
// pipeline itself, and the sink has its own recover).
func (p *Pipeline[T]) serve(s *stage[T], w *worker) (e envelope[T], t0 int64, err error, panicked bool) {
	inStage := false
	defer func() {
		if !inStage {
			return
		}
		if r := recover(); r != nil {
			s.m.panics.Inc()
			p.log.Error("stage panicked", "stage", s.cfg.Name, "panic", r, "stack", string(debug.Stack()))
			err = fmt.Errorf("pipeline: stage %q panicked: %v", s.cfg.Name, r)
			panicked = true
		}
	}()
	for {
		var more bool
		got := false
		select {
		case e, more = <-s.queue:
			got = true
		default:
			// The queue is empty. If this worker took its last item
			// without waiting (a burst: its producer keeps up with it),
			// the next item is most likely about to be sent by a
			// producer that is runnable on this very processor: yield
			// once and look again before parking. A park and the wake-up
			// that ends it cost several channel operations' worth, and
			// under a burst they come every few items (one in ten in
			// BenchmarkChain, where this cut the time per item by about
			// a tenth). A worker that wakes for one item at a time never
			// yields, so sparse traffic is not delayed.
			if w.burst {
				runtime.Gosched()
				select {
				case e, more = <-s.queue:
					got = true
				default:
				}
			}
		}
		w.burst = got
		waited := !got
		if waited {
			if s.idx == 0 && !p.quiet.Load() {
				p.quiet.Store(true) // the next accepted item is timed
			}
			p.publish(w, 0) // about to wait
			e, more = <-s.queue
		}
		if !more {
			return e, 0, nil, false
		}
		if p.canceled.Load() {
			p.cancel(w, s, e)
			continue
		}
		if w.lag++; !w.busy || w.lag >= publishEvery {
			p.publish(w, 1)
		}
		t0 = 0
		if waited || !w.fast || w.skip == 0 {
			t0 = nanotime()
		} else {
			w.skip--
		}
		inStage = true
		if e.fail != nil && s.failed != nil {
			err = s.failed(p.hardCtx, e.item, e.fail.err)
		} else {
			err = s.process(p.hardCtx, e.item)
		}
		inStage = false
		if err == nil && t0 == 0 && e.fail == nil && s.next != nil {
			// The common case, inline: a healthy untimed item and room
			// in the next stage's queue.
			select {
			case s.next.queue <- e:
				w.ok++
				continue
			default:
			}
		}
		p.finish(s, w, e, t0, err)
	}
}

// finish records e's passage through s (which returned err for it; t0 is
// when it started if it was timed, else 0) and forwards it.
func (p *Pipeline[T]) finish(s *stage[T], w *worker, e envelope[T], t0 int64, err error) {
	if t0 != 0 {
		d := since(t0)
		s.m.duration.Observe(d.Seconds())
		w.fast, w.skip = d < timeAllAbove, timeEvery-1
	}
	if err == nil {
		w.ok++
		p.forward(w, s.idx+1, e)
		return
	}
	if p.canceled.Load() {
		s.m.canceled.Add(1)
		p.cancel(w, s, e)
		return
	}
	s.m.errors.Add(1)
	if e.fail == nil {
		e.fail = &failure{err: err, stage: s.cfg.Name}
	} else {
		e.fail = &failure{err: errors.Join(e.fail.err, err), stage: e.fail.stage}
	}
	p.forward(w, s.idx+1, e)
}

// forward sends e to the first stage at index >= from that should see it,
// or to the sink when none remains.
func (p *Pipeline[T]) forward(w *worker, from int, e envelope[T]) {
	for i := from; i < len(p.stages); i++ {
		next := p.stages[i]
		if e.fail != nil && !next.cfg.SeesFailed {
			next.m.skipped.Add(1)
			continue
		}
		if next.keyed != nil {
			if p.sendKeyed(w, next, &e) {
				return
			}
			continue // refused: e failed there
		}
		select {
		case next.queue <- e: // room: one channel operation
			return
		default:
		}
		p.publish(w, 0) // about to wait
		t0 := next.m.blocked.begin()
		select {
		case next.queue <- e:
			next.m.blocked.end(t0)
			return
		case <-p.hardCtx.Done():
			next.m.blocked.end(t0)
			p.cancel(w, next, e)
			return
		}
	}
	if e.fail != nil {
		p.end(w, e, Failed, e.fail.err, e.fail.stage)
	} else {
		p.end(w, e, Done, nil, "")
	}
}

func (p *Pipeline[T]) cancel(w *worker, at *stage[T], e envelope[T]) {
	cause := ErrCanceled
	var err error = cause
	if e.fail != nil {
		err = errors.Join(cause, e.fail.err)
	}
	p.end(w, e, Canceled, err, at.cfg.Name)
}

// end hands e to the sink, then counts it ended.
func (p *Pipeline[T]) end(w *worker, e envelope[T], o Outcome, err error, stage string) {
	if e.start != 0 {
		d := since(e.start)
		p.m.latencyBy[o].Observe(d.Seconds())
		if all := d >= latencyAllAbove; all != p.timeAll.Load() {
			p.timeAll.Store(all)
		}
	}
	p.callSink(Result[T]{Item: e.item, Outcome: o, Err: err, Stage: stage})
	switch o {
	case Done:
		w.ended++
		if !p.closed.Load() {
			return // published with the worker's next item or wait
		}
		p.publish(w, 0) // Close is waiting for the count
		return
	case Failed:
		p.failed.Add(1)
	default:
		p.canceledN.Add(1)
	}
	if p.closed.Load() {
		p.checkDrained()
	}
}

func (p *Pipeline[T]) callSink(r Result[T]) {
	defer func() {
		if rec := recover(); rec != nil {
			p.log.Error("sink panicked", "panic", rec, "stack", string(debug.Stack()))
		}
	}()
	p.sink(r)
}
