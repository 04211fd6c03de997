package pipeline

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Errors of keyed stages (StageConfig.Key). An item refused with one of
// them fails at the keyed stage without being processed, and carries the
// error on like any other failure.
var (
	// ErrTooManyKeys refuses an item whose key is new while the stage
	// already holds items of MaxKeys distinct keys.
	ErrTooManyKeys = errors.New("pipeline: too many keys")
	// ErrKeyStalled refuses an item that would wait beyond its key's
	// KeyQueue when the stage's park budget (KeyPark) is spent and the
	// key is stalled (KeyStall).
	ErrKeyStalled = errors.New("pipeline: key stalled")
)

// DefaultMaxKeys bounds the distinct keys of a keyed stage when
// StageConfig.MaxKeys is 0: a decode worker talks to tens of prefill ranks,
// a large deployment to a few hundred; 1024 leaves room for both while a
// flood of made-up keys costs at most 1024 small records.
const DefaultMaxKeys = 1024

// errSendCanceled: a blocked send to a keyed stage ended because the
// pipeline was canceled; the item has been ended as Canceled.
var errSendCanceled = errors.New("pipeline: send canceled")

// Adaptive stall: a key is stalled when it has items in Process and none
// of its items ended without error for KeyStallFactor times its recent
// service time (the moving average of its items that ended well; the
// stage's when the key has none yet), but never sooner than MinKeyStall
// nor later than StageConfig.KeyStall.
const (
	KeyStallFactor = 8
	MinKeyStall    = 50 * time.Millisecond
)

// keyed is the queue of a keyed stage: one FIFO per key, a ring of the keys
// that have waiting items and a free slot (KeyWorkers), and the stage's
// global bound (room). Workers take the key at the head of the ring, so
// keys take turns (round robin); a key that still has items and a free slot
// goes back to the tail.
//
// A key's FIFO holds up to KeyQueue items that took a token of room, then
// parked items: sent while the key's queue was full, they took a place of
// the stage's park budget (KeyPark) instead, so that their sender went on
// at once. When one of the key's items is taken, its token passes to the
// oldest parked item. Only when the park budget is spent does a send to a
// full key block (or, the key being stalled, get refused).
type keyed[T any] struct {
	name       string
	key        func(T) string
	keyWorkers int
	keyQueue   int
	stall      time.Duration
	maxKeys    int
	park       int // park budget, all keys together

	// room holds one token per item waiting in the stage and not parked:
	// a sender puts one before it queues (blocking while the stage holds
	// Capacity such items, as an unkeyed stage's channel does), a worker
	// takes one when it takes an item (or passes it to a parked one).
	room chan struct{}

	mu       sync.Mutex
	cond     sync.Cond // workers wait for a runnable key
	keys     map[string]*keyState[T]
	ready    []*keyState[T] // runnable keys, oldest first; ready[readyAt:] is live
	readyAt  int
	closed   bool
	canceled bool
	parked   int           // parked items, all keys
	parkWake chan struct{} // closed when a park place frees; nil if no one waits
	ewma     time.Duration // service time of the stage's items that ended well
	served   bool          // ewma holds a sample

	waiting    atomic.Int64 // items waiting, all keys
	backlogged atomic.Int64 // keys with items waiting
	parkedN    atomic.Int64 // parked, for the metrics
	wait       prometheus.Observer
}

type keyState[T any] struct {
	name    string
	items   []keyedItem[T] // items[head:] wait, oldest first
	head    int
	held    int // waiting items holding a token of room (the first ones)
	parked  int // waiting items parked (after them)
	running int
	ready   bool // in the ready ring
	// progress is when an item of the key last ended without error, or
	// when the key last went from idle to busy.
	progress time.Time
	ewma     time.Duration // service time of the key's items that ended well
	served   bool
	// wake is closed when one of the key's items is taken: senders that
	// wait for room in the key's queue wait on it.
	wake chan struct{}
}

type keyedItem[T any] struct {
	e      envelope[T]
	at     time.Time
	parked bool
}

func (k *keyState[T]) len() int { return len(k.items) - k.head }

func (k *keyState[T]) push(it keyedItem[T]) {
	if k.head > 0 && k.head == len(k.items) {
		k.items, k.head = k.items[:0], 0
	}
	k.items = append(k.items, it)
}

func (k *keyState[T]) pop() keyedItem[T] {
	it := k.items[k.head]
	k.items[k.head] = keyedItem[T]{}
	k.head++
	if k.head == len(k.items) {
		k.items, k.head = k.items[:0], 0
	}
	return it
}

// full: a new item of k can only be parked (or wait).
func (q *keyed[T]) full(k *keyState[T]) bool {
	return k != nil && (k.held >= q.keyQueue || k.parked > 0)
}

// ewmaAdd folds sample d into the moving average *m (weight 1/8).
func ewmaAdd(m *time.Duration, served *bool, d time.Duration) {
	if !*served {
		*m, *served = d, true
		return
	}
	*m += (d - *m) / 8
}

// stallAfter is how long k may run items without one ending well before it
// is stalled (see KeyStallFactor).
func (q *keyed[T]) stallAfter(k *keyState[T]) time.Duration {
	d := q.stall
	switch {
	case k.served:
		d = KeyStallFactor * k.ewma
	case q.served:
		d = KeyStallFactor * q.ewma
	}
	return min(max(d, MinKeyStall), q.stall)
}

func newKeyed[T any](sc StageConfig[T], wait prometheus.Observer) *keyed[T] {
	q := &keyed[T]{
		name:       sc.Name,
		key:        sc.Key,
		keyWorkers: sc.KeyWorkers,
		keyQueue:   sc.KeyQueue,
		stall:      sc.KeyStall,
		maxKeys:    sc.MaxKeys,
		park:       sc.KeyPark,
		room:       make(chan struct{}, sc.Capacity),
		keys:       map[string]*keyState[T]{},
		wait:       wait,
	}
	if q.keyWorkers <= 0 {
		q.keyWorkers = sc.Workers
	}
	if q.keyQueue <= 0 {
		q.keyQueue = sc.Capacity
	}
	if q.maxKeys <= 0 {
		q.maxKeys = DefaultMaxKeys
	}
	switch {
	case q.park == 0:
		q.park = sc.Capacity
	case q.park < 0:
		q.park = 0 // none
	}
	q.cond.L = &q.mu
	return q
}

// runnable: k has an item waiting and a free slot (or the pipeline is
// canceled: then its items are taken only to be ended).
func (q *keyed[T]) runnable(k *keyState[T]) bool {
	return k.len() > 0 && (k.running < q.keyWorkers || q.canceled)
}

func (q *keyed[T]) makeReady(k *keyState[T]) {
	if k.ready || !q.runnable(k) {
		return
	}
	k.ready = true
	if q.readyAt > 0 && q.readyAt == len(q.ready) {
		q.ready, q.readyAt = q.ready[:0], 0
	}
	q.ready = append(q.ready, k)
	q.cond.Signal()
}

// queue appends it to k's FIFO (q.mu held).
func (q *keyed[T]) queue(k *keyState[T], it keyedItem[T]) {
	if k.len() == 0 {
		q.backlogged.Add(1)
	}
	if it.parked {
		k.parked++
		q.parked++
		q.parkedN.Add(1)
	} else {
		k.held++
	}
	k.push(it)
	q.waiting.Add(1)
	q.makeReady(k)
}

// unpark counts one parked item gone (taken or holding a token now) and
// wakes the senders waiting for a park place (q.mu held).
func (q *keyed[T]) unpark(k *keyState[T]) {
	k.parked--
	q.parked--
	q.parkedN.Add(-1)
	if q.parkWake != nil {
		close(q.parkWake)
		q.parkWake = nil
	}
}

// sendWait is how a blocked send to a keyed stage ends early.
type sendWait struct {
	ctx     <-chan struct{} // the caller's context (Submit); nil otherwise
	ctxErr  func() error
	closing <-chan struct{} // Close began (Submit); nil otherwise
	hard    <-chan struct{} // the pipeline was canceled (workers)
	before  func()          // called once before the send blocks
}

// put queues e under its key. An item whose key's queue is full is parked
// while the stage's park budget lasts; beyond, the send blocks until the
// key takes an item or a park place frees, or is refused (ErrKeyStalled)
// when the key is stalled. A send also blocks while the stage holds
// Capacity unparked items. put returns an error (wrapping ErrTooManyKeys
// or ErrKeyStalled) when the item is refused, or the reason a blocked send
// ended (sw). blocked counts the time blocked.
func (q *keyed[T]) put(e envelope[T], sw sendWait, blocked *blockedClock, block bool) error {
	k := q.key(e.item)
	var t0 time.Duration
	waitStarted := false
	startWait := func() {
		if !waitStarted {
			waitStarted = true
			if sw.before != nil {
				sw.before()
			}
			t0 = blocked.begin()
		}
	}
	defer func() {
		if waitStarted {
			blocked.end(t0)
		}
	}()
	hasRoom := false
	giveBack := func() {
		if hasRoom {
			<-q.room
			hasRoom = false
		}
	}
	for {
		now := time.Now()
		q.mu.Lock()
		ks := q.keys[k]
		full := q.full(ks)
		if !full && !hasRoom {
			select { // never blocks: workers take room without q.mu
			case q.room <- struct{}{}:
				hasRoom = true
			default:
			}
		}
		switch {
		case full && q.parked < q.park:
			q.queue(ks, keyedItem[T]{e: e, at: now, parked: true})
			q.mu.Unlock()
			giveBack()
			return nil
		case !full && hasRoom:
			if ks == nil {
				if len(q.keys) >= q.maxKeys {
					n := len(q.keys)
					q.mu.Unlock()
					giveBack()
					return fmt.Errorf("stage %s: key %q: %w (%d keys waiting or running, max %d)", q.name, k, ErrTooManyKeys, n, q.maxKeys)
				}
				ks = &keyState[T]{name: k, progress: now}
				q.keys[k] = ks
			}
			q.queue(ks, keyedItem[T]{e: e, at: now})
			q.mu.Unlock()
			return nil
		}
		// Wait: for room (the key has a place), or for the key to take an
		// item or a park place to free (the key is full).
		var timer *time.Timer
		var wake, parkWake <-chan struct{}
		if full {
			if q.stall > 0 && ks.running > 0 {
				after := q.stallAfter(ks)
				left := ks.progress.Add(after).Sub(now)
				if left <= 0 {
					n, r, since := ks.len(), ks.running, now.Sub(ks.progress)
					q.mu.Unlock()
					giveBack()
					return fmt.Errorf("stage %s: key %q: %w: %d waiting, %d running, none ended well in %v (stall after %v)",
						q.name, k, ErrKeyStalled, n, r, since.Round(time.Millisecond), after.Round(time.Millisecond))
				}
				timer = time.NewTimer(left)
			}
			if ks.wake == nil {
				ks.wake = make(chan struct{})
			}
			wake = ks.wake
			if q.park > 0 {
				if q.parkWake == nil {
					q.parkWake = make(chan struct{})
				}
				parkWake = q.parkWake
			}
		}
		q.mu.Unlock()
		giveBack() // a full key waits without holding the others' room
		if !block {
			if timer != nil {
				timer.Stop()
			}
			return ErrFull
		}
		startWait()
		var tc <-chan time.Time
		if timer != nil {
			tc = timer.C
		}
		var roomCh chan<- struct{}
		if !full {
			roomCh = q.room
		}
		var err error
		select {
		case roomCh <- struct{}{}:
			hasRoom = true
		case <-wake:
		case <-parkWake:
		case <-tc:
		case <-sw.ctx:
			err = fmt.Errorf("pipeline: submit: %w", sw.ctxErr())
		case <-sw.closing:
			err = ErrClosed
		case <-sw.hard:
			err = errSendCanceled
		}
		if timer != nil {
			timer.Stop()
		}
		if err != nil {
			giveBack()
			return err
		}
	}
}

// take waits for a runnable key and takes its oldest item, holding one of
// the key's slots until done. ok is false once the stage is closed and
// empty. waited reports whether the worker had to wait; started is when
// the item was taken (for done).
func (q *keyed[T]) take() (it keyedItem[T], ks *keyState[T], started time.Time, waited, ok bool) {
	q.mu.Lock()
	for {
		for q.readyAt < len(q.ready) {
			k := q.ready[q.readyAt]
			q.ready[q.readyAt] = nil
			q.readyAt++
			k.ready = false
			if q.runnable(k) {
				ks = k
				break
			}
		}
		if ks != nil {
			break
		}
		if q.closed && q.waiting.Load() == 0 {
			q.mu.Unlock()
			return it, nil, started, waited, false
		}
		waited = true
		q.cond.Wait()
	}
	it = ks.pop()
	now := time.Now()
	q.waiting.Add(-1)
	if ks.len() == 0 {
		q.backlogged.Add(-1)
	}
	release := false
	if it.parked {
		q.unpark(ks)
	} else {
		ks.held--
		release = true
		if ks.parked > 0 {
			// Its token passes to the oldest parked item, the first after
			// the held ones.
			i := ks.head + ks.held
			for i < len(ks.items) && !ks.items[i].parked {
				i++ // not reached: parked items only follow held ones
			}
			ks.items[i].parked = false
			ks.held++
			q.unpark(ks)
			release = false
		}
	}
	if ks.running == 0 {
		ks.progress = now
	}
	ks.running++
	if ks.wake != nil {
		close(ks.wake)
		ks.wake = nil
	}
	q.makeReady(ks) // its next item, at the tail: keys take turns
	q.mu.Unlock()
	if release {
		<-q.room
	}
	q.wait.Observe(now.Sub(it.at).Seconds())
	return it, ks, now, waited, true
}

// done gives back the slot of one of ks's items, taken at started; ok: it
// ended without error (the key made progress, and its time is a sample of
// the key's and the stage's service time).
func (q *keyed[T]) done(ks *keyState[T], started time.Time, ok bool) {
	q.mu.Lock()
	ks.running--
	if ok {
		now := time.Now()
		ks.progress = now
		d := now.Sub(started)
		ewmaAdd(&ks.ewma, &ks.served, d)
		ewmaAdd(&q.ewma, &q.served, d)
	}
	if ks.running == 0 && ks.len() == 0 {
		delete(q.keys, ks.name)
	} else {
		q.makeReady(ks)
	}
	q.mu.Unlock()
}

// close wakes every worker: with canceled, to end the waiting items; with
// closed (every item has ended), to return.
func (q *keyed[T]) wakeAll(closed, canceled bool) {
	q.mu.Lock()
	if closed {
		q.closed = true
	}
	if canceled && !q.canceled {
		q.canceled = true
		for _, k := range q.keys {
			q.makeReady(k)
		}
	}
	q.cond.Broadcast()
	q.mu.Unlock()
}

// runKeyed is a keyed stage's worker loop. Keyed stages wait on their
// peers (that is why they are keyed), so every item is timed and the
// worker publishes its counts around each item; none of the unkeyed
// loop's savings matter here.
func (p *Pipeline[T]) runKeyed(s *stage[T], w *worker) {
	defer p.publish(w, 0)
	q := s.keyed
	for {
		p.publish(w, 0) // about to wait, perhaps
		it, ks, started, waited, ok := q.take()
		if !ok {
			return
		}
		if waited && s.idx == 0 && !p.quiet.Load() {
			p.quiet.Store(true)
		}
		e := it.e
		if p.canceled.Load() {
			q.done(ks, started, false)
			p.cancel(w, s, e)
			continue
		}
		p.publish(w, 1)
		t0 := nanotime()
		err := p.processOne(s, e)
		q.done(ks, started, err == nil)
		p.finish(s, w, e, t0, err)
	}
}

// processOne runs s on e, turning a panic into the item's error.
func (p *Pipeline[T]) processOne(s *stage[T], e envelope[T]) (err error) {
	defer func() {
		if r := recover(); r != nil {
			s.m.panics.Inc()
			p.log.Error("stage panicked", "stage", s.cfg.Name, "panic", r, "stack", string(debug.Stack()))
			err = fmt.Errorf("pipeline: stage %q panicked: %v", s.cfg.Name, r)
		}
	}()
	if e.fail != nil && s.failed != nil {
		return s.failed(p.hardCtx, e.item, e.fail.err)
	}
	return s.process(p.hardCtx, e.item)
}

// sendKeyed hands e to the keyed stage next from worker w. It reports
// whether e went on (queued, or ended as canceled); when next refused it,
// e fails there and the caller forwards it further.
func (p *Pipeline[T]) sendKeyed(w *worker, next *stage[T], e *envelope[T]) bool {
	err := next.keyed.put(*e, sendWait{hard: p.hardCtx.Done(), before: func() { p.publish(w, 0) }}, next.m.blocked, true)
	switch {
	case err == nil:
		return true
	case errors.Is(err, errSendCanceled):
		p.cancel(w, next, *e)
		return true
	}
	next.m.rejected.Inc()
	next.m.errors.Add(1)
	if e.fail == nil {
		e.fail = &failure{err: err, stage: next.cfg.Name}
	} else {
		e.fail = &failure{err: errors.Join(e.fail.err, err), stage: e.fail.stage}
	}
	return false
}

// submitKeyed is Submit and TrySubmit for a keyed first stage. A refused
// item is not accepted: the caller gets the error.
func (p *Pipeline[T]) submitKeyed(ctx context.Context, e envelope[T], block bool) error {
	first := p.stages[0]
	sw := sendWait{closing: p.closing}
	if ctx != nil {
		sw.ctx, sw.ctxErr = ctx.Done(), ctx.Err
	}
	err := first.keyed.put(e, sw, first.m.blocked, block)
	if err != nil {
		p.unaccept()
		if errors.Is(err, ErrFull) || errors.Is(err, ErrTooManyKeys) || errors.Is(err, ErrKeyStalled) {
			first.m.rejected.Inc()
		}
	}
	return err
}
