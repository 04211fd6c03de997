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

type envelope[T any] struct {
	item     T
	err      error
	failedAt string
	start    int64 // nanotime at acceptance
}

type stage[T any] struct {
	cfg   StageConfig[T]
	idx   int
	queue chan *envelope[T]
	m     stageMetrics
}

// Pipeline is a running chain of stages. Create it with New; it is safe for
// concurrent use.
type Pipeline[T any] struct {
	stages []*stage[T]
	sink   func(Result[T])
	log    *slog.Logger
	m      *metrics

	closed    atomic.Bool
	closing   chan struct{} // closed when Close begins: stops blocked Submits
	drained   chan struct{} // closed when, after Close began, no item is in flight
	drainOnce sync.Once

	hardCtx    context.Context // canceled when Close's deadline passes
	hardCancel context.CancelFunc
	canceled   atomic.Bool // set with hardCancel; cheaper to poll than hardCtx.Err
	workers    conc.WaitGroup
	closeOnce  sync.Once
	closeErr   error
	inflight   atomic.Int64
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
	names := make([]string, len(cfg.Stages))
	for i, sc := range cfg.Stages {
		names[i] = sc.Name
	}
	m, err := newMetrics(reg, names, &p.inflight)
	if err != nil {
		p.hardCancel()
		return nil, err
	}
	p.m = m
	for i, sc := range cfg.Stages {
		s := &stage[T]{cfg: sc, idx: i, queue: make(chan *envelope[T], sc.Capacity)}
		s.m = m.forStage(sc.Name, sc.Capacity, func() float64 { return float64(len(s.queue)) })
		p.stages = append(p.stages, s)
	}
	if err := reg.Register(m.gauges); err != nil {
		p.hardCancel()
		return nil, fmt.Errorf("pipeline: register metrics: %w", err)
	}
	for _, s := range p.stages {
		for range s.cfg.Workers {
			p.workers.Go(func() { p.run(s) })
		}
	}
	return p, nil
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
	if err := p.accept(); err != nil {
		return err
	}
	e := &envelope[T]{item: item, start: nanotime()}
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
	if err := p.accept(); err != nil {
		return err
	}
	first := p.stages[0]
	select {
	case first.queue <- &envelope[T]{item: item, start: nanotime()}:
		return nil
	default:
		p.unaccept()
		first.m.rejected.Inc()
		return ErrFull
	}
}

// accept counts an item in. Intake and Close meet on two atomics (no
// lock on the hot path): an item counted before Close saw the count is
// waited for; one counted after sees closed and backs out.
func (p *Pipeline[T]) accept() error {
	if p.closed.Load() {
		return ErrClosed
	}
	p.inflight.Add(1)
	if p.closed.Load() {
		p.unaccept()
		return ErrClosed
	}
	return nil
}

func (p *Pipeline[T]) unaccept() {
	if p.inflight.Add(-1) == 0 && p.closed.Load() {
		p.drainOnce.Do(func() { close(p.drained) })
	}
}

// InFlight is the number of accepted items that have not reached the sink.
func (p *Pipeline[T]) InFlight() int { return int(p.inflight.Load()) }

// Close stops intake, waits until every accepted item has reached the sink,
// and returns. If ctx ends first, it cancels the items still in the
// pipeline (they end as Canceled; stages see a canceled context), waits for
// them to reach the sink, and returns ctx's error. No goroutine started by
// the pipeline outlives Close. Close is idempotent.
func (p *Pipeline[T]) Close(ctx context.Context) error {
	p.closeOnce.Do(func() {
		p.closed.Store(true)
		close(p.closing)
		if p.inflight.Load() == 0 {
			p.drainOnce.Do(func() { close(p.drained) })
		}
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

// Timing: every item of a stage is timed while the stage's recent items
// took at least timeAllAbove; below that the clock reads and histogram
// update would cost more than the work itself, so one item in
// timeEvery is timed (kvflow_stage_items_total still counts every item).
// kvflow's real stages (handshake misses, reads, DONE/ACK) take far longer
// and are always timed.
const (
	timeAllAbove = 20 * time.Microsecond
	timeEvery    = 16
)

// worker is one worker goroutine's timing state.
type worker struct {
	fast bool // the last timed item took less than timeAllAbove
	skip int  // items until the next timed one, while fast
}

func (p *Pipeline[T]) run(s *stage[T]) {
	var w worker
	for e := range s.queue {
		p.handle(s, &w, e)
	}
}

func (p *Pipeline[T]) handle(s *stage[T], w *worker, e *envelope[T]) {
	if p.canceled.Load() {
		p.cancel(s, e)
		return
	}
	s.m.busy.Add(1)
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
	s.m.busy.Add(-1)

	if err != nil && p.canceled.Load() {
		s.m.outcome(outcomeCanceled).Inc()
		p.cancel(s, e)
		return
	}
	switch {
	case err == nil:
		s.m.outcome(outcomeOK).Inc()
	default:
		s.m.outcome(outcomeError).Inc()
		if e.err == nil {
			e.failedAt = s.cfg.Name
			e.err = err
		} else {
			e.err = errors.Join(e.err, err)
		}
	}
	p.forward(s.idx+1, e)
}

// invoke runs the stage's function on e, turning a panic into an error.
func (p *Pipeline[T]) invoke(s *stage[T], e *envelope[T]) (err error) {
	defer func() {
		if r := recover(); r != nil {
			s.m.panics.Inc()
			p.log.Error("stage panicked", "stage", s.cfg.Name, "panic", r, "stack", string(debug.Stack()))
			err = fmt.Errorf("pipeline: stage %q panicked: %v", s.cfg.Name, r)
		}
	}()
	if e.err != nil {
		if fa, ok := s.cfg.Stage.(FailureAware[T]); ok {
			return fa.ProcessFailed(p.hardCtx, e.item, e.err)
		}
	}
	return s.cfg.Stage.Process(p.hardCtx, e.item)
}

// forward sends e to the first stage at index >= from that should see it,
// or to the sink when none remains.
func (p *Pipeline[T]) forward(from int, e *envelope[T]) {
	for i := from; i < len(p.stages); i++ {
		next := p.stages[i]
		if e.err != nil && !next.cfg.SeesFailed {
			next.m.outcome(outcomeSkipped).Inc()
			continue
		}
		if len(next.queue) < cap(next.queue) {
			// Room (probably): one plain send, one channel lock. If another
			// sender took the slot first this send waits briefly, unmeasured;
			// downstream workers keep draining, also after a cancel.
			next.queue <- e
			return
		}
		t0 := next.m.blocked.begin()
		select {
		case next.queue <- e:
			next.m.blocked.end(t0)
			return
		case <-p.hardCtx.Done():
			next.m.blocked.end(t0)
			p.cancel(next, e)
			return
		}
	}
	if e.err != nil {
		p.end(e, Failed, e.err, e.failedAt)
	} else {
		p.end(e, Done, nil, "")
	}
}

func (p *Pipeline[T]) cancel(at *stage[T], e *envelope[T]) {
	cause := ErrCanceled
	var err error = cause
	if e.err != nil {
		err = errors.Join(cause, e.err)
	}
	p.end(e, Canceled, err, at.cfg.Name)
}

func (p *Pipeline[T]) end(e *envelope[T], o Outcome, err error, stage string) {
	defer p.unaccept()
	p.m.ended(o, since(e.start))
	defer func() {
		if r := recover(); r != nil {
			p.log.Error("sink panicked", "panic", r, "stack", string(debug.Stack()))
		}
	}()
	p.sink(Result[T]{Item: e.item, Outcome: o, Err: err, Stage: stage})
}
