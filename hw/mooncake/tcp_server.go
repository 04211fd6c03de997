package mooncake

import (
	"errors"
	"io"
	"net"
	"time"
)

// serveData serves requests on one persistent data connection until the
// peer closes it, a request is refused, or the engine closes. Like
// Mooncake's ServerSession it serves requests one after another (the next
// header is read only once a response is complete, so an initiator may
// pipeline requests: queued headers wait in the socket) and ends
// the connection after a refusal (a v2 peer first gets the reject status).
func (e *TCPEngine) serveData(c net.Conn) {
	e.m.conns.WithLabelValues(roleTarget).Inc()
	defer e.m.conns.WithLabelValues(roleTarget).Dec()
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	peer := c.RemoteAddr().String()
	var hb [HeaderSize]byte
	for {
		// Idle between requests: no deadline (connections are persistent);
		// once a header starts, the rest of it must arrive in time.
		c.SetDeadline(time.Time{})
		n, err := c.Read(hb[:])
		if err == nil && n < HeaderSize {
			c.SetDeadline(time.Now().Add(e.cfg.IOTimeout))
			_, err = io.ReadFull(c, hb[n:])
		}
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				e.log.Warn("data: header read failed", "peer", peer, "bytes", n, "err", err)
			}
			return
		}
		h, err := ParseHeader(&hb)
		if err != nil {
			e.reject(c, h, reasonBadOpcode, peer, err)
			return
		}
		if h.Size == 0 {
			e.reject(c, h, reasonZeroLength, peer, ErrZeroLength)
			return
		}
		r, err := e.regions.pin(h.Addr, h.Size)
		if err != nil {
			e.reject(c, h, reasonUnregistered, peer, err)
			return
		}
		if e.cfg.ReadGrants && !e.grants.covers(h.Addr, h.Size) {
			r.unpin()
			e.reject(c, h, reasonNotGranted, peer, nil)
			return
		}
		err = e.serveOne(c, h)
		r.unpin()
		if err != nil {
			e.log.Warn("data: transfer failed", "peer", peer, "opcode", h.Opcode, "addr", h.Addr, "size", h.Size, "err", err)
			return
		}
	}
}

// serveOne moves one validated request's payload straight between the
// socket and registered memory, in chunks of at most ChunkSize, each with
// its own deadline.
func (e *TCPEngine) serveOne(c net.Conn, h Header) error {
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
		e.m.bytes.WithLabelValues(dirServeRead).Add(float64(h.Size))
		e.m.ops.WithLabelValues(dirServeRead).Inc()
		return nil
	}
	for off := 0; off < len(mem); off += chunk {
		c.SetDeadline(time.Now().Add(e.cfg.IOTimeout))
		if _, err := io.ReadFull(c, mem[off:min(off+chunk, len(mem))]); err != nil {
			return err
		}
	}
	if h.V2 { // acknowledge only once the payload is in memory
		c.SetDeadline(time.Now().Add(e.cfg.IOTimeout))
		if _, err := c.Write(st[:]); err != nil {
			return err
		}
	}
	e.m.bytes.WithLabelValues(dirServeWrite).Add(float64(h.Size))
	e.m.ops.WithLabelValues(dirServeWrite).Inc()
	return nil
}

// reject counts a refused request and, for a v2 peer, sends the reject
// status; the caller then ends the connection.
func (e *TCPEngine) reject(c net.Conn, h Header, reason, peer string, err error) {
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
	io.CopyN(io.Discard, c, drain)
}
