package sidechannel

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Limits bounds the connections a tcp side-channel server takes from the
// network. libzmq accepts without any bound (a connection that never
// completes the ZMTP handshake lives 30 s, one that completes it for good),
// so without a front an outsider can open connections until the process
// runs out of file descriptors, and the next ipc:// accept (the control
// socket) makes libzmq abort the process. With Limits the server's port is
// a Go listener that enforces them and relays each admitted connection's
// bytes, unchanged, to the ROUTER bound on a loopback tcp port (whose
// listener, unlike an ipc one, survives EMFILE).
type Limits struct {
	// MaxConns bounds open connections; 0 means DefaultLimits' value.
	MaxConns int
	// MaxConnsPerPeer bounds open connections from one remote IP (IPv6:
	// its /64); 0 means DefaultLimits' value.
	MaxConnsPerPeer int
	// FDReserve: a new connection is refused while fewer descriptors than
	// this are left under the soft RLIMIT_NOFILE (each admitted connection
	// costs three). 0 means no check.
	FDReserve int
	// FirstByteTimeout closes a connection that sends nothing this long
	// after connecting (a ZMTP peer sends its greeting at once); 0 means
	// DefaultLimits' value. Afterwards connections may idle: REQ peers
	// keep pooled connections open between requests.
	FirstByteTimeout time.Duration
}

// DefaultLimits are the side channel's bounds: 4096 connections, 256 per
// address, the transfer engine's (hw/mooncake) fd reserve and first-byte
// deadline. A kvflow node takes the caps and the reserve from its config
// (node.limits.side_channel_max_conns, side_channel_max_conns_per_peer
// and fd_reserve), whose defaults are these numbers (internal/config says
// why; a node test keeps the two equal).
var DefaultLimits = Limits{MaxConns: 4096, MaxConnsPerPeer: 256, FDReserve: 256, FirstByteTimeout: 10 * time.Second}

func (l Limits) withDefaults() Limits {
	if l.MaxConns <= 0 {
		l.MaxConns = DefaultLimits.MaxConns
	}
	if l.MaxConnsPerPeer <= 0 {
		l.MaxConnsPerPeer = DefaultLimits.MaxConnsPerPeer
	}
	if l.FirstByteTimeout <= 0 {
		l.FirstByteTimeout = DefaultLimits.FirstByteTimeout
	}
	return l
}

// Refusal reasons of kvflow_sidechannel_connections_refused_total.
const (
	refusedTotal   = "max_conns"
	refusedPeer    = "max_conns_per_peer"
	refusedFDs     = "fd_reserve"
	refusedUpstrm  = "upstream"
	timedOutFirstB = "first_byte"
)

// front accepts on the public address and relays to upstream.
type front struct {
	ln       net.Listener
	upstream string
	lim      Limits
	log      *slog.Logger
	refused  *prometheus.CounterVec
	headroom func() (int, error) // descriptors left; nil: no check

	mu        sync.Mutex
	pending   int                   // admitted relays not yet connected upstream
	left      int                   // descriptors left as of countedAt, less 3 per admission since
	countedAt time.Time             // when left was counted
	conns     map[net.Conn]struct{} // both ends of every relay
	perIP     map[string]int
	open      int
	closed    bool
	wg        sync.WaitGroup // the accept loop and every relay's goroutines
}

func newFront(ln net.Listener, upstream string, lim Limits, log *slog.Logger, refused *prometheus.CounterVec) *front {
	f := &front{ln: ln, upstream: upstream, lim: lim.withDefaults(), log: log, refused: refused,
		conns: map[net.Conn]struct{}{}, perIP: map[string]int{}}
	if f.lim.FDReserve > 0 {
		f.headroom = fdHeadroom
	}
	for _, r := range []string{refusedTotal, refusedPeer, refusedFDs, refusedUpstrm, timedOutFirstB} {
		refused.WithLabelValues(r)
	}
	f.wg.Add(1)
	go f.acceptLoop()
	return f
}

func (f *front) acceptLoop() {
	defer f.wg.Done()
	var backoff time.Duration
	for {
		c, err := f.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// EMFILE and friends: keep the listener, wait a little.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			f.log.Warn("side channel: accept failed", "err", err, "retry_in", backoff)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		if reason := f.admit(c); reason != "" {
			f.refused.WithLabelValues(reason).Inc()
			c.Close()
			continue
		}
		f.wg.Add(1)
		go f.relay(c)
	}
}

// admit counts c in, or says why it is refused.
func (f *front) admit(c net.Conn) string {
	ip := peerKey(c.RemoteAddr())
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case f.closed:
		return refusedTotal
	case f.open >= f.lim.MaxConns:
		return refusedTotal
	case f.perIP[ip] >= f.lim.MaxConnsPerPeer:
		return refusedPeer
	}
	if f.headroom != nil {
		// Three descriptors per relay: this one, the upstream dial and
		// libzmq's accepted end. Counting them reads /proc/self/fd: at
		// most every 10 ms, in between each admission spends three.
		now := time.Now()
		if now.Sub(f.countedAt) > 10*time.Millisecond {
			left, err := f.headroom()
			if err != nil {
				left = 1 << 30 // cannot count (no /proc): no check
			}
			// Relays not yet connected upstream hold one of their three.
			f.left, f.countedAt = left-2*f.pending, now
		}
		if f.left < f.lim.FDReserve+3 {
			return refusedFDs
		}
		f.left -= 3
	}
	f.open++
	f.pending++
	f.perIP[ip]++
	f.conns[c] = struct{}{}
	return ""
}

// settled marks an admitted relay connected upstream (or given up).
func (f *front) settled() {
	f.mu.Lock()
	f.pending--
	f.mu.Unlock()
}

func (f *front) release(c net.Conn, ip string) {
	f.mu.Lock()
	delete(f.conns, c)
	f.open--
	if f.perIP[ip]--; f.perIP[ip] <= 0 {
		delete(f.perIP, ip)
	}
	f.mu.Unlock()
}

// track adds a relay's upstream end so that close can cut it; false when
// the front is already closing.
func (f *front) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return false
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *front) untrack(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
}

// relay copies bytes both ways between the peer's connection and a fresh
// one to the ROUTER until either side ends, then closes both.
func (f *front) relay(c net.Conn) {
	defer f.wg.Done()
	ip := peerKey(c.RemoteAddr())
	defer f.release(c, ip)
	defer c.Close()
	settle := sync.OnceFunc(f.settled)
	defer settle()
	// The first byte before anything else is spent on the peer.
	c.SetReadDeadline(time.Now().Add(f.lim.FirstByteTimeout))
	var first [1]byte
	if _, err := io.ReadFull(c, first[:]); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			f.refused.WithLabelValues(timedOutFirstB).Inc()
		}
		return
	}
	c.SetReadDeadline(time.Time{})
	up, err := net.DialTimeout("tcp", f.upstream, 5*time.Second)
	settle()
	if err != nil {
		f.refused.WithLabelValues(refusedUpstrm).Inc()
		f.log.Warn("side channel: relay to the router failed", "err", err)
		return
	}
	if !f.track(up) {
		up.Close()
		return
	}
	defer f.untrack(up)
	defer up.Close()
	if tc, ok := up.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	if _, err := up.Write(first[:]); err != nil {
		return
	}
	done := make(chan struct{})
	go func() { // upstream -> peer; owned by this relay, which waits for it
		defer close(done)
		copyPlain(c, up)
		c.Close()
	}()
	copyPlain(up, c)
	up.Close()
	<-done
}

// copyPlain copies through a user-space buffer. io.Copy between two TCP
// connections splices through a kernel pipe: two more descriptors per
// direction, which would make a relay cost seven instead of the three the
// reserve counts (side-channel messages are small; the copy is cheap).
func copyPlain(dst io.Writer, src io.Reader) {
	buf := make([]byte, 32<<10)
	io.CopyBuffer(struct{ io.Writer }{dst}, struct{ io.Reader }{src}, buf)
}

// close stops accepting, cuts every relay and waits for their goroutines.
func (f *front) close() {
	f.mu.Lock()
	f.closed = true
	conns := make([]net.Conn, 0, len(f.conns))
	for c := range f.conns {
		conns = append(conns, c)
	}
	f.mu.Unlock()
	f.ln.Close()
	for _, c := range conns {
		c.Close()
	}
	f.wg.Wait()
}

// peerKey is the per-peer cap's key: the remote IP, an IPv6 one's /64.
func peerKey(a net.Addr) string {
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return a.String()
	}
	if ip4 := ta.IP.To4(); ip4 != nil {
		return ip4.String()
	}
	return ta.IP.Mask(net.CIDRMask(64, 128)).String() + "/64"
}

// fdHeadroom is how many descriptors are left under the soft limit.
func fdHeadroom() (int, error) {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		return 0, err
	}
	n, err := countFDs()
	if err != nil {
		return 0, err
	}
	if rl.Cur > uint64(1<<31) {
		return 1 << 31, nil
	}
	return int(rl.Cur) - n, nil
}

// countFDs counts open descriptors (/proc/self/fd; the transfer engine's
// hw/mooncake counts the same way).
func countFDs() (int, error) {
	d, err := os.Open("/proc/self/fd")
	if err != nil {
		return 0, fmt.Errorf("count descriptors: %w", err)
	}
	defer d.Close()
	n := 0
	for {
		names, err := d.Readdirnames(4096)
		n += len(names)
		if err == io.EOF {
			break
		}
		if err != nil {
			return 0, fmt.Errorf("count descriptors: %w", err)
		}
	}
	return n - 1, nil // less the directory being read
}
