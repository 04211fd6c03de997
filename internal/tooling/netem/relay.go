package netem

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"time"

	"golang.org/x/sync/semaphore"
)

// readSize is the largest chunk the relay reads at once; reads shorter
// than smallRead are copied out so a big buffer does not sit in the
// delay line holding a few bytes.
const (
	readSize   = 64 << 10
	smallRead  = 4 << 10
	queueSlots = 1024 // chunks per direction, besides the byte bound
	dialWait   = 10 * time.Second
)

// copyRelay makes every relay use the copying delay line (tests).
var copyRelay bool

var bufPool = sync.Pool{New: func() any { b := make([]byte, readSize); return &b }}

// relay accepts on ln (inside decode) and forwards each connection to
// target inside namespace ns (prefill) through a delay line each way.
type relay struct {
	ln     net.Listener
	ns     string
	target string
	spec   Spec
	buf    int

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func startRelay(ln net.Listener, ns, target string, spec Spec, buf int) *relay {
	ctx, cancel := context.WithCancel(context.Background())
	r := &relay{ln: ln, ns: ns, target: target, spec: spec, buf: buf, ctx: ctx, cancel: cancel}
	r.wg.Add(1)
	go r.accept()
	return r
}

// stop closes the listener and every relayed connection and waits for
// all the relay's goroutines.
func (r *relay) stop() {
	r.cancel()
	r.ln.Close()
	r.wg.Wait()
}

func (r *relay) accept() {
	defer r.wg.Done()
	for {
		c, err := r.ln.Accept()
		if err != nil {
			if r.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			// e.g. EMFILE: back off instead of spinning.
			select {
			case <-r.ctx.Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		r.wg.Add(1)
		go r.serve(c)
	}
}

// serve relays one accepted connection until both directions have
// ended, either side fails, or the relay stops.
func (r *relay) serve(client net.Conn) {
	defer r.wg.Done()
	ctx, cancel := context.WithCancel(r.ctx)
	defer cancel()
	dctx, dcancel := context.WithTimeout(ctx, dialWait)
	server, err := dialIn(dctx, r.ns, "tcp", r.target)
	dcancel()
	if err != nil {
		client.Close()
		return
	}
	// Closing both ends is what unblocks the readers when the pair ends.
	stopClose := context.AfterFunc(ctx, func() {
		client.Close()
		server.Close()
	})
	defer func() {
		if stopClose() { // cancel has not run it: close here
			client.Close()
			server.Close()
		}
	}()
	var wg sync.WaitGroup
	var mu sync.Mutex
	ended := 0
	end := func(ok bool) {
		mu.Lock()
		ended++
		both := ended == 2
		mu.Unlock()
		if !ok || both {
			cancel()
		}
	}
	wg.Add(4)
	for _, p := range [][2]net.Conn{{client, server}, {server, client}} {
		var line interface {
			read(context.Context, net.Conn)
			write(context.Context, net.Conn) bool
		} = newDelayLine(r.spec, r.buf)
		if !copyRelay {
			if sl := newSpliceLine(r.spec, r.buf, p[0], p[1]); sl != nil {
				line = sl
				defer sl.close() // after wg.Wait: both of its goroutines returned
			}
		}
		go func() { defer wg.Done(); line.read(ctx, p[0]) }()
		go func() { defer wg.Done(); end(line.write(ctx, p[1])) }()
	}
	wg.Wait()
}

type chunk struct {
	b   []byte
	big *[]byte // pool buffer behind b, if any
	at  time.Time
	eof bool  // src ended cleanly: half-close dst
	err error // src failed: end the pair
}

// delayLine carries one direction: chunks leave no earlier than delay
// (plus jitter) after they were read, in order, with at most buf bytes
// in flight.
type delayLine struct {
	schedule
	sem  *semaphore.Weighted
	want int64
	ch   chan chunk
}

// schedule gives each chunk (or packet) its release time: delay plus
// jitter after it was taken, never before the one taken before it.
type schedule struct {
	spec Spec
	last time.Time
}

func newDelayLine(spec Spec, buf int) *delayLine {
	want := int64(readSize)
	if int64(buf) < want {
		want = int64(buf)
	}
	return &delayLine{schedule: schedule{spec: spec}, sem: semaphore.NewWeighted(int64(buf)), want: want, ch: make(chan chunk, queueSlots)}
}

func (l *schedule) release(now time.Time) time.Time {
	d := l.spec.Delay
	if j := l.spec.Jitter; j > 0 {
		d += time.Duration(rand.Int64N(int64(2*j)+1)) - j
		if d < 0 {
			d = 0
		}
	}
	at := now.Add(d)
	if at.Before(l.last) {
		at = l.last // jitter never reorders
	}
	l.last = at
	return at
}

func (l *delayLine) read(ctx context.Context, src net.Conn) {
	defer close(l.ch)
	for {
		if err := l.sem.Acquire(ctx, l.want); err != nil {
			return
		}
		bp := bufPool.Get().(*[]byte)
		n, err := src.Read((*bp)[:l.want])
		now := time.Now()
		l.sem.Release(l.want - int64(n))
		if n > 0 {
			c := chunk{at: l.release(now)}
			if n < smallRead {
				c.b = append([]byte(nil), (*bp)[:n]...)
				bufPool.Put(bp)
			} else {
				c.b, c.big = (*bp)[:n], bp
			}
			if !l.send(ctx, c) {
				return
			}
		} else {
			bufPool.Put(bp)
		}
		if err != nil {
			c := chunk{at: l.release(now)}
			if errors.Is(err, io.EOF) {
				c.eof = true
			} else {
				c.err = err
			}
			l.send(ctx, c)
			return
		}
	}
}

func (l *delayLine) send(ctx context.Context, c chunk) bool {
	select {
	case l.ch <- c:
		return true
	case <-ctx.Done():
		if c.big != nil {
			bufPool.Put(c.big)
		}
		return false
	}
}

// awaitDue takes the next item from ch and waits until its time (at).
// It reports false when ch is closed or ctx ends first; an item taken
// before ctx ended is returned with false, for the caller to release.
func awaitDue[C any](ctx context.Context, ch <-chan C, at func(C) time.Time, timer *time.Timer) (C, bool) {
	var c C
	select {
	case v, ok := <-ch:
		if !ok {
			return c, false
		}
		c = v
	case <-ctx.Done():
		return c, false
	}
	if wait := time.Until(at(c)); wait > 0 {
		timer.Reset(wait)
		select {
		case <-timer.C:
		case <-ctx.Done():
			return c, false
		}
	}
	return c, true
}

// write delivers chunks to dst at their time. It reports false when the
// pair must end (an error either side or a stop), true after a clean
// half-close.
func (l *delayLine) write(ctx context.Context, dst net.Conn) bool {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		c, ok := awaitDue(ctx, l.ch, func(c chunk) time.Time { return c.at }, timer)
		if !ok {
			if c.big != nil {
				bufPool.Put(c.big)
			}
			return false
		}
		switch {
		case c.eof:
			if cw, ok := dst.(interface{ CloseWrite() error }); ok && cw.CloseWrite() == nil {
				return true
			}
			return false
		case c.err != nil:
			return false
		}
		_, err := dst.Write(c.b)
		l.sem.Release(int64(len(c.b)))
		if c.big != nil {
			bufPool.Put(c.big)
		}
		if err != nil {
			return false
		}
	}
}
