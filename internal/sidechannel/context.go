package sidechannel

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/prometheus/client_golang/prometheus"
)

// ContextOptions configures a Context. The zero value works: no metrics
// registration, logs discarded.
type ContextOptions struct {
	// Registerer receives the side-channel metrics (see metrics.go). Nil:
	// metrics are kept but not registered.
	Registerer prometheus.Registerer
	// Logger is the default logger of clients and servers made on this
	// context. Nil: discard.
	Logger *slog.Logger
	// IOThreads is libzmq's I/O thread count; 0 keeps libzmq's default (1),
	// ample for the side channel's small messages.
	IOThreads int
	// CloseTimeout bounds how long Close waits for sockets still in use by
	// stragglers before giving up without terminating libzmq (which would
	// otherwise block forever). 0 means 5 s.
	CloseTimeout time.Duration
}

// Context is the process's one ZMQ context for the side channel. Create it
// once (NewContext), pass it to every NewClient and NewServer, and Close it
// last: Close closes every client and server still open on it, waits until
// all their sockets are closed, then terminates libzmq's context.
type Context struct {
	zctx    *zmq.Context
	log     *slog.Logger
	metrics *metrics
	timeout time.Duration

	open atomic.Int64 // sockets open now
	seq  atomic.Uint64

	mu      sync.Mutex
	cond    *sync.Cond // signalled when open drops to 0
	closed  bool
	owners  map[closer]struct{}
	closeMu sync.Mutex // serialises Close
	termErr error
	termed  bool

	zapMu sync.Mutex  // guards zap; taken before mu (startZAP calls newSocket), never after
	zap   *zapHandler // started by the first CURVE server, stopped by Close
}

type closer interface{ Close() error }

// NewContext creates the ZMQ context and registers the metrics.
func NewContext(opts ContextOptions) (*Context, error) {
	zctx, err := zmq.NewContext()
	if err != nil {
		return nil, fmt.Errorf("sidechannel: new zmq context: %w", err)
	}
	if opts.IOThreads > 0 {
		if err := zctx.SetIoThreads(opts.IOThreads); err != nil {
			_ = zctx.Term()
			return nil, fmt.Errorf("sidechannel: zmq io threads: %w", err)
		}
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c := &Context{
		zctx:    zctx,
		log:     log.With("component", "sidechannel"),
		timeout: opts.CloseTimeout,
		owners:  map[closer]struct{}{},
	}
	if c.timeout <= 0 {
		c.timeout = 5 * time.Second
	}
	c.cond = sync.NewCond(&c.mu)
	c.metrics = newMetrics(opts.Registerer, func() float64 { return float64(c.open.Load()) })
	return c, nil
}

// register adds an owner that Close must close first.
func (c *Context) register(o closer) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	c.owners[o] = struct{}{}
	return nil
}

func (c *Context) unregister(o closer) {
	c.mu.Lock()
	delete(c.owners, o)
	c.mu.Unlock()
}

// newSocket creates a socket with linger 0 (a closed socket never waits to
// flush: the side channel retries at the request level instead).
func (c *Context) newSocket(t zmq.Type) (*zmq.Socket, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, ErrClosed
	}
	c.open.Add(1) // under mu, so Close's wait sees it
	c.mu.Unlock()
	s, err := c.zctx.NewSocket(t)
	if err != nil {
		c.socketClosed()
		return nil, fmt.Errorf("sidechannel: new %v socket: %w", t, err)
	}
	if err := s.SetLinger(0); err != nil {
		_ = s.Close()
		c.socketClosed()
		return nil, fmt.Errorf("sidechannel: set linger: %w", err)
	}
	return s, nil
}

// closeSocket sets linger 0 (again: belt and braces) and closes s. Only the
// goroutine owning s may call it. Nil is ignored.
func (c *Context) closeSocket(s *zmq.Socket) {
	if s == nil {
		return
	}
	_ = s.SetLinger(0)
	if err := s.Close(); err != nil {
		c.log.Warn("zmq socket close failed", "err", err)
	}
	c.socketClosed()
}

func (c *Context) socketClosed() {
	if c.open.Add(-1) == 0 {
		c.mu.Lock()
		c.cond.Broadcast()
		c.mu.Unlock()
	}
}

// OpenSockets reports how many sockets are open on the context.
func (c *Context) OpenSockets() int { return int(c.open.Load()) }

// inprocAddr returns a fresh inproc endpoint name (for wake-up pairs).
func (c *Context) inprocAddr(kind string) string {
	return fmt.Sprintf("inproc://kvflow-sidechannel-%p-%s-%d", c, kind, c.seq.Add(1))
}

// newPair makes a connected inproc PAIR: recv is bound, send connected to
// it; a wake-up channel for a goroutine polling other sockets. On error
// neither socket is left open.
func (c *Context) newPair(kind string) (recv, send *zmq.Socket, err error) {
	addr := c.inprocAddr(kind)
	if recv, err = c.newSocket(zmq.PAIR); err != nil {
		return nil, nil, err
	}
	if err = recv.Bind(addr); err != nil {
		c.closeSocket(recv)
		return nil, nil, fmt.Errorf("sidechannel: bind %s: %w", addr, err)
	}
	if send, err = c.newSocket(zmq.PAIR); err != nil {
		c.closeSocket(recv)
		return nil, nil, err
	}
	if err = send.Connect(addr); err != nil {
		c.closeSocket(send)
		c.closeSocket(recv)
		return nil, nil, fmt.Errorf("sidechannel: connect %s: %w", addr, err)
	}
	return recv, send, nil
}

// Close closes every client and server still open on c, waits (up to
// ContextOptions.CloseTimeout) for all sockets to close, then terminates the
// ZMQ context. It is idempotent. If sockets are still open after the
// timeout it returns an error and leaves libzmq's context unterminated
// rather than hang.
func (c *Context) Close() error {
	c.closeMu.Lock()
	defer c.closeMu.Unlock()
	if c.termed {
		return c.termErr
	}
	c.mu.Lock()
	c.closed = true
	owners := make([]closer, 0, len(c.owners))
	for o := range c.owners {
		owners = append(owners, o)
	}
	c.mu.Unlock()
	var errs []error
	for _, o := range owners {
		if err := o.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	c.stopZAP() // every server is closed: no handshake needs it now
	if n := c.waitSockets(); n > 0 {
		errs = append(errs, fmt.Errorf("sidechannel: %d sockets still open after %v; zmq context not terminated", n, c.timeout))
		return errors.Join(errs...) // not termed: a later Close may retry
	}
	if err := c.zctx.Term(); err != nil {
		errs = append(errs, fmt.Errorf("sidechannel: terminate zmq context: %w", err))
	}
	c.termed = true
	c.termErr = errors.Join(errs...)
	return c.termErr
}

// waitSockets waits until no socket is open or the close timeout passes and
// returns the number still open.
func (c *Context) waitSockets() int64 {
	deadline := time.Now().Add(c.timeout)
	timer := time.AfterFunc(c.timeout, func() {
		c.mu.Lock()
		c.cond.Broadcast()
		c.mu.Unlock()
	})
	defer timer.Stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.open.Load() > 0 && time.Now().Before(deadline) {
		c.cond.Wait()
	}
	return c.open.Load()
}
