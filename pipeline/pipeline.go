package pipeline

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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
	idx     int
	queue   chan envelope[T]
	m       stageMetrics
	workers []worker
}

// Timing: every item of a stage is timed while the stage's recent items
// took at least timeAllAbove; below that the clock reads and histogram
// update would cost more than the work itself, so one item in
// timeEvery is timed (kvflow_stage_items_total still counts every item).
// kvflow's real stages (handshake misses, reads, DONE/ACK) take far longer
// and are always timed. Likewise the end-to-end latency
// (kvflow_pipeline_item_duration_seconds) is measured on every item while
// recent items took at least latencyAllAbove from acceptance to the sink,
// on one item in timeEvery otherwise (kvflow_pipeline_items_total still
// counts every item).
const (
	timeAllAbove    = 20 * time.Microsecond
	latencyAllAbove = time.Millisecond
	timeEvery       = 16
)

// worker is one worker goroutine's state. Only that goroutine writes it;
// scrapes and Close read the published atomics. It fills two cache lines
// so that workers do not share one.
//
// The worker keeps its counts in plain fields and publishes them with one
// store per item, when it starts the item (that store also publishes the
// end of the previous one), and whenever it is about to wait: for the next
// item, for room downstream, or, after Close began, for nothing (see end).
// So the published values are exact while the worker runs a stage function
// or waits; while it passes a finished item on (a send to a queue with
// room, or the sink) it still reads busy and that item is not yet counted.
type worker struct {
	state atomic.Uint64 // published ok<<1 | busy
	done  atomic.Int64  // published done
	ok    uint64        // items this worker's stage function returned nil for
	ended int64         // items this worker handed to the sink as Done
	fast  bool          // the last timed item took less than timeAllAbove
	skip  int           // items until the next timed one, while fast
	_     [128 - 48]byte
}

// publish makes w's counts visible, busy or not.
func (p *Pipeline[T]) publish(w *worker, busy uint64) {
	w.state.Store(w.ok<<1 | busy)
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
	closing   chan struct{} // closed when Close begins: stops blocked Submits
	drained   chan struct{} // closed when, after Close began, no item is in flight
	drainOnce sync.Once

	hardCtx    context.Context // canceled when Close's deadline passes
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
	p.hardCtx, p.hardCancel = context.WithCancel(context.Background())
	m, err := newMetrics(reg, func() float64 { return float64(p.InFlight()) })
	if err != nil {
		p.hardCancel()
		return nil, err
	}
	p.m = m
	for i, sc := range cfg.Stages {
		s := &stage[T]{cfg: sc, idx: i, queue: make(chan envelope[T], sc.Capacity), workers: make([]worker, sc.Workers)}
		s.m = m.forStage(sc.Name, sc.Capacity, func() float64 { return float64(len(s.queue)) }, s.workerStates)
		p.stages = append(p.stages, s)
	}
	m.scrape.results = p.results
	if err := reg.Register(m.scrape); err != nil {
		p.hardCancel()
		return nil, fmt.Errorf("pipeline: register metrics: %w", err)
	}
	for _, s := range p.stages {
		for i := range s.workers {
			w := &s.workers[i]
			p.workers.Go(func() { p.run(s, w) })
		}
	}
	return p, nil
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
	}
	return errors.Join(errs...)
}

func isNilFunc[T any](s Stage[T]) bool {
	f, ok := s.(StageFunc[T])
	return ok && f == nil
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
	if n%timeEvery == 0 || p.timeAll.Load() {
		e.start = nanotime()
	}
	first := p.stages[0]
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
	if n%timeEvery == 0 || p.timeAll.Load() {
		e.start = nanotime()
	}
	first := p.stages[0]
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
			<-drained
		}
		// Every accepted item has reached the sink and intake is closed, so
		// nothing can send on a queue any more: closing them is safe and
		// lets the workers return.
		for _, s := range p.stages {
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
		var e envelope[T]
		var more bool
		select {
		case e, more = <-s.queue:
		default:
			p.publish(w, 0) // about to wait
			e, more = <-s.queue
		}
		if !more {
			return
		}
		p.handle(s, w, e)
	}
}

func (p *Pipeline[T]) handle(s *stage[T], w *worker, e envelope[T]) {
	if p.canceled.Load() {
		p.cancel(w, s, e)
		return
	}
	p.publish(w, 1)
	timed := !w.fast || w.skip == 0
	var t0 int64
	if timed {
		t0 = nanotime()
	}
	err := p.invoke(s, e)
	if timed {
		d := since(t0)
		s.m.duration.Observe(d.Seconds())
		w.fast, w.skip = d < timeAllAbove, timeEvery-1
	} else {
		w.skip--
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

// invoke runs the stage's function on e, turning a panic into an error.
func (p *Pipeline[T]) invoke(s *stage[T], e envelope[T]) (err error) {
	defer func() {
		if r := recover(); r != nil {
			s.m.panics.Inc()
			p.log.Error("stage panicked", "stage", s.cfg.Name, "panic", r, "stack", string(debug.Stack()))
			err = fmt.Errorf("pipeline: stage %q panicked: %v", s.cfg.Name, r)
		}
	}()
	if e.fail != nil {
		if fa, ok := s.cfg.Stage.(FailureAware[T]); ok {
			return fa.ProcessFailed(p.hardCtx, e.item, e.fail.err)
		}
	}
	return s.cfg.Stage.Process(p.hardCtx, e.item)
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
