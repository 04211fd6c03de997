package mooncake

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"
)

// Coalescing of small READ responses on a data connection: while further
// pipelined headers are already buffered, the responses of READs of at
// most coalesceOp bytes are gathered (their regions stay pinned) and
// written in one writev, up to coalesceBytes or coalesceOps of them.
const (
	coalesceOp    = 256 << 10
	coalesceBytes = 1 << 20
	coalesceOps   = 64
	serverBuf     = 64 << 10
)

// connBufs is what a data connection reads and gathers through: a 64 KiB
// header buffer and the pending responses. Pooled: with Mooncake's default
// initiator every request comes on a new connection, and allocating (and
// zeroing, and collecting) 64 KiB per connection cost more than serving
// the request itself for small blocks (BenchmarkOneShotRead).
type connBufs struct {
	br *bufio.Reader
	p  pending
}

var connBufsPool = sync.Pool{New: func() any {
	return &connBufs{br: bufio.NewReaderSize(nil, serverBuf)}
}}

// release returns cb to the pool, holding no connection, region or grant.
func (cb *connBufs) release() {
	cb.br.Reset(nil)
	clear(cb.p.bufs)
	clear(cb.p.pins)
	cb.p.bufs, cb.p.pins, cb.p.holds, cb.p.bytes = cb.p.bufs[:0], cb.p.pins[:0], cb.p.holds[:0], 0
	connBufsPool.Put(cb)
}

// pending is the gathered responses not yet written.
type pending struct {
	bufs  net.Buffers
	pins  []*region
	holds []uint64 // grant holds (0: none), released once written
	st    [coalesceOps][StatusSize]byte
	bytes int
}

func (p *pending) add(r *region, hold uint64, mem []byte, v2 bool) {
	if v2 {
		st := &p.st[len(p.pins)]
		PutStatus(st, StatusOK)
		p.bufs = append(p.bufs, st[:])
	}
	p.bufs = append(p.bufs, mem)
	p.pins = append(p.pins, r)
	p.holds = append(p.holds, hold)
	p.bytes += len(mem)
}

func (p *pending) full() bool {
	return len(p.pins) >= coalesceOps || p.bytes >= coalesceBytes
}

// flush writes the gathered responses and unpins their regions.
func (e *TCPEngine) flushPending(c net.Conn, p *pending) error {
	if len(p.pins) == 0 {
		return nil
	}
	c.SetDeadline(time.Now().Add(e.cfg.IOTimeout))
	bufs := p.bufs // WriteTo consumes its receiver
	_, err := bufs.WriteTo(c)
	for i, r := range p.pins {
		r.unpin()
		e.grants.release(p.holds[i])
		p.pins[i] = nil
	}
	if err == nil {
		e.m.serveReadBytes.Add(float64(p.bytes))
		e.m.serveReadOps.Add(float64(len(p.pins)))
	}
	clear(p.bufs)
	p.bufs, p.pins, p.holds, p.bytes = p.bufs[:0], p.pins[:0], p.holds[:0], 0
	return err
}

// serveData serves requests on one persistent data connection until the
// peer closes it, a request is refused, or the engine closes. Like
// Mooncake's ServerSession it serves requests in order, one response
// after another, so an initiator may pipeline requests. Headers are read
// through a buffer: when several pipelined READ headers arrived together,
// their small responses go out in one writev. A refusal ends the
// connection once the responses before it are written (a v2 peer first
// gets the reject status). The connection counts against its address's
// MaxConnsPerPeer until its first request is found valid (a.working).
func (e *TCPEngine) serveData(c net.Conn, a *admission) { e.serveDataFrom(c, a, nil) }

// serveDataFrom is serveData on a connection whose first bytes, prefix,
// were already read (by the event loop, which hands a connection over
// between two requests: prefix starts a header).
func (e *TCPEngine) serveDataFrom(c net.Conn, a *admission, prefix []byte) {
	e.m.targetConns.Inc()
	defer e.m.targetConns.Dec()
	// TCP_NODELAY (and keep-alive) come from the listener (listenConfig).
	if e.auth != nil && !e.authenticate(c, portData) {
		return
	}
	peer := logAddr{c.RemoteAddr()} // formatted only if logged
	cb := connBufsPool.Get().(*connBufs)
	br, p := cb.br, &cb.p
	if len(prefix) > 0 {
		br.Reset(io.MultiReader(bytes.NewReader(prefix), c))
	} else {
		br.Reset(c)
	}
	defer func() {
		for i, r := range p.pins {
			r.unpin()
			e.grants.release(p.holds[i])
		}
		cb.release()
	}()
	var hb [HeaderSize]byte
	var iov net.Buffers // a strided answer's rows, reused
	// A revoke whose grace ends while this connection still serves the
	// revoked bytes resets it: the write in progress fails at once, and
	// the reader gets a reset rather than a clean end of stream.
	cut := func() {
		if tc, ok := c.(*net.TCPConn); ok {
			tc.SetLinger(0)
		}
		c.Close()
	}
	// Waiting for the first header, then between requests: bounded by
	// FirstByteTimeout, then IdleTimeout (a deadline moved once per wait,
	// not per request of a pipelined burst).
	wait, why := e.cfg.FirstByteTimeout, timeoutFirstByte
	for {
		if br.Buffered() < HeaderSize {
			// About to wait for the peer: what is gathered goes out first.
			if err := e.flushPending(c, p); err != nil {
				e.log.Warn("data: transfer failed", "peer", peer, "err", err)
				return
			}
		}
		n := 0
		if br.Buffered() == 0 {
			// Idle: connections are persistent, but no one holds one for
			// ever without a request. Once a header starts, the rest of
			// it must arrive within IOTimeout.
			c.SetDeadline(time.Now().Add(wait))
			if _, err := br.Peek(1); err != nil {
				switch {
				case errors.Is(err, os.ErrDeadlineExceeded):
					e.m.connTimedOut.WithLabelValues(portData, why).Inc()
					e.log.Debug("data: connection closed for want of a request", "peer", peer, "reason", why, "timeout", wait)
				case !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed):
					e.log.Warn("data: header read failed", "peer", peer, "bytes", 0, "err", err)
				}
				return
			}
			wait, why = e.cfg.IdleTimeout, timeoutIdle
		}
		if br.Buffered() < HeaderSize {
			n = br.Buffered()
			c.SetDeadline(time.Now().Add(e.cfg.IOTimeout))
		}
		if _, err := io.ReadFull(br, hb[:]); err != nil {
			e.log.Warn("data: header read failed", "peer", peer, "bytes", n, "err", err)
			return
		}
		h, err := ParseHeader(&hb)
		if err == nil && h.Size == 0 {
			err = ErrZeroLength
		}
		var r *region
		reason := reasonBadOpcode
		if errors.Is(err, ErrZeroLength) {
			reason = reasonZeroLength
		}
		// kvflow's strided READ (an opcode ParseHeader refuses): only
		// when this engine serves kvflow ops, and checked whole, from
		// its first row's start to its last row's end, like a READ of
		// that span.
		var sr StridedRead
		strided := err != nil && h.Opcode == OpcodeReadStrided && h.V2 && !e.cfg.NoKvflowOps
		span := h.Size
		if strided {
			if sr, err = e.readStrided(c, br, &hb); err != nil {
				reason = reasonBadStrided
				if errors.Is(err, ErrBadStrided) {
					e.log.Debug("data: malformed strided read", "peer", peer, "err", err)
				}
			} else {
				span = sr.Span()
			}
		}
		if err == nil && h.Opcode == OpcodeWrite && !e.cfg.AcceptWrites {
			err, reason = errWritesOff, reasonWriteRefused
		}
		if err == nil {
			r, err = e.regions.pin(h.Addr, span)
			reason = reasonUnregistered
		}
		var hold uint64 // released once the answer is written
		if err == nil && e.cfg.ReadGrants {
			var ok bool
			if hold, ok = e.grants.hold(h.Addr, span, cut); !ok {
				r.unpin()
				err, reason = errNotGranted, reasonNotGranted
			}
		}
		if err != nil {
			if ferr := e.flushPending(c, p); ferr != nil {
				return
			}
			if errors.Is(err, errNotGranted) {
				err = nil
			}
			e.reject(c, br, h, reason, peer, err)
			return
		}
		if a != nil {
			a.working() // a valid request: off the per-address cap
			a = nil
		}
		if strided {
			if err := e.flushPending(c, p); err == nil {
				err = e.serveStrided(c, sr, &iov)
			}
			r.unpin()
			e.grants.release(hold)
			if err != nil {
				e.log.Warn("data: transfer failed", "peer", peer, "strided", true, "addr", sr.Addr, "row", sr.Row, "pitch", sr.Pitch, "rows", sr.Rows, "err", err)
				return
			}
			continue
		}
		if h.Opcode == OpcodeRead && h.Size <= coalesceOp {
			p.add(r, hold, bytesAt(h.Addr, h.Size), h.V2)
			if p.full() {
				if err := e.flushPending(c, p); err != nil {
					e.log.Warn("data: transfer failed", "peer", peer, "err", err)
					return
				}
			}
			continue
		}
		if err := e.flushPending(c, p); err != nil {
			r.unpin()
			e.grants.release(hold)
			e.log.Warn("data: transfer failed", "peer", peer, "err", err)
			return
		}
		err = e.serveOne(c, br, h)
		r.unpin()
		e.grants.release(hold)
		if err != nil {
			e.log.Warn("data: transfer failed", "peer", peer, "opcode", h.Opcode, "addr", h.Addr, "size", h.Size, "err", err)
			return
		}
	}
}

// logAddr logs a connection's remote address as a string, formatting it
// only when a line is written (not once per connection).
type logAddr struct{ a net.Addr }

func (l logAddr) LogValue() slog.Value { return slog.StringValue(l.a.String()) }

// errNotGranted marks a refusal for want of a read grant (no error to log).
var errNotGranted = errors.New("not granted")

// errWritesOff is a WRITE refused by a target that does not accept writes.
var errWritesOff = errors.New("writes are not accepted (TCPConfig.AcceptWrites off)")

// serveOne moves one validated request's payload straight between the
// socket (a WRITE's payload first from what br already buffered) and
// registered memory, in chunks of at most ChunkSize, each with its own
// deadline.
func (e *TCPEngine) serveOne(c net.Conn, br *bufio.Reader, h Header) error {
	mem := bytesAt(h.Addr, h.Size)
	chunk := e.cfg.ChunkSize
	var st [StatusSize]byte
	PutStatus(&st, StatusOK)
	if h.Opcode == OpcodeRead {
		first := min(len(mem), chunk)
		c.SetDeadline(time.Now().Add(e.cfg.IOTimeout))
		var err error
		if h.V2 { // status, then data: one writev
			bufs := net.Buffers{st[:], mem[:first]}
			_, err = bufs.WriteTo(c)
		} else {
			_, err = c.Write(mem[:first])
		}
		for off := first; err == nil && off < len(mem); off += chunk {
			c.SetDeadline(time.Now().Add(e.cfg.IOTimeout))
			_, err = c.Write(mem[off:min(off+chunk, len(mem))])
		}
		if err != nil {
			return err
		}
		e.m.serveReadBytes.Add(float64(h.Size))
		e.m.serveReadOps.Inc()
		return nil
	}
	for off := 0; off < len(mem); off += chunk {
		c.SetDeadline(time.Now().Add(e.cfg.IOTimeout))
		if _, err := io.ReadFull(br, mem[off:min(off+chunk, len(mem))]); err != nil {
			return err
		}
	}
	if h.V2 { // acknowledge only once the payload is in memory
		c.SetDeadline(time.Now().Add(e.cfg.IOTimeout))
		if _, err := c.Write(st[:]); err != nil {
			return err
		}
	}
	e.m.serveWriteBytes.Add(float64(h.Size))
	e.m.serveWriteOps.Inc()
	return nil
}

// reject counts a refused request and, for a v2 peer, sends the reject
// status; the caller then ends the connection.
func (e *TCPEngine) reject(c net.Conn, br *bufio.Reader, h Header, reason string, peer logAddr, err error) {
	e.m.rejected.WithLabelValues(reason).Inc()
	e.log.Warn("data: request refused", "peer", peer, "reason", reason, "opcode", h.Opcode, "addr", h.Addr, "size", h.Size, "err", err)
	if h.V2 {
		var st [StatusSize]byte
		PutStatus(&st, StatusRejected)
		c.SetDeadline(time.Now().Add(e.cfg.IOTimeout))
		c.Write(st[:])
	}
	// The peer may still be streaming a write's payload, or have
	// pipelined further read headers: half-close and drain briefly so the
	// close does not reset the connection before the peer has read the
	// status. Requests behind the refused one are never served.
	drain := int64(64 << 10) // pipelined headers
	if h.Opcode == OpcodeWrite {
		drain = int64(min(h.Size, 64<<20))
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.CloseWrite()
	}
	c.SetDeadline(time.Now().Add(200 * time.Millisecond))
	io.CopyN(io.Discard, br, drain)
}

// readStrided reads the rest of a strided READ whose header is hb (the
// row and pitch) and decodes it.
func (e *TCPEngine) readStrided(c net.Conn, br *bufio.Reader, hb *[HeaderSize]byte) (StridedRead, error) {
	var b [StridedHeaderSize]byte
	copy(b[:], hb[:])
	if br.Buffered() < StridedHeaderSize-HeaderSize {
		c.SetDeadline(time.Now().Add(e.cfg.IOTimeout))
	}
	if _, err := io.ReadFull(br, b[HeaderSize:]); err != nil {
		return StridedRead{}, fmt.Errorf("strided read: %w", err)
	}
	return ParseStrided(&b)
}

// Strided answers go out in writes of at most stridedIOV rows (pieces of
// rows) and ChunkSize bytes, straight from registered memory (writev: the
// rows are never copied in user space).
const stridedIOV = 1024

// serveStrided answers validated strided READ s (its span pinned and, with
// grants, held): the OK status, then its rows back to back. iov is the
// connection's reusable vector.
func (e *TCPEngine) serveStrided(c net.Conn, s StridedRead, iov *net.Buffers) error {
	var st [StatusSize]byte
	PutStatus(&st, StatusOK)
	chunk := uint64(e.cfg.ChunkSize)
	bufs := append((*iov)[:0], st[:])
	n := uint64(StatusSize)
	flush := func() error {
		c.SetDeadline(time.Now().Add(e.cfg.IOTimeout))
		w := bufs // WriteTo consumes its receiver
		_, err := w.WriteTo(c)
		clear(bufs)
		bufs, n = bufs[:0], 0
		return err
	}
	addr := s.Addr
	for range s.Rows {
		for off := uint64(0); off < s.Row; {
			piece := min(s.Row-off, chunk)
			bufs = append(bufs, bytesAt(addr+off, piece))
			off += piece
			if n += piece; len(bufs) >= stridedIOV || n >= chunk {
				if err := flush(); err != nil {
					*iov = bufs
					return err
				}
			}
		}
		addr += s.Pitch
	}
	var err error
	if len(bufs) > 0 {
		err = flush()
	}
	*iov = bufs
	if err != nil {
		return err
	}
	e.m.serveReadBytes.Add(float64(s.Size()))
	e.m.serveReadOps.Inc()
	return nil
}
