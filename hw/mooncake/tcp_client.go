package mooncake

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// BatchRead implements Engine.
func (e *TCPEngine) BatchRead(ctx context.Context, session string, ops []Op) error {
	return e.batch(ctx, session, ops, OpcodeRead)
}

// BatchWrite implements Engine.
func (e *TCPEngine) BatchWrite(ctx context.Context, session string, ops []Op) error {
	return e.batch(ctx, session, ops, OpcodeWrite)
}

// batch is one BatchRead/BatchWrite call in flight.
type batch struct {
	ctx       context.Context
	opcode    uint8
	left      []atomic.Int32 // requests still outstanding per op
	pending   atomic.Int64   // requests still outstanding in all
	done      chan struct{}  // closed when pending reaches zero
	failed    atomic.Bool    // some op failed: skip what has not started
	cancelled atomic.Bool    // ctx is done

	mu   sync.Mutex
	errs []error

	// Guarded by the peer's queue lock.
	tasks  []task // every request of the batch
	issued int    // tasks[:issued] have been taken by a lane
}

func (b *batch) fail(i int, err error) {
	b.mu.Lock()
	if b.errs[i] == nil {
		b.errs[i] = err
	}
	b.mu.Unlock()
	if !errors.Is(err, ErrNotAttempted) {
		b.failed.Store(true)
	}
}

// finish ends one request of op i (err nil on success).
func (b *batch) finish(i int, err error) {
	if err != nil {
		b.fail(i, err)
	}
	b.left[i].Add(-1)
	if b.pending.Add(-1) == 0 {
		close(b.done)
	}
}

// task is one request on the wire: an op, or a ChunkSize piece of one.
type task struct {
	b                     *batch
	op                    int
	local, remote, length uint64
}

func dirName(opcode uint8) string {
	if opcode == OpcodeWrite {
		return dirWrite
	}
	return dirRead
}

func (e *TCPEngine) batch(ctx context.Context, session string, ops []Op, opcode uint8) (err error) {
	dir := dirName(opcode)
	start := time.Now()
	defer func() {
		outcome := "ok"
		if err != nil {
			outcome = "error"
		}
		e.m.batch.WithLabelValues(dir, outcome).Observe(time.Since(start).Seconds())
	}()
	if len(ops) == 0 {
		return nil
	}
	b := &batch{ctx: ctx, opcode: opcode, left: make([]atomic.Int32, len(ops)), done: make(chan struct{}), errs: make([]error, len(ops))}
	batchErr := func() error {
		return &BatchError{Session: session, Dir: dir, Ops: ops, Errs: b.errs}
	}
	failAll := func(err error) error {
		for i := range b.errs {
			if b.errs[i] == nil {
				b.errs[i] = err
			}
		}
		return batchErr()
	}

	// Validate and pin every local range before any I/O: a bad op fails the
	// batch without touching the network.
	pins := make([]*region, 0, len(ops))
	defer func() {
		for _, r := range pins {
			r.unpin()
		}
	}()
	bad := false
	for i, op := range ops {
		if err := checkRange(op.Remote, op.Length); err != nil {
			b.errs[i], bad = fmt.Errorf("remote: %w", err), true
			continue
		}
		r, err := e.regions.pin(op.Local, op.Length)
		if err != nil {
			b.errs[i], bad = fmt.Errorf("local: %w", err), true
			continue
		}
		pins = append(pins, r)
	}
	if bad {
		return failAll(ErrNotAttempted)
	}
	if err := ctx.Err(); err != nil {
		return failAll(err)
	}

	p, err := e.peer(ctx, session)
	if err != nil {
		return failAll(err)
	}

	// Split into requests of at most ChunkSize.
	chunk := uint64(e.cfg.ChunkSize)
	var tasks []task
	for i, op := range ops {
		for off := uint64(0); off < op.Length; off += chunk {
			n := min(chunk, op.Length-off)
			tasks = append(tasks, task{b: b, op: i, local: op.Local + off, remote: op.Remote + off, length: n})
			b.left[i].Add(1)
		}
	}
	b.tasks = tasks
	b.pending.Store(int64(len(tasks)))

	stop := context.AfterFunc(ctx, func() {
		b.cancelled.Store(true)
		// Requests no lane has taken yet end here; those in flight are
		// aborted by their lanes.
		for _, t := range p.q.withdraw(b) {
			b.finish(t.op, ctx.Err())
		}
		for _, l := range p.lanes {
			l.interrupt(b)
		}
	})
	defer stop()

	if err := p.q.add(ctx, e.done, b); err != nil {
		for _, t := range tasks {
			b.finish(t.op, err)
		}
	}

	select {
	case <-b.done:
	case <-e.stopped:
		// Every lane has returned: nothing touches our memory any more.
		for i := range ops {
			if b.left[i].Load() > 0 {
				b.fail(i, ErrClosed)
			}
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, opErr := range b.errs {
		if opErr != nil {
			return batchErr()
		}
	}
	return nil
}

// queue is a peer's requests not yet taken by a lane, kept per batch.
// Lanes take from the batches round-robin, one request at a time, so a
// small batch submitted behind a large one waits for about one request
// per lane, not for the whole large batch (no head-of-line blocking).
type queue struct {
	depth int           // admission bound on queued requests
	kick  chan struct{} // capacity Lanes: a token wakes one idle lane

	mu     sync.Mutex
	ring   []*batch      // batches with requests not yet taken, in turn order
	next   int           // ring index whose batch the next take serves
	queued int           // requests not yet taken, over all of ring
	room   chan struct{} // closed (and replaced) when queued drops below depth
}

func newQueue(depth, lanes int) *queue {
	return &queue{depth: depth, kick: make(chan struct{}, lanes), room: make(chan struct{})}
}

// add queues all of b's requests; it waits (ctx, done permitting) while
// depth requests are already queued on the peer. b is served next.
func (q *queue) add(ctx context.Context, done <-chan struct{}, b *batch) error {
	q.mu.Lock()
	for q.queued >= q.depth {
		room := q.room
		q.mu.Unlock()
		select {
		case <-room:
		case <-ctx.Done():
			return ctx.Err()
		case <-done:
			return ErrClosed
		}
		q.mu.Lock()
	}
	if q.next > len(q.ring) {
		q.next = 0
	}
	q.ring = append(q.ring, nil)
	copy(q.ring[q.next+1:], q.ring[q.next:])
	q.ring[q.next] = b
	q.queued += len(b.tasks)
	q.mu.Unlock()
	// Wake up to one idle lane per request. A token that does not fit
	// is not needed: Lanes tokens already pending wake every idle lane,
	// and a woken lane keeps taking until the queue is empty.
	for range min(len(b.tasks), cap(q.kick)) {
		select {
		case q.kick <- struct{}{}:
		default:
		}
	}
	return nil
}

// take returns the next request of the next batch in turn, or nil.
func (q *queue) take() *task {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.ring) == 0 {
		return nil
	}
	if q.next >= len(q.ring) {
		q.next = 0
	}
	b := q.ring[q.next]
	t := &b.tasks[b.issued]
	b.issued++
	if b.issued == len(b.tasks) {
		q.removeAt(q.next) // next now names the following batch
	} else {
		q.next++
	}
	q.dequeued(1)
	return t
}

// withdraw removes b from the queue and returns its requests no lane has
// taken.
func (q *queue) withdraw(b *batch) []task {
	q.mu.Lock()
	defer q.mu.Unlock()
	for i, o := range q.ring {
		if o == b {
			rest := b.tasks[b.issued:]
			b.issued = len(b.tasks)
			q.removeAt(i)
			q.dequeued(len(rest))
			return rest
		}
	}
	return nil
}

func (q *queue) removeAt(i int) {
	copy(q.ring[i:], q.ring[i+1:])
	q.ring[len(q.ring)-1] = nil
	q.ring = q.ring[:len(q.ring)-1]
	if i < q.next {
		q.next--
	}
}

func (q *queue) dequeued(n int) {
	was := q.queued
	q.queued -= n
	if was >= q.depth && q.queued < q.depth {
		close(q.room)
		q.room = make(chan struct{})
	}
}

// peer is the initiator side of one session: its segment descriptor and
// its lanes, which take requests from q.
type peer struct {
	e       *TCPEngine
	session string
	host    string
	rpcPort int
	q       *queue
	lanes   []*lane

	mu       sync.Mutex // guards the fields below; held during a handshake
	desc     *SegmentDesc
	dataAddr string
	stale    bool // a data dial failed: handshake again before the next batch
}

func parseSession(session string) (string, int, error) {
	host, port, err := net.SplitHostPort(session)
	if err != nil {
		return "", 0, fmt.Errorf("%w %q: %v", ErrSession, session, err)
	}
	n, err := strconv.Atoi(port)
	if err != nil || n <= 0 || n > 65535 || host == "" {
		return "", 0, fmt.Errorf("%w %q: want host:port", ErrSession, session)
	}
	return host, n, nil
}

// peer returns the session's peer, handshaking when it is new or stale.
func (e *TCPEngine) peer(ctx context.Context, session string) (*peer, error) {
	host, port, err := parseSession(session)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil, ErrClosed
	}
	p := e.peers[session]
	if p == nil {
		p = &peer{e: e, session: session, host: host, rpcPort: port, q: newQueue(e.cfg.QueueDepth, e.cfg.Lanes)}
		for i := range e.cfg.Lanes {
			l := &lane{p: p, id: i}
			p.lanes = append(p.lanes, l)
			e.wg.Add(1)
			go l.run()
		}
		e.peers[session] = p
	}
	e.mu.Unlock()

	p.mu.Lock()
	defer p.mu.Unlock()
	if p.desc != nil && !p.stale {
		return p, nil
	}
	d, err := e.handshake(ctx, host, port)
	if err != nil {
		return nil, fmt.Errorf("handshake %s: %w", session, err)
	}
	p.desc, p.stale = d, false
	p.dataAddr = net.JoinHostPort(host, strconv.Itoa(d.TCPDataPort))
	e.log.Debug("handshake done", "peer", session, "data_port", d.TCPDataPort, "proto_version", d.TCPProtoVersion, "buffers", len(d.Buffers))
	return p, nil
}

// handshake exchanges segment descriptors over the peer's RPC port: a
// Metadata frame with ours, a Metadata frame with theirs.
func (e *TCPEngine) handshake(ctx context.Context, host string, port int) (*SegmentDesc, error) {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.HandshakeTimeout)
	defer cancel()
	defer context.AfterFunc(e.ctx, cancel)()
	d := net.Dialer{Timeout: e.cfg.ConnectTimeout}
	c, err := d.DialContext(ctx, "tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		return nil, err
	}
	defer c.Close()
	deadline, _ := ctx.Deadline()
	c.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if _, err := c.Write(AppendFrame(nil, FrameMetadata, EncodeSegment(e.Segment()))); err != nil {
		return nil, fmt.Errorf("send metadata: %w", err)
	}
	t, payload, err := ReadFrame(c, e.cfg.MaxFrame)
	if err != nil {
		return nil, fmt.Errorf("receive metadata: %w", err)
	}
	if t != FrameMetadata {
		return nil, fmt.Errorf("%w: reply of type %s to a metadata request", ErrFrameType, t)
	}
	return DecodeSegment(payload)
}

// target returns the data address and framing to use.
func (p *peer) target() (string, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dataAddr, p.desc != nil && p.desc.TCPProtoVersion >= 2
}

func (p *peer) markStale() {
	p.mu.Lock()
	p.stale = true
	p.mu.Unlock()
}

// lane is one persistent data connection to a peer, owned by one
// goroutine that serves requests one at a time.
type lane struct {
	p  *peer
	id int

	mu      sync.Mutex // guards conn, closing and deadline updates
	conn    net.Conn
	v2      bool
	closing bool
	cur     atomic.Pointer[batch]
}

func (l *lane) run() {
	e := l.p.e
	defer e.wg.Done()
	defer l.dropConn()
	for {
		select {
		case <-e.done:
			return
		default:
		}
		if t := l.p.q.take(); t != nil {
			l.do(t)
			continue
		}
		select {
		case <-e.done:
			return
		case <-l.p.q.kick:
		}
	}
}

// shutdown makes any blocked I/O return; run then exits on e.done.
func (l *lane) shutdown() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closing = true
	if l.conn != nil {
		l.conn.SetDeadline(time.Unix(1, 0))
	}
}

// interrupt aborts the lane's request if it belongs to b (cancelled).
func (l *lane) interrupt(b *batch) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cur.Load() == b && l.conn != nil {
		l.conn.SetDeadline(time.Unix(1, 0))
	}
}

// arm sets the progress deadline for the next chunk, unless the request
// was cancelled or the engine is closing. Serialised with interrupt and
// shutdown by l.mu, so an abort cannot be overwritten.
func (l *lane) arm(b *batch) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.closing:
		return ErrClosed
	case b.cancelled.Load():
		return context.Cause(b.ctx)
	}
	return l.conn.SetDeadline(time.Now().Add(l.p.e.cfg.IOTimeout))
}

func (l *lane) dropConn() {
	l.mu.Lock()
	c := l.conn
	l.conn = nil
	l.mu.Unlock()
	if c != nil {
		c.Close()
		l.p.e.m.conns.WithLabelValues(roleInitiator).Dec()
	}
}

func (l *lane) dial(b *batch) error {
	e := l.p.e
	addr, v2 := l.p.target()
	ctx, cancel := context.WithTimeout(b.ctx, e.cfg.ConnectTimeout)
	defer cancel()
	defer context.AfterFunc(e.ctx, cancel)()
	d := net.Dialer{}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		l.p.markStale()
		return fmt.Errorf("connect %s: %w", addr, err)
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	l.mu.Lock()
	if l.closing {
		l.mu.Unlock()
		c.Close()
		return ErrClosed
	}
	l.conn, l.v2 = c, v2
	l.mu.Unlock()
	e.m.conns.WithLabelValues(roleInitiator).Inc()
	return nil
}

func (l *lane) do(t *task) {
	b := t.b
	l.cur.Store(b)
	defer l.cur.Store(nil)
	switch {
	case b.cancelled.Load():
		b.finish(t.op, context.Cause(b.ctx))
		return
	case b.failed.Load():
		b.finish(t.op, ErrNotAttempted)
		return
	}
	if l.conn == nil {
		if err := l.dial(b); err != nil {
			b.finish(t.op, err)
			return
		}
	}
	err := l.transfer(t)
	if err != nil {
		// The stream is in an unknown state: start afresh next time.
		l.dropConn()
		err = l.explain(b, err)
	} else {
		dir := dirName(b.opcode)
		l.p.e.m.bytes.WithLabelValues(dir).Add(float64(t.length))
		l.p.e.m.ops.WithLabelValues(dir).Inc()
	}
	b.finish(t.op, err)
}

// explain turns an I/O error into the reason the caller cares about.
func (l *lane) explain(b *batch, err error) error {
	switch {
	case b.cancelled.Load():
		return context.Cause(b.ctx)
	case l.isClosing():
		return ErrClosed
	case errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Errorf("%s: no progress for %v: %w", l.p.session, l.p.e.cfg.IOTimeout, err)
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		if !l.v2 {
			return fmt.Errorf("%s: %w (a legacy peer closes instead of rejecting)", l.p.session, ErrPeerClosed)
		}
		return fmt.Errorf("%s: %w", l.p.session, ErrPeerClosed)
	}
	return fmt.Errorf("%s: %w", l.p.session, err)
}

func (l *lane) isClosing() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closing
}

// transfer runs one request. Reads land straight in the local memory;
// writes go out of it; socket I/O is never larger than ChunkSize.
func (l *lane) transfer(t *task) error {
	b, c := t.b, l.conn
	mem := bytesAt(t.local, t.length)
	chunk := l.p.e.cfg.ChunkSize
	var hb [HeaderSize]byte
	PutHeader(&hb, Header{Size: t.length, Addr: t.remote, Opcode: b.opcode, V2: l.v2})
	if err := l.arm(b); err != nil {
		return err
	}
	if b.opcode == OpcodeRead {
		if _, err := c.Write(hb[:]); err != nil {
			return err
		}
		if l.v2 {
			if err := readStatus(c); err != nil {
				return err
			}
		}
		for off := 0; off < len(mem); off += chunk {
			if off > 0 {
				if err := l.arm(b); err != nil {
					return err
				}
			}
			if _, err := io.ReadFull(c, mem[off:min(off+chunk, len(mem))]); err != nil {
				return err
			}
		}
		return nil
	}
	first := min(len(mem), chunk)
	bufs := net.Buffers{hb[:], mem[:first]}
	_, err := bufs.WriteTo(c)
	for off := first; err == nil && off < len(mem); off += chunk {
		if err = l.arm(b); err == nil {
			_, err = c.Write(mem[off:min(off+chunk, len(mem))])
		}
	}
	if !l.v2 {
		return err // legacy framing: no acknowledgement exists
	}
	if err != nil {
		// A refused write: the status may be waiting before the close.
		c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		if serr := readStatus(c); errors.Is(serr, ErrRejected) {
			return serr
		}
		return err
	}
	if err := l.arm(b); err != nil {
		return err
	}
	return readStatus(c)
}

func readStatus(c net.Conn) error {
	var st [StatusSize]byte
	if _, err := io.ReadFull(c, st[:]); err != nil {
		return err
	}
	return ParseStatus(&st)
}
