package mooncake

import (
	"context"
	"errors"
	"io"
	"math"
	"net"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// dialFrom connects to addr from the loopback address src (127.0.0.0/8
// is all loopback on Linux), as a peer on another host would.
func dialFrom(t *testing.T, src, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatalf("dial %s from %s: %v", addr, src, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// closedByServer waits for the server to close c (read returns an error
// other than a timeout). The bound is far above any deadline under test:
// it only keeps a broken server from hanging the test.
func closedByServer(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	_, err := c.Read(make([]byte, 1))
	if err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("connection from %s still open: %v", c.LocalAddr(), err)
	}
}

// refusedAt dials addr from src and checks the server resets the
// connection at once (the reset may already fail the connect).
func refusedAt(t *testing.T, src, addr string) {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		if !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("dial %s from %s: %v, want a reset", addr, src, err)
		}
		return
	}
	defer c.Close()
	closedByServer(t, c)
}

func (e *TCPEngine) portOpen(pc *portConns) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return pc.total
}

func dataAddr(e *TCPEngine) string { return net.JoinHostPort("127.0.0.1", itoa(e.DataPort())) }
func rpcAddr(e *TCPEngine) string  { return net.JoinHostPort("127.0.0.1", itoa(e.RPCPort())) }
func itoa(n int) string            { return strconv.Itoa(n) }

// A connection that never sends a header is closed after
// FirstByteTimeout, one that goes quiet after IdleTimeout; both counted.
// An RPC connection gets HandshakeTimeout for its whole exchange.
func TestConnDeadlines(t *testing.T) {
	cfg := testConfig()
	cfg.FirstByteTimeout, cfg.IdleTimeout, cfg.HandshakeTimeout = 100*time.Millisecond, 200*time.Millisecond, 100*time.Millisecond
	srv, _ := newEngine(t, cfg)
	rem := register(t, srv, 1<<16, 1)

	silent := dialFrom(t, "127.0.0.1", dataAddr(srv))
	closedByServer(t, silent)
	waitFor(t, func() bool {
		return testutil.ToFloat64(srv.m.connTimedOut.WithLabelValues(portData, timeoutFirstByte)) == 1
	})

	// One served request, then silence.
	c := dialFrom(t, "127.0.0.1", dataAddr(srv))
	var hb [HeaderSize]byte
	PutHeader(&hb, Header{Size: 4096, Addr: AddrOf(rem), Opcode: OpcodeRead, V2: true})
	if _, err := c.Write(hb[:]); err != nil {
		t.Fatal(err)
	}
	resp := make([]byte, StatusSize+4096)
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.ReadFull(c, resp); err != nil {
		t.Fatalf("served read: %v", err)
	}
	closedByServer(t, c)
	waitFor(t, func() bool { return testutil.ToFloat64(srv.m.connTimedOut.WithLabelValues(portData, timeoutIdle)) == 1 })

	hs := dialFrom(t, "127.0.0.1", rpcAddr(srv))
	closedByServer(t, hs)
	waitFor(t, func() bool {
		return testutil.ToFloat64(srv.m.connTimedOut.WithLabelValues(portRPC, timeoutHandshake)) == 1
	})
	waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 0 && srv.portOpen(srv.rpcConns) == 0 })
}

// A kvflow initiator never sends on a lane the target closed for
// idleness: with the same IdleTimeout on both sides it drops a lane idle
// for half of it and dials afresh, so the read after the target closed
// the lane succeeds.
func TestIdleLaneReconnects(t *testing.T) {
	cfg := testConfig()
	cfg.IdleTimeout = 300 * time.Millisecond
	cfg.Lanes = 1 // the second read must use the lane the target closed
	srv, _ := newEngine(t, cfg)
	cli, _ := newEngine(t, cfg)
	rem := register(t, srv, 1<<16, 1)
	loc := register(t, cli, 1<<16, 2)
	ops := []Op{{Local: AddrOf(loc), Remote: AddrOf(rem), Length: 1 << 16}}
	for i := range 2 {
		if err := cli.BatchRead(context.Background(), srv.SessionID(), ops); err != nil {
			t.Fatalf("read %d: %v", i, err)
		}
		// The target cuts the idle lane.
		waitFor(t, func() bool {
			return testutil.ToFloat64(srv.m.connTimedOut.WithLabelValues(portData, timeoutIdle)) == float64(i+1)
		})
	}
	if err := cli.BatchRead(context.Background(), srv.SessionID(), ops); err != nil {
		t.Fatalf("read after the lane was closed: %v", err)
	}
}

// Per-peer and total caps: connections beyond them are reset at accept
// and counted; a closed connection frees its slot.
func TestConnCaps(t *testing.T) {
	for _, port := range []string{portData, portRPC} {
		t.Run(port, func(t *testing.T) {
			cfg := testConfig()
			cfg.MaxConns, cfg.MaxConnsPerPeer = 3, 2
			cfg.HandshakeTimeout = time.Minute // held connections stay open
			srv, _ := newEngine(t, cfg)
			addr, pc := dataAddr(srv), srv.dataConns
			if port == portRPC {
				addr, pc = rpcAddr(srv), srv.rpcConns
			}
			refused := func(reason string) float64 {
				return testutil.ToFloat64(srv.m.connRefused.WithLabelValues(port, reason))
			}
			a1 := dialFrom(t, "127.0.0.1", addr)
			dialFrom(t, "127.0.0.1", addr)
			waitFor(t, func() bool { return srv.portOpen(pc) == 2 })
			refusedAt(t, "127.0.0.1", addr)
			// Counted just after the close the peer sees.
			waitFor(t, func() bool { return refused(refusedPeerCap) >= 1 })
			if refused(refusedPeerCap) != 1 {
				t.Fatalf("peer_cap refusals %v, want 1", refused(refusedPeerCap))
			}
			dialFrom(t, "127.0.0.2", addr)
			waitFor(t, func() bool { return srv.portOpen(pc) == 3 })
			refusedAt(t, "127.0.0.3", addr)
			waitFor(t, func() bool { return refused(refusedTotalCap) >= 1 })
			if refused(refusedTotalCap) != 1 {
				t.Fatalf("total_cap refusals %v, want 1", refused(refusedTotalCap))
			}
			a1.Close()
			waitFor(t, func() bool { return srv.portOpen(pc) == 2 })
			dialFrom(t, "127.0.0.1", addr)
			waitFor(t, func() bool { return srv.portOpen(pc) == 3 })
			if refused(refusedPeerCap)+refused(refusedTotalCap)+refused(refusedFDReserve) != 2 {
				t.Fatal("a connection within the caps was refused")
			}
		})
	}
}

// MaxConnsPerPeer counts an address's connections that have not yet
// sent a valid request, and only once the port is under pressure (as
// many connections open as room left): below it a one-shot initiator may
// open a whole batch at once; above it one address's silent connections
// are capped while its working ones count only against MaxConns.
func TestPeerCapPending(t *testing.T) {
	cfg := testConfig()
	cfg.MaxConns, cfg.MaxConnsPerPeer = 8, 2
	srv, _ := newEngine(t, cfg)
	rem := register(t, srv, 1<<16, 1)
	addr := dataAddr(srv)
	refused := func(reason string) float64 {
		return testutil.ToFloat64(srv.m.connRefused.WithLabelValues(portData, reason))
	}
	// Below pressure: 4 silent connections from one address (twice the
	// cap) are admitted; the 5th finds the port half full and is refused.
	var silent []net.Conn
	for i := range 4 {
		silent = append(silent, dialFrom(t, "127.0.0.1", addr))
		waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == i+1 })
	}
	refusedAt(t, "127.0.0.1", addr)
	if refused(refusedPeerCap) != 1 {
		t.Fatalf("peer_cap refusals %v, want 1", refused(refusedPeerCap))
	}
	// A silent connection that sends a valid request leaves the address's
	// pending count: the address may open another silent one, then no
	// more (pending at the cap, port under pressure).
	for _, c := range silent[:3] {
		var hb [HeaderSize]byte
		PutHeader(&hb, Header{Size: 4096, Addr: AddrOf(rem), Opcode: OpcodeRead, V2: true})
		if _, err := c.Write(hb[:]); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, err := io.ReadFull(c, make([]byte, StatusSize+4096)); err != nil {
			t.Fatalf("served read: %v", err)
		}
	}
	dialFrom(t, "127.0.0.1", addr) // pending: 2
	waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 5 })
	refusedAt(t, "127.0.0.1", addr)
	if refused(refusedPeerCap) != 2 {
		t.Fatalf("peer_cap refusals %v, want 2", refused(refusedPeerCap))
	}
	// Other addresses fill the port; then the total cap refuses.
	for i, src := range []string{"127.0.0.2", "127.0.0.2", "127.0.0.4"} {
		dialFrom(t, src, addr)
		waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 6+i })
	}
	refusedAt(t, "127.0.0.3", addr)
	if refused(refusedTotalCap) != 1 || refused(refusedPeerCap) != 2 || refused(refusedFDReserve) != 0 {
		t.Fatalf("refusals peer_cap %v total_cap %v fd_reserve %v, want 2 1 0",
			refused(refusedPeerCap), refused(refusedTotalCap), refused(refusedFDReserve))
	}
}

func TestPeerCapped(t *testing.T) {
	const maxConns, perPeer = 100, 10
	for _, tc := range []struct {
		name           string
		pending, total int
		room           int64
		want           bool
	}{
		{"under the cap", 9, 99, 1000, false},
		{"at the cap, port under half", 10, 49, 1000, false},
		{"at the cap, port half full", 10, 50, 1000, true},
		{"past the cap, port under half", 500, 40, 1000, false},
		{"at the cap, descriptors half spent", 10, 20, 20, true},
		{"at the cap, descriptors to spare", 10, 20, 21, false},
		{"descriptors unknown", 10, 20, math.MaxInt64, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := peerCapped(tc.pending, tc.total, maxConns, perPeer, tc.room); got != tc.want {
				t.Fatalf("peerCapped(%d, %d, %d, %d, %d) = %v, want %v",
					tc.pending, tc.total, maxConns, perPeer, tc.room, got, tc.want)
			}
		})
	}
}

// With fewer than FDReserve descriptors left under the soft limit, new
// connections are refused (counted as fd_reserve); the engine keeps
// serving the connections it has.
func TestFDReserve(t *testing.T) {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	n, err := countFDs()
	if err != nil {
		t.Skipf("cannot count descriptors: %v", err)
	}
	cfg := testConfig()
	// Room for about 20 more descriptors in this process: the test's
	// own dials, the engines' listeners and accepted connections.
	cfg.FDReserve = int(min(rl.Cur, 1<<30)) - n - 20
	srv, _ := newEngine(t, cfg)
	ccfg := testConfig()
	ccfg.Lanes = 1 // its one lane is connected before the pressure
	cli, _ := newEngine(t, ccfg)
	rem := register(t, srv, 1<<16, 1)
	loc := register(t, cli, 1<<16, 2)
	ops := []Op{{Local: AddrOf(loc), Remote: AddrOf(rem), Length: 1 << 16}}
	if err := cli.BatchRead(context.Background(), srv.SessionID(), ops); err != nil {
		t.Fatal(err)
	}
	for i := 0; testutil.ToFloat64(srv.m.connRefused.WithLabelValues(portData, refusedFDReserve)) == 0; i++ {
		if i == 100 {
			t.Fatal("100 idle connections and none refused")
		}
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}
		c, err := d.Dial("tcp", dataAddr(srv))
		if err != nil && !errors.Is(err, syscall.ECONNRESET) {
			t.Fatal(err)
		}
		if c != nil {
			defer c.Close()
		}
		// Each dial is accepted or refused before the next (the
		// client's lane is the first connection).
		waitFor(t, func() bool {
			return srv.open.Load() > int64(i+1) ||
				testutil.ToFloat64(srv.m.connRefused.WithLabelValues(portData, refusedFDReserve)) > 0
		})
	}
	// The lanes the client already has still read.
	if err := cli.BatchRead(context.Background(), srv.SessionID(), ops); err != nil {
		t.Fatalf("read on an established lane under fd pressure: %v", err)
	}
}

func TestFDBudget(t *testing.T) {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	n, err := countFDs()
	if err != nil {
		t.Skipf("cannot count descriptors: %v", err)
	}
	if ents, err := os.ReadDir("/proc/self/fd"); err != nil || abs(len(ents)-1-n) > 2 {
		t.Fatalf("countFDs = %d, /proc/self/fd lists %d (%v)", n, len(ents), err)
	}
	limit := int(min(rl.Cur, 1<<30))
	now := time.Now()
	// Counted: the real descriptors and limit.
	for _, tc := range []struct {
		name    string
		reserve int
		want    bool
	}{
		{"off", 0, true},
		{"room", limit - n - 100, true},
		{"no room", limit - n + 10, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := fdBudget{reserve: tc.reserve}
			if got := b.allow(0, now); got != tc.want {
				t.Fatalf("allow = %v, want %v (counted %d, limit %d)", got, tc.want, b.counted, b.limit)
			}
		})
	}
	// Estimated within fdRecount of a count (500 open, 10 of them the
	// engine's, limit 1000, reserve 100): allowed while under 900.
	for _, tc := range []struct {
		open int64
		want bool
	}{{10, true}, {409, true}, {410, false}, {-1000, true}} {
		b := fdBudget{reserve: 100, at: now, counted: 500, limit: 1000, base: 10}
		if got := b.allow(tc.open, now.Add(fdRecount/2)); got != tc.want {
			t.Errorf("estimate with %d open: allow = %v, want %v", tc.open, got, tc.want)
		}
	}
	// Past fdRecount, it counts again.
	b := fdBudget{reserve: 100, at: now, counted: 1 << 20, limit: 1000, base: 0}
	if !b.allow(0, now.Add(fdRecount)) || b.counted == 1<<20 {
		t.Errorf("no recount after fdRecount: counted %d", b.counted)
	}
}

func abs(x int) int { return max(x, -x) }

func TestPeerKey(t *testing.T) {
	for _, tc := range []struct{ addr, want string }{
		{"10.1.2.3:5", "10.1.2.3"},
		{"[::ffff:10.1.2.3]:5", "10.1.2.3"},
		{"[2001:db8:1:2:aaaa::1]:5", "2001:db8:1:2::"},
		{"[2001:db8:1:2:bbbb::9]:7", "2001:db8:1:2::"},
	} {
		a, _ := net.ResolveTCPAddr("tcp", tc.addr)
		if got := peerKey(a).String(); got != tc.want {
			t.Errorf("peerKey(%s) = %s, want %s", tc.addr, got, tc.want)
		}
	}
}
