package mooncake

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

// BatchRead implements Engine.
func (e *TCPEngine) BatchRead(ctx context.Context, session string, ops []Op) error {
	return e.batch(ctx, session, ops, OpcodeRead, Stride{}, Stride{})
}

// BatchReadGather implements GatherReader. To a peer whose handshake
// advertised kvflow's strided READ (KvflowOpStridedRead) each op goes out
// as strided requests of whole rows, up to ChunkSize each, answered
// contiguously; to any other peer (Mooncake's engines, kvflow with
// NoKvflowOps) as one READ per row.
func (e *TCPEngine) BatchReadGather(ctx context.Context, session string, ops []Op, g Stride) error {
	if err := g.Validate(ops); err != nil {
		errs := make([]error, len(ops))
		for i := range errs {
			errs[i] = fmt.Errorf("%w: %w", ErrNotAttempted, err)
		}
		return &BatchError{Session: session, Dir: dirRead, Ops: ops, Errs: errs}
	}
	return e.batch(ctx, session, ops, OpcodeRead, Stride{}, g)
}

// BatchReadStrided implements StridedReader. The wire requests are the
// same as BatchRead's (the peer sees contiguous READs); only where the
// answer lands differs: it is copied out of the lane's buffer row by row.
func (e *TCPEngine) BatchReadStrided(ctx context.Context, session string, ops []Op, s Stride) error {
	if err := s.Validate(ops); err != nil {
		errs := make([]error, len(ops))
		for i := range errs {
			errs[i] = fmt.Errorf("%w: %w", ErrNotAttempted, err)
		}
		return &BatchError{Session: session, Dir: dirRead, Ops: ops, Errs: errs}
	}
	return e.batch(ctx, session, ops, OpcodeRead, s, Stride{})
}

// BatchWrite implements Engine.
func (e *TCPEngine) BatchWrite(ctx context.Context, session string, ops []Op) error {
	return e.batch(ctx, session, ops, OpcodeWrite, Stride{}, Stride{})
}

// batch is one BatchRead/BatchWrite call in flight.
type batch struct {
	ctx       context.Context
	opcode    uint8
	stride    Stride         // Row > 0: READ answers land in strided rows
	gather    Stride         // Row > 0: READs come from strided remote rows
	left      []atomic.Int32 // requests still outstanding per op
	pending   atomic.Int64   // requests still outstanding in all
	done      chan struct{}  // closed when pending reaches zero
	failed    atomic.Bool    // some op failed: skip what has not started
	cancelled atomic.Bool    // ctx is done

	mu   sync.Mutex
	errs []error

	// Guarded by the peer's queue lock.
	tasks   []task // every request of the batch
	issued  int    // tasks[:issued] have been taken by a lane
	untaken uint64 // bytes of tasks[issued:]
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

// task is one request on the wire: an op, a ChunkSize piece of one, or
// several READ ops merged (segs).
type task struct {
	b                     *batch
	op                    int
	local, remote, length uint64
	// segs, when set, are the local ranges of the READ ops merged into
	// this request, in order: their remote ranges follow one another from
	// remote, and the answer is scattered over them (local and op are
	// then the first one's).
	segs  []seg
	tries int // times sent again after another request broke its lane
	// strided: a kvflow strided READ of length/b.gather.Row rows from
	// remote (OpcodeReadStrided), answered contiguously into local.
	strided bool
}

// seg is one op's local range within a merged READ: length bytes from
// local, or with a stride, bytes [off, off+length) of the op whose rows
// start at local.
type seg struct {
	op                 int
	local, length, off uint64
}

// pieces is how many finish calls t owes its batch: one per op it covers.
func (t *task) pieces() int {
	if t.segs == nil {
		return 1
	}
	return len(t.segs)
}

// finish ends t's part of every op it covers (err nil on success).
func (t *task) finish(err error) {
	if t.segs == nil {
		t.b.finish(t.op, err)
		return
	}
	for _, sg := range t.segs {
		t.b.finish(sg.op, err)
	}
}

func dirName(opcode uint8) string {
	if opcode == OpcodeWrite {
		return dirWrite
	}
	return dirRead
}

func (e *TCPEngine) batch(ctx context.Context, session string, ops []Op, opcode uint8, stride, gather Stride) (err error) {
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
	b := &batch{ctx: ctx, opcode: opcode, stride: stride, gather: gather, left: make([]atomic.Int32, len(ops)), done: make(chan struct{}), errs: make([]error, len(ops))}
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
		remote := op.Length
		if gather.Row > 0 {
			remote = gather.Extent(op.Length)
		}
		if err := checkRange(op.Remote, remote); err != nil {
			b.errs[i], bad = fmt.Errorf("remote: %w", err), true
			continue
		}
		extent := op.Length
		if stride.Row > 0 {
			extent = stride.Extent(op.Length)
		}
		r, err := e.regions.pin(op.Local, extent)
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

	bufs, strided := p.layout()
	var tasks []task
	if gather.Row > 0 {
		tasks = splitGather(b, ops, uint64(e.cfg.ChunkSize), strided && !e.cfg.NoKvflowOps)
	} else {
		tasks = splitOps(b, ops, uint64(e.cfg.ChunkSize), bufs)
	}
	b.tasks = tasks
	pieces := 0
	for i := range tasks {
		pieces += tasks[i].pieces()
	}
	b.pending.Store(int64(pieces))

	stop := context.AfterFunc(ctx, func() {
		b.cancelled.Store(true)
		// Requests no lane has taken yet end here; those in flight are
		// aborted by their lanes.
		for _, t := range p.q.withdraw(b) {
			t.finish(ctx.Err())
		}
		for _, l := range p.lanes {
			l.interrupt(b)
		}
	})
	defer stop()

	if err := p.q.add(ctx, e.done, b); err != nil {
		for _, t := range tasks {
			t.finish(err)
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

// splitOps turns a batch's ops into requests of at most chunk bytes.
// An op longer than chunk is split. READ ops shorter than chunk whose
// remote ranges follow one another inside one of the peer's registered
// buffers (bufs, from its segment descriptor; nil merges nothing) are
// merged into one request of at most chunk bytes whose answer is
// scattered over their local ranges: with P > 1 the planner reads every
// block of a prefill rank's contiguous cache into its own strided place,
// one op per block, and merging sends one header and reads one status per
// run instead of one per block, and lets the target answer with one large
// write. A merged request never crosses a remote buffer's end, so a
// target that checks each request against its registrations (Mooncake's
// does) accepts it. Each op's outstanding count (b.left) is set.
func splitOps(b *batch, ops []Op, chunk uint64, bufs []BufferDesc) []task {
	tasks := make([]task, 0, len(ops))
	var segs []seg // backing for every merged task's segs
	for i := 0; i < len(ops); {
		op := ops[i]
		j := i + 1
		if b.opcode == OpcodeRead && op.Length < chunk {
			if end, ok := bufferEnd(bufs, op.Remote); ok {
				total := op.Length
				for j < len(ops) && ops[j].Remote == ops[j-1].Remote+ops[j-1].Length &&
					total+ops[j].Length <= chunk && ops[j].Remote+ops[j].Length <= end {
					total += ops[j].Length
					j++
				}
				if j-i > 1 {
					if segs == nil {
						segs = make([]seg, 0, len(ops)-i)
					}
					start := len(segs)
					for k := i; k < j; k++ {
						segs = append(segs, seg{op: k, local: ops[k].Local, length: ops[k].Length})
						b.left[k].Add(1)
					}
					tasks = append(tasks, task{b: b, op: i, local: op.Local, remote: op.Remote, length: total,
						segs: segs[start:len(segs):len(segs)]})
					i = j
					continue
				}
				j = i + 1
			}
		}
		for off := uint64(0); off < op.Length; off += chunk {
			n := min(chunk, op.Length-off)
			t := task{b: b, op: i, local: op.Local + off, remote: op.Remote + off, length: n}
			if b.stride.Row > 0 { // where the piece lands is computed per row
				t.local = op.Local
				t.segs = []seg{{op: i, local: op.Local, length: n, off: off}}
			}
			tasks = append(tasks, t)
			b.left[i].Add(1)
		}
		i = j
	}
	return tasks
}

// splitGather turns a gather batch's ops (b.gather) into requests: with
// strided on (the peer serves kvflow's strided READ), requests of whole
// rows and at most chunk bytes (at least one row); otherwise one READ per
// row, split at chunk. Each op's outstanding count (b.left) is set.
func splitGather(b *batch, ops []Op, chunk uint64, strided bool) []task {
	g := b.gather
	per := max(1, chunk/g.Row) // rows per strided request
	n := 0
	for _, op := range ops {
		rows := op.Length / g.Row
		if strided {
			n += int((rows + per - 1) / per)
		} else {
			n += int(rows * ((g.Row + chunk - 1) / chunk))
		}
	}
	tasks := make([]task, 0, n)
	for i, op := range ops {
		rows := op.Length / g.Row
		for r := uint64(0); r < rows; {
			if strided {
				k := min(per, rows-r)
				tasks = append(tasks, task{b: b, op: i, local: op.Local + r*g.Row, remote: op.Remote + r*g.Pitch, length: k * g.Row, strided: true})
				b.left[i].Add(1)
				r += k
				continue
			}
			for off := uint64(0); off < g.Row; off += chunk {
				tasks = append(tasks, task{b: b, op: i, local: op.Local + r*g.Row + off, remote: op.Remote + r*g.Pitch + off, length: min(chunk, g.Row-off)})
				b.left[i].Add(1)
			}
			r++
		}
	}
	return tasks
}

// bufferEnd returns the end of the buffer of bufs that holds addr.
func bufferEnd(bufs []BufferDesc, addr uint64) (uint64, bool) {
	for _, bd := range bufs {
		if addr >= bd.Addr && addr-bd.Addr < bd.Length {
			return bd.Addr + bd.Length, true
		}
	}
	return 0, false
}

// queue is a peer's requests not yet taken by a lane, kept per batch.
//
// Lanes take from the batch with the fewest bytes not yet taken (shortest
// remaining first; ties go to the older batch), so a small batch submitted
// behind large ones waits only for the requests already on the lanes, and
// of several large batches the one closest to done finishes first instead
// of all finishing late together. Aging is by bytes: once the other
// batches have had agingEvery-1 times the oldest batch's next request in
// bytes since it was last served, the oldest is served, so a stream of
// small batches slows a large one down to 1/agingEvery of the bytes but
// never starves it.
type queue struct {
	depth int           // admission bound on queued requests
	kick  chan struct{} // capacity Lanes: a token wakes one idle lane

	mu     sync.Mutex
	ring   []*batch      // batches with requests not yet taken, oldest first
	others uint64        // bytes taken from other batches since the oldest was served
	queued int           // requests not yet taken, over all of ring
	room   chan struct{} // closed (and replaced) when queued drops below depth
}

// agingEvery: the oldest batch gets at least 1/agingEvery of the bytes
// taken while others are chosen before it. 8: a stream of small batches
// keeps 7/8 of the link. Counted in requests (as before: one take in
// eight), 4 MiB requests of a large batch against 256 KiB ones of small
// batches took ~70% of the bytes, and 1-block reads arriving at a third
// of a slow link's rate queued behind each other for 100-240 ms.
const agingEvery = 8

func newQueue(depth, lanes int) *queue {
	return &queue{depth: depth, kick: make(chan struct{}, lanes), room: make(chan struct{})}
}

// add queues all of b's requests; it waits (ctx, done permitting) while
// depth requests are already queued on the peer, unless b is shorter than
// every queued batch: the lanes would take b first anyway, so it adds to
// no queued batch's wait, and making it wait would hold a small transfer
// behind the bulk of large ones (a 1-block read waited for ~256 MiB of
// 128-block reads to drain below depth). Callers bound how many batches
// are in flight, so this does not unbound the queue.
func (q *queue) add(ctx context.Context, done <-chan struct{}, b *batch) error {
	var size uint64
	for i := range b.tasks {
		size += b.tasks[i].length
	}
	q.mu.Lock()
	for q.queued >= q.depth && !q.shorterThanAll(size) {
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
	b.untaken = size
	q.ring = append(q.ring, b)
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

// shorterThanAll: size is fewer bytes than every queued batch has not yet
// had taken (so shortest-first would serve it before all of them).
func (q *queue) shorterThanAll(size uint64) bool {
	for _, o := range q.ring {
		if size >= o.untaken {
			return false
		}
	}
	return true
}

// take returns the next request (see queue), or nil.
func (q *queue) take() *task {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.ring) == 0 {
		return nil
	}
	i := 0 // the oldest
	for k, b := range q.ring[1:] {
		if b.untaken < q.ring[i].untaken {
			i = k + 1
		}
	}
	if old := q.ring[0]; i != 0 && q.others >= (agingEvery-1)*old.tasks[old.issued].length {
		i = 0 // its aging turn
	}
	b := q.ring[i]
	t := &b.tasks[b.issued]
	if i == 0 {
		q.others = 0
	} else {
		q.others += t.length
	}
	b.issued++
	b.untaken -= t.length
	if b.issued == len(b.tasks) {
		q.removeAt(i)
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
			b.issued, b.untaken = len(b.tasks), 0
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
	if q.queued >= q.depth {
		// Still full, but a batch left: a waiting batch may now be
		// shorter than every one queued (add's exception), so waiters
		// look again.
		q.wake()
	}
}

// wake lets every add waiting for room check again.
func (q *queue) wake() {
	close(q.room)
	q.room = make(chan struct{})
}

func (q *queue) dequeued(n int) {
	was := q.queued
	q.queued -= n
	if was >= q.depth && q.queued < q.depth {
		q.wake()
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

	// gen counts the peer's re-handshakes (written under mu, read by the
	// lanes without it). A re-handshake means the peer may be another
	// process now (a restart on the same RPC port: other buffers, another
	// data port, or the same port with none of our connections): a lane
	// whose connection was dialed at an older generation drops it before
	// it next takes a request on an idle connection (lane.admit), so a
	// batch after the re-handshake never goes out on the old process's
	// connections. Checked once per lane acquisition, not per op.
	gen atomic.Uint64
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
	if p.desc != nil {
		// A re-handshake (the peer was marked stale): every lane redials.
		p.gen.Add(1)
	}
	p.desc, p.stale = d, false
	p.dataAddr = net.JoinHostPort(host, strconv.Itoa(d.TCPDataPort))
	e.log.Debug("handshake done", "peer", session, "data_port", d.TCPDataPort, "proto_version", d.TCPProtoVersion, "buffers", len(d.Buffers))
	return p, nil
}

// PeerBuffers implements SegmentReader: the registered buffers of
// session's segment descriptor, from the handshake the next batch to the
// session uses too.
func (e *TCPEngine) PeerBuffers(ctx context.Context, session string) ([]BufferDesc, error) {
	p, err := e.peer(ctx, session)
	if err != nil {
		return nil, err
	}
	return p.buffers(), nil
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
	if cred, ok := e.credential(host, port); ok {
		if err := authenticateTo(c, &cred, authPortRPC); err != nil {
			return nil, err
		}
	}
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

// target returns the data address and framing to use, whether the peer
// serves kvflow's strided READ, and the handshake generation they belong
// to.
func (p *peer) target() (addr string, v2, strided bool, gen uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	v2 = p.desc != nil && p.desc.TCPProtoVersion >= 2
	strided = v2 && p.desc.KvflowOps&KvflowOpStridedRead != 0 && !p.e.cfg.NoKvflowOps
	return p.dataAddr, v2, strided, p.gen.Load()
}

// layout returns the peer's registered buffers (see buffers) and whether
// it serves kvflow's strided READ (its descriptor advertised it, with
// status frames).
func (p *peer) layout() ([]BufferDesc, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.desc == nil {
		return nil, false
	}
	return p.desc.Buffers, p.desc.KvflowOps&KvflowOpStridedRead != 0 && p.desc.TCPProtoVersion >= 2
}

// buffers returns the peer's registered buffers from its segment
// descriptor (nil before the first handshake). The slice is the
// descriptor's own: a new handshake replaces the descriptor, never edits
// it.
func (p *peer) buffers() []BufferDesc {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.desc == nil {
		return nil
	}
	return p.desc.Buffers
}

func (p *peer) markStale() {
	p.mu.Lock()
	p.stale = true
	p.mu.Unlock()
}

// errStridedGone: a strided READ for a peer whose current handshake no
// longer advertises the op.
var errStridedGone = errors.New("peer no longer serves kvflow's strided READ (re-handshaken); read again")

// errAborted: interrupt cut the lane's connection because a batch with a
// request on it was cancelled.
var errAborted = errors.New("lane aborted for a cancelled batch")

// maxRetries bounds how often one request is sent again after its lane's
// connection broke because of another request (a refusal, a peer close).
const maxRetries = 2

// lane is one persistent data connection to a peer, owned by one
// goroutine. READs are pipelined: the lane keeps up to Pipeline of them
// outstanding (header sent, response not yet consumed) and consumes their
// status frames and data in order, which the target serves one after
// another. A WRITE waits until no READ is outstanding and then runs alone.
type lane struct {
	p  *peer
	id int

	mu      sync.Mutex // guards the fields below and deadline updates
	conn    net.Conn
	v2      bool
	strided bool // conn's peer advertised kvflow's strided READ (at dial)
	closing bool
	aborted bool      // interrupt cut conn for a cancelled batch
	win     []*task   // requests sent on conn and not yet finished, oldest first
	armedAt time.Time // when arm last moved conn's deadline (zero: never, on this conn)
	gen     uint64    // the peer's handshake generation conn was dialed at (peer.gen)

	// Owned by the lane's goroutine.
	retry  []*task       // requests to send again, before new ones
	hdrs   []byte        // headers of win's newest requests, not yet written
	wbytes uint64        // bytes of the READs in win
	br     *bufio.Reader // conn's responses; small ones arrive several per read
}

// laneBuf is the size of a lane's response buffer: responses smaller than
// it are copied out of it (several per socket read when pipelined), larger
// ones are read straight into local memory once it is drained.
const laneBuf = 64 << 10

func (l *lane) run() {
	e := l.p.e
	defer e.wg.Done()
	defer l.dropConn()
	depth := e.cfg.Pipeline
	capBytes := uint64(e.cfg.PipelineBytes)
	var held *task // a WRITE waiting for the outstanding READs
	for {
		select {
		case <-e.done:
			return
		default:
		}
		for held == nil && len(l.win) < depth && (len(l.win) < 2 || capBytes == 0 || l.wbytes < capBytes) {
			t := l.next()
			if t == nil {
				break
			}
			if t.b.opcode == OpcodeWrite {
				held = t
				break
			}
			l.send(t)
		}
		if err := l.flush(); err != nil {
			l.broken(err)
			continue
		}
		if len(l.win) > 0 {
			l.receive()
			// The window is refilled only once it has drained to half
			// (of its requests or of its bytes), so one header write
			// refills many slots instead of one write per response,
			// while the other half keeps the target busy. (Not "while
			// anything is buffered": with answers streaming in, that
			// would drain the window to empty and idle the target for a
			// round trip per window.)
			for len(l.win) > depth/2 || (capBytes > 0 && len(l.win) > 2 && l.wbytes > capBytes/2) {
				l.receive()
			}
			continue
		}
		if held != nil {
			l.write(held)
			held = nil
			continue
		}
		select {
		case <-e.done:
			return
		case <-l.p.q.kick:
		}
	}
}

// next returns a request to retry, else the queue's next one, else nil.
func (l *lane) next() *task {
	if n := len(l.retry); n > 0 {
		t := l.retry[0]
		copy(l.retry, l.retry[1:])
		l.retry[n-1] = nil
		l.retry = l.retry[:n-1]
		return t
	}
	return l.p.q.take()
}

// admit makes t outstanding on the lane's connection (dialing it if
// needed), or finishes t when its batch is cancelled or failed or the
// dial fails. It reports whether t is now in win.
func (l *lane) admit(t *task) bool {
	b := t.b
	switch {
	case b.cancelled.Load():
		t.finish(context.Cause(b.ctx))
		return false
	case b.failed.Load():
		t.finish(ErrNotAttempted)
		return false
	}
	if l.conn != nil && len(l.win) == 0 && (l.gen != l.p.gen.Load() || l.idleTooLong()) {
		// The peer handshook again since conn was dialed (it may be a new
		// process: conn may reach the old one), or the target may be about
		// to close conn: dial afresh.
		l.dropConn()
	}
	if l.conn == nil {
		if err := l.dial(b); err != nil {
			t.finish(err)
			return false
		}
	}
	if t.strided && !l.strided {
		// Split for a peer that advertised the op; the process behind
		// this connection's handshake did not (a restart in between):
		// it never sees the op.
		t.finish(fmt.Errorf("%s: %w", l.p.session, errStridedGone))
		return false
	}
	// Checked again under mu: interrupt, which runs after cancelled is
	// set, either sees t in win or t sees cancelled here.
	l.mu.Lock()
	if b.cancelled.Load() {
		l.mu.Unlock()
		t.finish(context.Cause(b.ctx))
		return false
	}
	l.win = append(l.win, t)
	l.mu.Unlock()
	return true
}

// send admits READ t and queues its header for the next flush.
func (l *lane) send(t *task) {
	if !l.admit(t) {
		return
	}
	if t.strided { // admit checked that conn's peer serves it (v2 only)
		g := t.b.gather
		var sb [StridedHeaderSize]byte
		PutStrided(&sb, StridedRead{Addr: t.remote, Row: g.Row, Pitch: g.Pitch, Rows: t.length / g.Row})
		l.hdrs = append(l.hdrs, sb[:]...)
		l.wbytes += t.length
		return
	}
	var hb [HeaderSize]byte
	PutHeader(&hb, Header{Size: t.length, Addr: t.remote, Opcode: OpcodeRead, V2: l.v2})
	l.hdrs = append(l.hdrs, hb[:]...)
	l.wbytes += t.length
}

// flush writes the queued headers in one write.
func (l *lane) flush() error {
	if len(l.hdrs) == 0 {
		return nil
	}
	err := l.arm()
	if err == nil {
		_, err = l.conn.Write(l.hdrs)
	}
	l.hdrs = l.hdrs[:0]
	return err
}

// receive consumes the response of the oldest outstanding READ.
func (l *lane) receive() {
	t := l.win[0]
	err := l.recv(t)
	storeFence() // recv's non-temporal stores land before done publishes them
	if err != nil {
		l.broken(err)
		return
	}
	l.done(t)
}

// recv reads t's status (v2) and data straight into local memory (each
// merged op's range in turn), in socket reads of at most ChunkSize, each
// with its own deadline.
func (l *lane) recv(t *task) error {
	if err := l.arm(); err != nil {
		return err
	}
	if l.v2 {
		if err := readStatus(l.br); err != nil {
			return err
		}
	}
	if t.b.stride.Row > 0 { // at most ChunkSize in all: one deadline
		for _, sg := range t.segs {
			if err := l.recvRows(sg, t.b.stride); err != nil {
				return err
			}
		}
		return nil
	}
	if t.segs != nil { // at most ChunkSize in all: one deadline
		for _, sg := range t.segs {
			if _, err := io.ReadFull(l.br, bytesAt(sg.local, sg.length)); err != nil {
				return err
			}
		}
		return nil
	}
	mem := bytesAt(t.local, t.length)
	chunk := l.p.e.cfg.ChunkSize
	for off := 0; off < len(mem); off += chunk {
		if off > 0 {
			if err := l.arm(); err != nil {
				return err
			}
		}
		if _, err := io.ReadFull(l.br, mem[off:min(off+chunk, len(mem))]); err != nil {
			return err
		}
	}
	return nil
}

// recvRows reads sg's bytes through the lane's buffer and copies them out
// row by row, each to its place under stride s: one socket read fills the
// buffer with many rows, which are then copied while still in cache.
func (l *lane) recvRows(sg seg, s Stride) error {
	pos, end := sg.off, sg.off+sg.length
	for pos < end {
		if l.br.Buffered() == 0 {
			if _, err := l.br.Peek(1); err != nil {
				return err
			}
		}
		buf, _ := l.br.Peek(int(min(uint64(l.br.Buffered()), end-pos)))
		scatterRows(sg.local, s, pos, buf)
		l.br.Discard(len(buf))
		pos += uint64(len(buf))
	}
	return nil
}

// copyOut copies src to dst (same length), local memory that is
// usually cold: the whole cache lines in the middle go out with
// non-temporal stores, which write a line without first reading it from
// memory as an ordinary store does (twice the speed into cold memory
// here). The caller runs storeFence before it reports the bytes landed.
func copyOut(dst, src []byte) {
	n := len(src)
	if !hasNT || n < ntMin {
		copy(dst, src)
		return
	}
	dst = dst[:n]
	head := int(-uintptr(unsafe.Pointer(&dst[0])) & 15) // to 16-byte alignment
	copy(dst[:head], src[:head])
	mid := (n - head) &^ 63
	copyNT(unsafe.Pointer(&dst[head]), unsafe.Pointer(&src[head]), uintptr(mid))
	copy(dst[head+mid:], src[head+mid:])
}

// ntMin: shorter copies stay ordinary (the lines are few, and a short
// copy's destination may well be cached).
const ntMin = 256

// scatterRows copies src, bytes [pos, pos+len(src)) of an op whose rows
// start at local, to their places under stride s.
func scatterRows(local uint64, s Stride, pos uint64, src []byte) {
	if len(src) == 0 {
		return
	}
	r, c := pos/s.Row, pos%s.Row
	// One slice over every row src touches; rows are then plain copies.
	last := (pos + uint64(len(src)) - 1) / s.Row
	dst := bytesAt(local+r*s.Pitch, (last-r)*s.Pitch+s.Row)
	row, pitch := int(s.Row), int(s.Pitch)
	d := int(c)
	if n := row - d; n < len(src) { // the first, partial row
		copy(dst[d:d+n], src[:n])
		src, d = src[n:], pitch
	}
	for len(src) >= row {
		copyOut(dst[d:d+row], src[:row])
		src, d = src[row:], d+pitch
	}
	if len(src) > 0 { // the last, partial row
		copy(dst[d:], src)
	}
}

// done ends the oldest outstanding request, which completed.
func (l *lane) done(t *task) {
	l.mu.Lock()
	// Pop the front in O(1): append reallocates once the slice's end
	// reaches its capacity, so the dropped front is reclaimed then.
	l.win[0] = nil
	l.win = l.win[1:]
	if len(l.win) == 0 {
		l.win = l.win[:0:0] // start afresh, not at the array's end
	}
	if t.b.opcode == OpcodeRead {
		l.wbytes -= t.length
	}
	// An abort that came after the aborted batch's requests were all
	// served leaves conn with a past deadline: start afresh.
	stale := l.aborted && len(l.win) == 0
	l.mu.Unlock()
	if stale {
		l.dropConn()
	}
	bytes, ops := l.p.e.m.dir(t.b.opcode)
	bytes.Add(float64(t.length))
	ops.Inc()
	t.finish(nil)
}

// broken ends the connection after err and settles every request that
// was outstanding on it. The connection is closed first, so nothing reads
// into their memory any more. The oldest request is the one the target
// was serving: it fails with err. The others were never served and are
// sent again on a fresh connection (at most maxRetries times each),
// unless their batch is cancelled, the engine is closing, or the peer is
// silent (a timeout would only repeat).
func (l *lane) broken(err error) {
	l.mu.Lock()
	aborted := l.aborted
	l.mu.Unlock()
	l.dropConn()
	l.mu.Lock()
	win := l.win
	l.win = nil
	l.mu.Unlock()
	l.hdrs, l.wbytes = l.hdrs[:0], 0
	closing := l.isClosing()
	silent := errors.Is(err, os.ErrDeadlineExceeded) && !aborted
	if errors.Is(err, ErrRejected) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) {
		// A refusal or a peer that closed may mean it restarted with
		// other registrations: the next batch handshakes again, so
		// requests are merged (splitOps) against its current buffers.
		l.p.markStale()
	}
	for i, t := range win {
		b := t.b
		switch {
		case b.cancelled.Load():
			t.finish(context.Cause(b.ctx))
		case closing:
			t.finish(ErrClosed)
		case aborted || (i > 0 && !silent && t.tries < maxRetries):
			// Aborts are counted by cancellations, not here.
			if !aborted {
				t.tries++
			}
			l.retry = append(l.retry, t)
		default:
			t.finish(l.explain(b, err))
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

// interrupt aborts the lane's connection if a request of b (cancelled)
// is outstanding on it; broken then sends the other batches' requests
// again on a fresh connection.
func (l *lane) interrupt(b *batch) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn == nil {
		return
	}
	for _, t := range l.win {
		if t.b == b {
			l.aborted = true
			l.conn.SetDeadline(time.Unix(1, 0))
			return
		}
	}
}

// arm sets the progress deadline for the next chunk, unless the
// connection was aborted or the engine is closing. Serialised with
// interrupt and shutdown by l.mu, so an abort cannot be overwritten.
//
// Moving a deadline costs two timer updates, and a lane of small answers
// arms hundreds of thousands of times a second; so the deadline moves
// only when it was last moved more than armSlack ago, and lies IOTimeout
// plus armSlack ahead. A silent peer then fails the lane between
// IOTimeout and IOTimeout + armSlack after the last progress.
func (l *lane) arm() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.closing:
		return ErrClosed
	case l.aborted:
		return errAborted
	}
	slack := l.p.e.cfg.IOTimeout / armSlackDiv
	now := time.Now()
	if !l.armedAt.IsZero() && now.Sub(l.armedAt) < slack {
		return nil
	}
	l.armedAt = now
	return l.conn.SetDeadline(now.Add(l.p.e.cfg.IOTimeout + slack))
}

// idleTooLong reports whether the lane's connection has carried no
// request for IdleTimeout/2: a target closes a connection idle for its
// IdleTimeout (kvflow's default, and the same setting here), and a
// request sent as it does so would fail. Called only when nothing is
// outstanding, so armedAt (at most IOTimeout/8 older than the last
// request) says when the connection was last used.
func (l *lane) idleTooLong() bool {
	l.mu.Lock()
	at := l.armedAt
	l.mu.Unlock()
	return !at.IsZero() && time.Since(at) > l.p.e.cfg.IdleTimeout/2
}

// armSlackDiv: the deadline is moved at most every IOTimeout/8.
const armSlackDiv = 8

func (l *lane) dropConn() {
	l.mu.Lock()
	c := l.conn
	l.conn, l.aborted, l.armedAt = nil, false, time.Time{}
	l.mu.Unlock()
	if c != nil {
		c.Close()
		l.p.e.m.conns.WithLabelValues(roleInitiator).Dec()
	}
}

func (l *lane) dial(b *batch) error {
	e := l.p.e
	addr, v2, strided, gen := l.p.target()
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
	if err := l.authenticate(ctx, c); err != nil {
		c.Close()
		l.p.markStale()
		return fmt.Errorf("connect %s: %w", addr, err)
	}
	l.mu.Lock()
	if l.closing {
		l.mu.Unlock()
		c.Close()
		return ErrClosed
	}
	l.conn, l.v2, l.strided, l.armedAt, l.gen = c, v2, strided, time.Time{}, gen
	l.mu.Unlock()
	if l.br == nil {
		l.br = bufio.NewReaderSize(c, laneBuf)
	} else {
		l.br.Reset(c)
	}
	e.m.conns.WithLabelValues(roleInitiator).Inc()
	return nil
}

// write runs WRITE t alone on the connection (no READ outstanding).
func (l *lane) write(t *task) {
	if !l.admit(t) {
		return
	}
	if err := l.writeOne(t); err != nil {
		l.broken(err)
		return
	}
	l.done(t)
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
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		// A peer that closes with pipelined headers unread resets.
		errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
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

// writeOne sends one WRITE: header and data out of local memory in socket
// writes of at most ChunkSize, then (v2) waits for the target's status.
func (l *lane) writeOne(t *task) error {
	c := l.conn
	mem := bytesAt(t.local, t.length)
	chunk := l.p.e.cfg.ChunkSize
	var hb [HeaderSize]byte
	PutHeader(&hb, Header{Size: t.length, Addr: t.remote, Opcode: OpcodeWrite, V2: l.v2})
	if err := l.arm(); err != nil {
		return err
	}
	first := min(len(mem), chunk)
	bufs := net.Buffers{hb[:], mem[:first]}
	_, err := bufs.WriteTo(c)
	for off := first; err == nil && off < len(mem); off += chunk {
		if err = l.arm(); err == nil {
			_, err = c.Write(mem[off:min(off+chunk, len(mem))])
		}
	}
	if !l.v2 {
		return err // legacy framing: no acknowledgement exists
	}
	if err != nil {
		// A refused write: the status may be waiting before the close.
		c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		if serr := readStatus(l.br); errors.Is(serr, ErrRejected) {
			return serr
		}
		return err
	}
	if err := l.arm(); err != nil {
		return err
	}
	return readStatus(l.br)
}

func readStatus(c io.Reader) error {
	var st [StatusSize]byte
	if _, err := io.ReadFull(c, st[:]); err != nil {
		return err
	}
	return ParseStatus(&st)
}
