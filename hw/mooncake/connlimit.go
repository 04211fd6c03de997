package mooncake

import (
	"math"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Admission of accepted connections: per-port and per-peer caps and the
// file-descriptor reserve. Everything here runs once per accepted
// connection, never per request.

// Port names and refusal reasons (label values of
// kvflow_transfer_connections_refused_total and ..._timed_out_total).
const (
	portData = "data"
	portRPC  = "rpc"

	refusedPeerCap   = "peer_cap"   // the port under pressure, the address holds MaxConnsPerPeer pending
	refusedTotalCap  = "total_cap"  // the port holds MaxConns
	refusedFDReserve = "fd_reserve" // fewer than FDReserve descriptors left

	timeoutFirstByte = "first_byte" // no header within FirstByteTimeout
	timeoutIdle      = "idle"       // no request within IdleTimeout
	timeoutHandshake = "handshake"  // no whole handshake within HandshakeTimeout
)

// portConns counts one listener's open connections in total, and per
// remote address those not yet working (admission.working). Guarded by
// TCPEngine.mu.
type portConns struct {
	name    string // portData or portRPC
	total   int
	pending map[netip.Addr]int
}

func newPortConns(name string) *portConns {
	return &portConns{name: name, pending: map[netip.Addr]int{}}
}

// admission is one admitted connection's place in its port's counts.
// Until working is called it counts against MaxConnsPerPeer of its
// address: the connections a slowloris holds (silent, or authenticating,
// or stuck in a header) are the ones the per-address cap bounds, and
// FirstByteTimeout cuts them. A data connection becomes working once its
// first request is valid (authenticated, registered, granted): from then
// on it counts only against MaxConns, so a Mooncake initiator with its
// connection pool off (one connection per request, a whole batch at once:
// thousands from one address) is bounded by the port total and the
// descriptor reserve, not by the per-address cap. RPC connections (one
// handshake each) never become working.
type admission struct {
	e       *TCPEngine
	pc      *portConns
	key     netip.Addr
	pending bool // guarded by e.mu
}

// working moves the connection out of its address's pending count (once;
// later calls do nothing).
func (a *admission) working() {
	a.e.mu.Lock()
	if a.pending {
		a.pending = false
		a.pc.unpend(a.key)
	}
	a.e.mu.Unlock()
}

// peerCapped reports whether an address holding pending connections not
// yet working may not open another: when it holds perPeer of them and the
// port is under pressure, i.e. holds total connections, at least as many
// as it has room left for (maxConns - total, or room descriptors before
// the reserve, whichever is less). See TCPEngine.track.
func peerCapped(pending, total, maxConns, perPeer int, room int64) bool {
	return pending >= perPeer && int64(total) >= min(int64(maxConns-total), room)
}

// unpend drops one pending connection of key. Called with TCPEngine.mu held.
func (pc *portConns) unpend(key netip.Addr) {
	if pc.pending[key]--; pc.pending[key] <= 0 {
		delete(pc.pending, key)
	}
}

// peerKey is what MaxConnsPerPeer counts pending connections by: the
// remote IPv4 address, or the /64 of an IPv6 one (one host or site
// usually owns a whole /64, so counting single v6 addresses would cap
// nothing).
func peerKey(a net.Addr) netip.Addr {
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return netip.Addr{}
	}
	return peerKeyOf(ta.AddrPort())
}

// peerKeyOf is peerKey of an address and port.
func peerKeyOf(ap netip.AddrPort) netip.Addr {
	ip := ap.Addr().Unmap()
	if ip.Is6() {
		if p, err := ip.Prefix(64); err == nil {
			return p.Addr()
		}
	}
	return ip
}

// fdBudget decides whether the process may spend one more descriptor on
// a peer's connection: not when fewer than reserve would be left under
// the soft RLIMIT_NOFILE. Counting /proc/self/fd costs a directory read,
// so it is done at most every fdRecount; in between, the count is
// estimated from the engine's own open connections (the only descriptors
// an outsider can make the process open quickly).
type fdBudget struct {
	reserve int

	mu      sync.Mutex
	at      time.Time // last count; zero: never
	counted int       // descriptors open then; < 0: cannot count (check off)
	limit   uint64    // soft RLIMIT_NOFILE then
	base    int64     // engine connections open then
}

// fdRecount: under a connection flood, at most 100 directory reads a
// second (~50 µs each at 1000 descriptors).
const fdRecount = 10 * time.Millisecond

// allow reports whether a new connection may be kept, given the engine's
// open connections (not counting the new one).
func (b *fdBudget) allow(open int64, now time.Time) bool {
	return b.room(open, now) > 0
}

// room is the number of descriptors the engine's connections may still
// take before fewer than reserve are left (math.MaxInt64 when the check
// is off or descriptors cannot be counted), given its open connections.
func (b *fdBudget) room(open int64, now time.Time) int64 {
	if b.reserve <= 0 {
		return math.MaxInt64
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.at.IsZero() || now.Sub(b.at) >= fdRecount {
		b.at, b.base = now, open
		b.counted = -1
		var rl syscall.Rlimit
		if n, err := countFDs(); err == nil && syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl) == nil {
			b.counted, b.limit = n, rl.Cur
		}
	}
	if b.counted < 0 {
		return math.MaxInt64
	}
	est := max(int64(b.counted)+open-b.base, 0)
	return int64(min(b.limit, math.MaxInt64/2)) - int64(b.reserve) - est
}

// logEvery rate-limits a log line: ok reports whether to log now and how
// many events were suppressed since the last line.
type logEvery struct {
	last       atomic.Int64 // unix nanoseconds of the last line
	suppressed atomic.Int64
}

func (l *logEvery) ok(now time.Time, every time.Duration) (bool, int64) {
	last := l.last.Load()
	if now.UnixNano()-last < int64(every) || !l.last.CompareAndSwap(last, now.UnixNano()) {
		l.suppressed.Add(1)
		return false, 0
	}
	return true, l.suppressed.Swap(0)
}
