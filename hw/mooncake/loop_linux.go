//go:build linux && !386

package mooncake

import (
	"container/heap"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"
	"unsafe"
)

// The data port's event loop (Linux). Mooncake's initiator with its
// connection pool off (its default) opens a TCP connection per request,
// sends one READ header, reads the answer and closes. Served on a
// goroutine each, such a connection costs the Go runtime more than its
// bytes: a goroutine, a netpoll registration, a finalizer, the scheduler
// handing work between Ps, sysmon polling at 20 µs while syscalls come and
// go (bench/HISTORY.md has the profile: ~25 % more CPU per byte than
// Mooncake's own target at 64 KiB). The loop serves them as Mooncake's
// target does, from one goroutine over its own epoll instance, with
// non-blocking raw syscalls: per one-shot connection accept4, read,
// writev, epoll_ctl, read (end of stream), close.
//
// The loop serves a connection while every read brings exactly one whole
// plain READ header (v1 or v2) of registered (and, with ReadGrants,
// granted) memory: one request at a time, the answer written as the
// socket takes it. Anything else graduates the connection to the
// goroutine path (serveData) with the bytes read so far: pipelined
// headers (kvflow's own lanes, whose small answers serveData coalesces),
// kvflow's strided READ, WRITEs, and every request serveData refuses
// (it refuses, counts and logs them as it always has). Caps, the
// descriptor reserve, the first-byte, I/O and idle timeouts and read
// grants (a cut resets the connection) apply as on the goroutine path.
//
// The loop is off when the engine requires data-plane authentication
// (every connection starts with it) and with TCPConfig.NoEventLoop.

// loopReadBuf is what one read takes at most: more than a header, so a
// read that brings a second (pipelined) header is seen at once.
const loopReadBuf = 64

// lconn is one connection the loop serves.
type lconn struct {
	fd      int
	peer    netip.AddrPort
	a       *admission
	working bool // a.working done
	served  int  // requests answered on this connection

	buf [loopReadBuf]byte
	got int // bytes of buf read

	// The answer being written (r != nil): v2's status frame, then out.
	r      *region
	hold   uint64
	st     [StatusSize]byte
	stLeft int
	out    []byte
	size   uint64
	gen    uint64 // counts requests over this struct's life (grant cuts)

	events     uint32 // epoll interest; 0: not registered
	timer      int    // index in loop.timers; -1: none
	deadline   time.Time
	timeoutWhy string
}

// loopAcceptHook, when set (tests, before the engine starts), sees each
// socket the event loop accepts.
var loopAcceptHook func(fd int)

// cutReq asks the loop to reset c if it still serves request gen.
type cutReq struct {
	c   *lconn
	gen uint64
}

type eventLoop struct {
	e    *TCPEngine
	lfd  int // the data listener's socket (a dup; Go's listener is closed)
	epfd int
	evfd int // eventfd: Close and grant cuts wake the loop

	conns  map[int]*lconn
	free   []*lconn
	timers timerHeap
	now    time.Time

	acceptBackoff time.Duration
	acceptPaused  bool
	acceptResume  time.Time

	events [128]syscall.EpollEvent
	iov    [2]syscall.Iovec

	mu     sync.Mutex // guards stop, cuts, evfdOpen
	stop   bool
	cuts   []cutReq
	evOpen bool
}

// newEventLoop takes over ln's socket (ln is closed) with its own epoll
// instance. On error ln is left as it was.
func newEventLoop(e *TCPEngine, ln net.Listener) (*eventLoop, error) {
	tl, ok := ln.(*net.TCPListener)
	if !ok {
		return nil, fmt.Errorf("event loop: listener is %T, not TCP", ln)
	}
	rc, err := tl.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("event loop: listener socket: %w", err)
	}
	lfd := -1
	var derr error
	if err := rc.Control(func(fd uintptr) {
		lfd, derr = syscall.Dup(int(fd))
	}); err != nil {
		return nil, fmt.Errorf("event loop: listener socket: %w", err)
	}
	if derr != nil {
		return nil, fmt.Errorf("event loop: dup listener: %w", derr)
	}
	syscall.CloseOnExec(lfd)
	l := &eventLoop{e: e, lfd: lfd, epfd: -1, evfd: -1, conns: map[int]*lconn{}}
	fail := func(what string, err error) (*eventLoop, error) {
		for _, fd := range []int{l.lfd, l.epfd, l.evfd} {
			if fd >= 0 {
				syscall.Close(fd)
			}
		}
		return nil, fmt.Errorf("event loop: %s: %w", what, err)
	}
	if err := syscall.SetNonblock(lfd, true); err != nil {
		return fail("listener non-blocking", err)
	}
	if l.epfd, err = syscall.EpollCreate1(syscall.EPOLL_CLOEXEC); err != nil {
		return fail("epoll_create1", err)
	}
	r, _, errno := syscall.RawSyscall(syscall.SYS_EVENTFD2, 0, syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if errno != 0 {
		return fail("eventfd", errno)
	}
	l.evfd, l.evOpen = int(r), true
	for _, fd := range []int{l.lfd, l.evfd} {
		ev := syscall.EpollEvent{Events: syscall.EPOLLIN, Fd: int32(fd)}
		if err := syscall.EpollCtl(l.epfd, syscall.EPOLL_CTL_ADD, fd, &ev); err != nil {
			return fail("epoll_ctl", err)
		}
	}
	// Go's listener would only be woken for connections it never accepts.
	ln.Close()
	return l, nil
}

// wake makes a blocked epoll_wait return (Close, grant cuts).
func (l *eventLoop) wakeLocked() {
	if !l.evOpen {
		return
	}
	one := uint64(1)
	syscall.RawSyscall(syscall.SYS_WRITE, uintptr(l.evfd), uintptr(unsafe.Pointer(&one)), 8)
}

// close asks the loop to end: it closes every connection it serves and
// its sockets, then returns (TCPEngine.Close waits for it).
func (l *eventLoop) close() {
	l.mu.Lock()
	l.stop = true
	l.wakeLocked()
	l.mu.Unlock()
}

// cutFor is the grant-hold cut of c's request gen: called by the grant
// table (another goroutine) when a revoke's grace ends while c still
// writes revoked bytes.
func (l *eventLoop) cutFor(c *lconn, gen uint64) func() {
	return func() {
		l.mu.Lock()
		if !l.stop {
			l.cuts = append(l.cuts, cutReq{c, gen})
			l.wakeLocked()
		}
		l.mu.Unlock()
	}
}

func (l *eventLoop) run() {
	defer l.e.wg.Done()
	defer l.shutdown()
	for {
		ms := -1
		if l.timers.Len() > 0 {
			ms = msUntil(l.timers[0].deadline, time.Now())
		}
		if l.acceptPaused {
			ms = minWait(ms, msUntil(l.acceptResume, time.Now()))
		}
		n, err := syscall.EpollWait(l.epfd, l.events[:], ms)
		if err != nil && !errors.Is(err, syscall.EINTR) {
			l.e.log.Error("data: event loop: epoll_wait failed; the data port stops accepting", "err", err)
			return
		}
		l.now = time.Now()
		for i := 0; i < n; i++ {
			ev := &l.events[i]
			switch fd := int(ev.Fd); fd {
			case l.lfd:
				l.acceptAll()
			case l.evfd:
				if l.woken() {
					return
				}
			default:
				if c := l.conns[fd]; c != nil {
					if c.r != nil {
						l.write(c)
					} else {
						l.read(c)
					}
				}
			}
		}
		l.expire()
	}
}

// msUntil is the epoll_wait timeout that wakes at t (rounded up).
func msUntil(t, now time.Time) int {
	d := t.Sub(now)
	if d <= 0 {
		return 0
	}
	return int((d + time.Millisecond - 1) / time.Millisecond)
}

func minWait(a, b int) int {
	if a < 0 || b < a {
		return b
	}
	return a
}

// woken drains the eventfd and applies the cuts; it reports whether the
// loop must end.
func (l *eventLoop) woken() bool {
	var v uint64
	syscall.RawSyscall(syscall.SYS_READ, uintptr(l.evfd), uintptr(unsafe.Pointer(&v)), 8)
	l.mu.Lock()
	stop, cuts := l.stop, l.cuts
	l.cuts = nil
	l.mu.Unlock()
	if stop {
		return true
	}
	for _, q := range cuts {
		if c := q.c; c.r != nil && c.gen == q.gen && l.conns[c.fd] == c {
			l.e.log.Warn("data: transfer failed", "peer", c.peer, "opcode", OpcodeRead, "size", c.size, "err", "read grant revoked: connection reset")
			linger := syscall.Linger{Onoff: 1, Linger: 0}
			syscall.SetsockoptLinger(c.fd, syscall.SOL_SOCKET, syscall.SO_LINGER, &linger)
			l.closeConn(c)
		}
	}
	return false
}

// acceptAll accepts what the listener holds (at most 256 per turn, so
// connections already open get their turn).
func (l *eventLoop) acceptAll() {
	e := l.e
	for range 256 {
		var rsa syscall.RawSockaddrAny
		alen := uint32(syscall.SizeofSockaddrAny)
		r, _, errno := syscall.RawSyscall6(syscall.SYS_ACCEPT4, uintptr(l.lfd), uintptr(unsafe.Pointer(&rsa)),
			uintptr(unsafe.Pointer(&alen)), syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0, 0)
		switch errno {
		case 0:
		case syscall.EAGAIN:
			l.acceptBackoff = 0
			return
		case syscall.EINTR, syscall.ECONNABORTED:
			continue
		default:
			// Transient (EMFILE and the like): stop watching the listener
			// for a while instead of spinning on it.
			l.acceptBackoff = min(max(2*l.acceptBackoff, 5*time.Millisecond), time.Second)
			e.log.Warn("accept failed", "port", portData, "err", errno, "backoff", l.acceptBackoff)
			syscall.EpollCtl(l.epfd, syscall.EPOLL_CTL_DEL, l.lfd, nil)
			l.acceptPaused, l.acceptResume = true, l.now.Add(l.acceptBackoff)
			return
		}
		fd := int(r)
		if loopAcceptHook != nil {
			loopAcceptHook(fd)
		}
		peer := sockaddrAddrPort(&rsa)
		room := e.fds.room(e.open.Load(), l.now)
		if room <= 0 {
			l.refuse(fd, peer, refusedFDReserve)
			continue
		}
		a, reason, err := e.track(nil, e.dataConns, peerKeyOf(peer), room)
		if err != nil { // closing
			rawClose(fd)
			return
		}
		if reason != "" {
			l.refuse(fd, peer, reason)
			continue
		}
		c := l.newConn(fd, peer, a)
		e.m.targetConns.Inc()
		l.read(c)
	}
}

func (l *eventLoop) refuse(fd int, peer netip.AddrPort, reason string) {
	linger := syscall.Linger{Onoff: 1, Linger: 0}
	syscall.SetsockoptLinger(fd, syscall.SOL_SOCKET, syscall.SO_LINGER, &linger)
	l.e.refused(portData, reason, peer) // counted before the peer can see the reset
	rawClose(fd)
}

func (l *eventLoop) newConn(fd int, peer netip.AddrPort, a *admission) *lconn {
	var c *lconn
	if n := len(l.free); n > 0 {
		c, l.free = l.free[n-1], l.free[:n-1]
		gen := c.gen
		*c = lconn{gen: gen}
	} else {
		c = &lconn{}
	}
	c.fd, c.peer, c.a, c.timer = fd, peer, a, -1
	l.conns[fd] = c
	return c
}

// read reads what c's peer sent: at the end of stream c is closed; one
// whole header alone is served; more (pipelined requests) graduates c to
// the goroutine path; less waits for the rest.
func (l *eventLoop) read(c *lconn) {
	for {
		r, _, errno := syscall.RawSyscall(syscall.SYS_READ, uintptr(c.fd), uintptr(unsafe.Pointer(&c.buf[c.got])), uintptr(len(c.buf)-c.got))
		switch {
		case errno == syscall.EAGAIN:
			l.waitRead(c)
			return
		case errno == syscall.EINTR:
			continue
		case errno != 0:
			l.e.log.Warn("data: header read failed", "peer", c.peer, "bytes", c.got, "err", errno)
			l.closeConn(c)
			return
		case r == 0:
			if c.got > 0 {
				l.e.log.Warn("data: header read failed", "peer", c.peer, "bytes", c.got, "err", "unexpected end of stream")
			}
			l.closeConn(c)
			return
		}
		c.got += int(r)
		switch {
		case c.got < HeaderSize:
			continue // most likely EAGAIN next: wait for the rest
		case c.got > HeaderSize:
			l.graduate(c)
		default:
			l.serve(c)
		}
		return
	}
}

// serve starts the answer to the one header in c.buf, or graduates c when
// it is anything but a valid plain READ.
func (l *eventLoop) serve(c *lconn) {
	e := l.e
	h, err := ParseHeader((*[HeaderSize]byte)(c.buf[:HeaderSize]))
	if err != nil || h.Opcode != OpcodeRead || h.Size == 0 {
		l.graduate(c)
		return
	}
	r, err := e.regions.pin(h.Addr, h.Size)
	if err != nil {
		l.graduate(c)
		return
	}
	c.gen++
	var hold uint64
	if e.cfg.ReadGrants {
		var ok bool
		if hold, ok = e.grants.hold(h.Addr, h.Size, l.cutFor(c, c.gen)); !ok {
			r.unpin()
			l.graduate(c)
			return
		}
	}
	if !c.working {
		c.working = true
		c.a.working()
	}
	c.got = 0
	c.r, c.hold, c.size = r, hold, h.Size
	c.out = bytesAt(h.Addr, h.Size)
	c.stLeft = 0
	if h.V2 {
		PutStatus(&c.st, StatusOK)
		c.stLeft = StatusSize
	}
	l.write(c)
}

// How much of an answer the loop writes per turn. An answer of at most
// loopWholeBytes goes out whole in the turn that read its header, if the
// socket takes it; a larger one loopTurnBytes (about what a fresh
// loopback connection's receive window takes: Linux's tcp_rmem default is
// 128 KiB) per turn, so answers to many connections advance side by side.
// Measured with Mooncake's initiator against Mooncake's target in the
// same runs (bench/HISTORY.md, 2026-12-04): 1 MiB blocks 1.23–1.37× at 64
// or 128 KiB per turn, 0.95–1.02× writing on within a turn; 256 KiB
// blocks 0.95–0.96× at 128 KiB per turn, 1.01× whole.
const (
	loopTurnBytes  = 128 << 10
	loopWholeBytes = 256 << 10
)

// write sends the next piece of c's answer (see loopTurnBytes; writevs of
// at most ChunkSize); then, or when the socket is full, it waits for room,
// bounded by IOTimeout of no progress.
func (l *eventLoop) write(c *lconn) {
	chunk := min(l.e.cfg.ChunkSize, loopTurnBytes)
	budget := 0 // bytes this turn may still write after the next writev
	if uint64(len(c.out)) == c.size && c.size <= loopWholeBytes {
		budget = int(c.size)
	}
	for {
		iov := l.iov[:0]
		if c.stLeft > 0 {
			iov = append(iov, syscall.Iovec{Base: &c.st[StatusSize-c.stLeft]})
			iov[len(iov)-1].SetLen(c.stLeft)
		}
		if len(c.out) > 0 {
			n := min(len(c.out), chunk)
			iov = append(iov, syscall.Iovec{Base: &c.out[0]})
			iov[len(iov)-1].SetLen(n)
		}
		// writev, as Go's net package writes to sockets: the runtime
		// ignores SIGPIPE on descriptors other than 1 and 2.
		r, _, errno := syscall.RawSyscall(syscall.SYS_WRITEV, uintptr(c.fd), uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov)))
		switch errno {
		case 0:
		case syscall.EAGAIN:
			l.wait(c, syscall.EPOLLOUT, l.e.cfg.IOTimeout, "")
			return
		case syscall.EINTR:
			continue
		default:
			l.e.log.Warn("data: transfer failed", "peer", c.peer, "opcode", OpcodeRead, "size", c.size, "err", errno)
			l.closeConn(c)
			return
		}
		n := int(r)
		if c.stLeft > 0 {
			k := min(n, c.stLeft)
			c.stLeft -= k
			n -= k
		}
		c.out = c.out[n:]
		if c.stLeft == 0 && len(c.out) == 0 {
			l.done(c)
			l.waitRead(c)
			return
		}
		if budget -= int(r); budget > 0 {
			continue
		}
		// One write (at most loopTurnBytes) per turn: the rest when epoll
		// says the socket takes more (at once, level-triggered, when it
		// already does), after the other connections ready now. Writing
		// on until EAGAIN let a peer that reads as fast as the loop
		// writes hold it for a whole answer (hundreds of MiB) while
		// others were not even accepted.
		l.wait(c, syscall.EPOLLOUT, l.e.cfg.IOTimeout, "")
		return
	}
}

// done ends c's answer, all of it written.
func (l *eventLoop) done(c *lconn) {
	e := l.e
	c.r.unpin()
	e.grants.release(c.hold)
	c.r, c.hold, c.out = nil, 0, nil
	c.served++
	e.m.serveReadBytes.Add(float64(c.size))
	e.m.serveReadOps.Inc()
}

// waitRead waits for c's next bytes: the first header within
// FirstByteTimeout of the accept, the next within IdleTimeout of the last
// answer, the rest of a started header within IOTimeout.
func (l *eventLoop) waitRead(c *lconn) {
	cfg := &l.e.cfg
	switch {
	case c.got > 0:
		if c.events == syscall.EPOLLIN && c.timer >= 0 && c.timeoutWhy == "" {
			// Keep the deadline set at the header's first piece: the
			// whole rest of it within IOTimeout, as serveData reads it
			// (not IOTimeout per piece: a peer trickling a header a
			// byte at a time would hold the connection 24 times as
			// long).
			l.watch(c, syscall.EPOLLIN)
			return
		}
		l.wait(c, syscall.EPOLLIN, cfg.IOTimeout, "")
	case c.served == 0:
		if c.events == syscall.EPOLLIN && c.timer >= 0 {
			l.watch(c, syscall.EPOLLIN) // keep the deadline set at accept
			return
		}
		l.wait(c, syscall.EPOLLIN, cfg.FirstByteTimeout, timeoutFirstByte)
	default:
		l.wait(c, syscall.EPOLLIN, cfg.IdleTimeout, timeoutIdle)
	}
}

// wait sets c's epoll interest and its deadline (why: the timed-out
// reason counted; "" for an I/O timeout, logged as a failure).
func (l *eventLoop) wait(c *lconn, events uint32, d time.Duration, why string) {
	if !l.watch(c, events) {
		return
	}
	c.deadline, c.timeoutWhy = l.now.Add(d), why
	if c.timer >= 0 {
		heap.Fix(&l.timers, c.timer)
	} else {
		heap.Push(&l.timers, c)
	}
}

// watch sets c's epoll interest; false when c had to be closed.
func (l *eventLoop) watch(c *lconn, events uint32) bool {
	if c.events == events {
		return true
	}
	op := syscall.EPOLL_CTL_MOD
	if c.events == 0 {
		op = syscall.EPOLL_CTL_ADD
	}
	ev := syscall.EpollEvent{Events: events, Fd: int32(c.fd)}
	_, _, errno := syscall.RawSyscall6(syscall.SYS_EPOLL_CTL, uintptr(l.epfd), uintptr(op), uintptr(c.fd), uintptr(unsafe.Pointer(&ev)), 0, 0)
	if errno != 0 {
		l.e.log.Warn("data: event loop: epoll_ctl failed", "peer", c.peer, "err", errno)
		l.closeConn(c)
		return false
	}
	c.events = events
	return true
}

// expire closes the connections past their deadline, and resumes
// accepting after a backoff.
func (l *eventLoop) expire() {
	e := l.e
	if l.acceptPaused && !l.now.Before(l.acceptResume) {
		ev := syscall.EpollEvent{Events: syscall.EPOLLIN, Fd: int32(l.lfd)}
		if err := syscall.EpollCtl(l.epfd, syscall.EPOLL_CTL_ADD, l.lfd, &ev); err == nil {
			l.acceptPaused = false
		} else {
			l.acceptResume = l.now.Add(l.acceptBackoff)
		}
	}
	for l.timers.Len() > 0 && !l.now.Before(l.timers[0].deadline) {
		c := l.timers[0]
		switch {
		case c.timeoutWhy != "":
			e.m.connTimedOut.WithLabelValues(portData, c.timeoutWhy).Inc()
			e.log.Debug("data: connection closed for want of a request", "peer", c.peer, "reason", c.timeoutWhy)
		case c.r != nil:
			e.log.Warn("data: transfer failed", "peer", c.peer, "opcode", OpcodeRead, "size", c.size, "err", os.ErrDeadlineExceeded)
		default:
			e.log.Warn("data: header read failed", "peer", c.peer, "bytes", c.got, "err", os.ErrDeadlineExceeded)
		}
		l.closeConn(c)
	}
}

// closeConn ends c: its answer's pin and grant hold, its descriptor
// (which leaves the epoll set with it: nothing else refers to it), its
// admission.
func (l *eventLoop) closeConn(c *lconn) {
	e := l.e
	if c.r != nil {
		c.r.unpin()
		e.grants.release(c.hold)
		c.r, c.hold, c.out = nil, 0, nil
	}
	l.forget(c)
	rawClose(c.fd)
	e.m.targetConns.Dec()
	e.untrack(nil, c.a)
	l.release(c)
}

// forget drops c's timer and its place in the loop's table.
func (l *eventLoop) forget(c *lconn) {
	if c.timer >= 0 {
		heap.Remove(&l.timers, c.timer)
	}
	delete(l.conns, c.fd)
}

func (l *eventLoop) release(c *lconn) {
	c.a = nil
	if len(l.free) < 1024 {
		l.free = append(l.free, c)
	}
}

// graduate hands c to the goroutine path (serveData) with the bytes read
// so far, between two requests (nothing of an answer is pending).
func (l *eventLoop) graduate(c *lconn) {
	e := l.e
	if c.events != 0 {
		syscall.EpollCtl(l.epfd, syscall.EPOLL_CTL_DEL, c.fd, nil)
	}
	l.forget(c)
	e.m.targetConns.Dec()
	e.m.loopHandoffs.Inc()
	prefix := append([]byte(nil), c.buf[:c.got]...)
	a := c.a
	f := os.NewFile(uintptr(c.fd), "")
	nc, err := net.FileConn(f)
	f.Close()
	l.release(c)
	if err != nil {
		e.log.Warn("data: event loop: handing a connection over failed", "err", err)
		e.untrack(nil, a)
		return
	}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		nc.Close()
		e.untrack(nil, a)
		return
	}
	e.conns[nc] = struct{}{}
	e.mu.Unlock()
	go func() {
		e.serveDataFrom(nc, a, prefix)
		e.untrack(nc, a)
	}()
}

// shutdown closes everything the loop holds (the engine is closing).
func (l *eventLoop) shutdown() {
	l.mu.Lock()
	l.stop = true
	l.cuts = nil
	l.evOpen = false
	l.mu.Unlock()
	for _, c := range l.conns {
		l.closeConn(c)
	}
	rawClose(l.lfd)
	rawClose(l.epfd)
	rawClose(l.evfd)
}

func rawClose(fd int) { syscall.RawSyscall(syscall.SYS_CLOSE, uintptr(fd), 0, 0) }

// sockaddrAddrPort reads accept4's peer address.
func sockaddrAddrPort(rsa *syscall.RawSockaddrAny) netip.AddrPort {
	switch rsa.Addr.Family {
	case syscall.AF_INET:
		p := (*syscall.RawSockaddrInet4)(unsafe.Pointer(rsa))
		port := binary.BigEndian.Uint16((*[2]byte)(unsafe.Pointer(&p.Port))[:])
		return netip.AddrPortFrom(netip.AddrFrom4(p.Addr), port)
	case syscall.AF_INET6:
		p := (*syscall.RawSockaddrInet6)(unsafe.Pointer(rsa))
		port := binary.BigEndian.Uint16((*[2]byte)(unsafe.Pointer(&p.Port))[:])
		return netip.AddrPortFrom(netip.AddrFrom16(p.Addr), port)
	}
	return netip.AddrPort{}
}

// timerHeap orders the loop's connections by deadline (lconn.timer is
// each one's index).
type timerHeap []*lconn

func (h timerHeap) Len() int           { return len(h) }
func (h timerHeap) Less(i, j int) bool { return h[i].deadline.Before(h[j].deadline) }
func (h timerHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].timer, h[j].timer = i, j
}
func (h *timerHeap) Push(x any) {
	c := x.(*lconn)
	c.timer = len(*h)
	*h = append(*h, c)
}
func (h *timerHeap) Pop() any {
	old := *h
	c := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	c.timer = -1
	return c
}
