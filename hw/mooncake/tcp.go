package mooncake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// TCPEngine is the pure-Go engine speaking Mooncake's TCP transport.
type TCPEngine struct {
	cfg     TCPConfig
	log     *slog.Logger
	m       *metrics
	regions regionTable
	grants  grantTable
	auth    *authServer // RequireAuth: the target's secret (auth.go); nil otherwise
	creds   credStore   // credentials presented to targets, per session (auth.go)

	rpcLn, dataLn net.Listener
	dataPort      int
	loop          *eventLoop // the data port's event loop (loop_linux.go); nil: acceptLoop serves it
	session       string
	host          string // advertised host

	// Admission of accepted connections (connlimit.go).
	fds                 fdBudget
	open                atomic.Int64 // accepted connections open (both ports)
	dataConns, rpcConns *portConns   // guarded by mu
	refuseLog           logEvery

	mu      sync.Mutex
	closed  bool
	conns   map[net.Conn]struct{} // accepted connections, closed by Close
	peers   map[string]*peer
	ctx     context.Context // cancelled when Close starts
	cancel  context.CancelFunc
	done    chan struct{} // closed when Close starts
	stopped chan struct{} // closed when every goroutine has returned
	wg      sync.WaitGroup
}

var _ Engine = (*TCPEngine)(nil)

// NewTCPEngine validates cfg, binds both listeners and starts serving.
// reg may be nil (metrics not registered); log may be nil (discarded).
func NewTCPEngine(cfg TCPConfig, reg prometheus.Registerer, log *slog.Logger) (*TCPEngine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	e := &TCPEngine{
		cfg:       cfg,
		m:         newMetrics(reg),
		conns:     map[net.Conn]struct{}{},
		peers:     map[string]*peer{},
		fds:       fdBudget{reserve: cfg.FDReserve},
		dataConns: newPortConns(portData),
		rpcConns:  newPortConns(portRPC),
		done:      make(chan struct{}),
		stopped:   make(chan struct{}),
	}
	e.ctx, e.cancel = context.WithCancel(context.Background())
	e.grants.grace = cfg.RevokeGrace
	e.grants.onCut = func(n int) { e.m.grantCuts.Add(float64(n)) }
	var err error
	if cfg.RequireAuth {
		if e.auth, err = newAuthServer(reg); err != nil {
			e.cancel()
			return nil, err
		}
	}
	lc := listenConfig()
	if e.rpcLn, err = lc.Listen(e.ctx, "tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.RPCPort))); err != nil {
		e.cancel()
		return nil, fmt.Errorf("mooncake: listen rpc %s:%d: %w", cfg.Host, cfg.RPCPort, err)
	}
	if e.dataLn, err = lc.Listen(e.ctx, "tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.DataPort))); err != nil {
		e.rpcLn.Close()
		e.cancel()
		return nil, fmt.Errorf("mooncake: listen data %s:%d: %w", cfg.Host, cfg.DataPort, err)
	}
	e.host = cfg.AdvertiseHost
	if e.host == "" {
		e.host = cfg.Host
		if ip := net.ParseIP(cfg.Host); cfg.Host == "" || (ip != nil && ip.IsUnspecified()) {
			if e.host, err = os.Hostname(); err != nil {
				e.rpcLn.Close()
				e.dataLn.Close()
				e.cancel()
				return nil, fmt.Errorf("mooncake: advertise host: %w", err)
			}
		}
	}
	e.session = net.JoinHostPort(e.host, strconv.Itoa(e.RPCPort()))
	e.log = log.With("component", "hw/mooncake", "session", e.session)
	e.dataPort = e.dataLn.Addr().(*net.TCPAddr).Port
	e.wg.Add(2)
	go e.acceptLoop(e.rpcLn, e.rpcConns, e.serveRPC)
	// The data port: the event loop where it can serve (Linux, no
	// data-plane auth), every connection on a goroutine otherwise.
	serving := "goroutines"
	if !cfg.NoEventLoop && e.auth == nil {
		l, err := newEventLoop(e, e.dataLn)
		switch {
		case err == nil:
			e.loop, serving = l, "event loop"
		case !errors.Is(err, errNoLoop):
			e.log.Warn("data port: event loop unavailable, serving every connection on a goroutine", "err", err)
		}
	}
	if e.loop != nil {
		go e.loop.run()
	} else {
		go e.acceptLoop(e.dataLn, e.dataConns, e.serveData)
	}
	e.log.Info("transfer engine listening", "rpc_port", e.RPCPort(), "data_port", e.DataPort(), "data_serving", serving,
		"read_grants", cfg.ReadGrants, "require_auth", cfg.RequireAuth)
	return e, nil
}

// RPCPort is the handshake port.
func (e *TCPEngine) RPCPort() int { return e.rpcLn.Addr().(*net.TCPAddr).Port }

// DataPort is the data port (tcp_data_port).
func (e *TCPEngine) DataPort() int { return e.dataPort }

// SessionID is "advertise_host:rpc_port", this engine's segment name.
func (e *TCPEngine) SessionID() string { return e.session }

// Register adds a region. name is the buffer name in the segment
// descriptor (Mooncake uses the segment name); "" means SessionID.
func (e *TCPEngine) Register(addr, length uint64, name string) error {
	if e.isClosed() {
		return ErrClosed
	}
	if name == "" {
		name = e.session
	}
	return e.regions.add(addr, length, name)
}

// Unregister removes the region at addr, waiting until no transfer uses
// it (transfers are bounded by IOTimeout).
func (e *TCPEngine) Unregister(addr uint64) error {
	r, err := e.regions.remove(addr)
	if err != nil {
		return err
	}
	<-r.drained
	return nil
}

// Slice returns registered memory as a []byte.
func (e *TCPEngine) Slice(addr, length uint64) ([]byte, error) { return e.regions.slice(addr, length) }

// Grant allows peers to access the ranges when ReadGrants is on. Grants
// are counted: each Grant of a range needs its own Revoke.
func (e *TCPEngine) Grant(ranges ...Range) error { return e.grants.grant(ranges) }

// Revoke drops one grant of each range at once and returns when no read of
// the bytes it ungranted is in flight any more: at once when none is, at
// most RevokeGrace later (a reader still in flight then has its
// connection cut). Prefer RevokeAsync where a caller must not wait.
func (e *TCPEngine) Revoke(ranges ...Range) error {
	done, err := e.grants.revoke(ranges)
	<-done
	return err
}

// RevokeAsync drops one grant of each range at once — from now on a
// request for bytes no grant covers is refused — and never waits: the
// channel it returns is closed when no read of those bytes is in flight
// any more (already closed when none was), so the owner may reuse them
// then and not before. A read still in flight RevokeGrace after the
// revoke (a reader that stalls mid-range) has its connection cut, counted
// in kvflow_transfer_grant_reads_cut_total. Ranges shared with another
// grant stay readable and are not waited for.
func (e *TCPEngine) RevokeAsync(ranges ...Range) (<-chan struct{}, error) {
	return e.grants.revoke(ranges)
}

// GrantAll makes every registered range readable (with ReadGrants on)
// until the matching RevokeAll: for a held request whose blocks are not
// known (an engine that sends no block ids). Counted, like Grant.
func (e *TCPEngine) GrantAll() { e.grants.grantAll() }

// RevokeAll ends one GrantAll, at once.
func (e *TCPEngine) RevokeAll() error { return e.grants.revokeAll() }

// Segment is the descriptor this engine sends in handshakes: as an
// initiator always; as a target with KvflowOps cleared unless the
// initiator's descriptor carried some (serveRPC).
func (e *TCPEngine) Segment() *SegmentDesc {
	var ops uint32
	if !e.cfg.NoKvflowOps && e.cfg.ProtoVersion >= 2 {
		ops = KvflowOpStridedRead
	}
	return &SegmentDesc{
		KvflowOps:       ops,
		Buffers:         e.regions.buffers(),
		Name:            e.session,
		Protocol:        "tcp",
		TCPDataPort:     e.DataPort(),
		TCPProtoVersion: e.cfg.ProtoVersion,
		Timestamp:       FormatTimestamp(time.Now()),
	}
}

func (e *TCPEngine) isClosed() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.closed
}

// Close stops both listeners, closes every connection, fails queued and
// in-flight ops with ErrClosed and waits for every goroutine.
func (e *TCPEngine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		<-e.stopped
		return nil
	}
	e.closed = true
	close(e.done)
	e.cancel()
	for c := range e.conns {
		c.Close()
	}
	peers := make([]*peer, 0, len(e.peers))
	for _, p := range e.peers {
		peers = append(peers, p)
	}
	e.mu.Unlock()
	e.rpcLn.Close()
	e.dataLn.Close()
	if e.loop != nil {
		e.loop.close()
	}
	for _, p := range peers {
		for _, l := range p.lanes {
			l.shutdown()
		}
	}
	e.wg.Wait()
	close(e.stopped)
	e.log.Info("transfer engine closed")
	return nil
}

// errNoLoop: this platform has no event loop (loop_other.go); every data
// connection is served on a goroutine (acceptLoop, serveData).
var errNoLoop = errors.New("no event loop on this platform")

// errEngineClosed: track found the engine closing.
var errEngineClosed = errors.New("closing")

// track admits an accepted connection of port pc, counted against the
// caps (pending for its address, see admission), and records it so Close
// can end it; room is what the descriptor reserve still allows
// (fdBudget.room). It returns the refusal reason ("" when admitted), or
// errEngineClosed.
//
// MaxConnsPerPeer applies once the port is under pressure: it holds at
// least as many connections as it has room left for (under MaxConns and
// under the descriptor reserve, whichever is less). Below that, an
// address may hold any number of pending connections: a Mooncake
// initiator with its connection pool off connects for a whole batch
// before its first header is written (thousands from one address, each
// pending for a moment). Above it, one address cannot take more than
// MaxConnsPerPeer of the second half with connections that do nothing,
// and its silent ones are gone within FirstByteTimeout.
func (e *TCPEngine) track(c net.Conn, pc *portConns, key netip.Addr, room int64) (*admission, string, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case e.closed:
		return nil, "", errEngineClosed
	case pc.total >= e.cfg.MaxConns:
		return nil, refusedTotalCap, nil
	case peerCapped(pc.pending[key], pc.total, e.cfg.MaxConns, e.cfg.MaxConnsPerPeer, room):
		return nil, refusedPeerCap, nil
	}
	pc.total++
	pc.pending[key]++
	e.open.Add(1)
	if c != nil { // nil: a connection the event loop holds (loop_linux.go)
		e.conns[c] = struct{}{}
	}
	e.wg.Add(1)
	return &admission{e: e, pc: pc, key: key, pending: true}, "", nil
}

// untrack closes c and gives back what track took; c is nil for a
// connection the event loop closed itself.
func (e *TCPEngine) untrack(c net.Conn, a *admission) {
	if c != nil {
		c.Close()
	}
	e.mu.Lock()
	if c != nil {
		delete(e.conns, c)
	}
	a.pc.total--
	if a.pending {
		a.pending = false
		a.pc.unpend(a.key)
	}
	e.mu.Unlock()
	e.open.Add(-1)
	e.wg.Done()
}

// refuse closes a connection at accept with a reset (the peer learns at
// once, and no descriptor lingers), counts it and logs at most every 10 s.
func (e *TCPEngine) refuse(c net.Conn, port, reason string) {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	e.refused(port, reason, c.RemoteAddr()) // counted before the peer can see the reset
	c.Close()
}

// refused counts a refused connection and logs at most every 10 s.
func (e *TCPEngine) refused(port, reason string, peer fmt.Stringer) {
	e.m.connRefused.WithLabelValues(port, reason).Inc()
	if ok, n := e.refuseLog.ok(time.Now(), 10*time.Second); ok {
		e.log.Warn("connection refused", "port", port, "reason", reason, "peer", peer.String(),
			"refused_since_last_log", n, "max_conns", e.cfg.MaxConns, "max_conns_per_peer", e.cfg.MaxConnsPerPeer,
			"fd_reserve", e.cfg.FDReserve)
	}
}

// acceptLoop accepts pc's connections: each is admitted (descriptor
// reserve, then caps) or refused, and served on its own goroutine (the
// one that accepted it, having started the next acceptor).
func (e *TCPEngine) acceptLoop(ln net.Listener, pc *portConns, serve func(net.Conn, *admission)) {
	defer e.wg.Done()
	var backoff time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			select {
			case <-e.done:
				return
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Transient (EMFILE and the like): back off instead of spinning.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			e.log.Warn("accept failed", "addr", ln.Addr().String(), "err", err, "backoff", backoff)
			select {
			case <-e.done:
				return
			case <-time.After(backoff):
			}
			continue
		}
		backoff = 0
		room := e.fds.room(e.open.Load(), time.Now())
		if room <= 0 {
			e.refuse(c, pc.name, refusedFDReserve)
			continue
		}
		key := peerKey(c.RemoteAddr())
		a, reason, err := e.track(c, pc, key, room)
		if err != nil {
			c.Close()
			return
		}
		if reason != "" {
			e.refuse(c, pc.name, reason)
			continue
		}
		// Leader/follower: a fresh goroutine takes over accepting and
		// this one serves c at once. With Mooncake's default initiator (a
		// new connection per request) the request is then served without
		// a handoff to a new goroutine, which another P would steal after
		// a spin (BenchmarkOneShotRead, bench/mooncake-target.sh). One
		// goroutine accepts at any time.
		e.wg.Add(1)
		go e.acceptLoop(ln, pc, serve)
		serve(c, a)
		e.untrack(c, a)
		return
	}
}

// Replies Mooncake's handshake daemon gives a TCP-only engine: an empty
// HandShakeDesc for Connection (TcpTransport installs no handshake
// callback), receivePeerNotify's and receivePeerProbe's answers.
var (
	replyConnection = []byte(`{"local_gid":"","local_lid":0,"local_nic_path":"","payload":"","peer_nic_path":"","qp_num":[],"reply_msg":""}` + "\n")
	replyNotify     = []byte(`{"name":"","notify_msg":"success"}` + "\n")
	replyProbe      = []byte(`{"status":"success"}` + "\n")
)

// serveRPC answers one handshake frame per connection, as Mooncake's
// daemon does: read a frame, reply with the same type, half-close, wait
// for the peer to close.
func (e *TCPEngine) serveRPC(c net.Conn, _ *admission) {
	// The whole exchange, first byte included, within HandshakeTimeout.
	c.SetDeadline(time.Now().Add(e.cfg.HandshakeTimeout))
	if e.auth != nil && !e.authenticate(c, portRPC) {
		return
	}
	t, payload, err := ReadFrame(c, e.cfg.MaxFrame)
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			e.m.connTimedOut.WithLabelValues(portRPC, timeoutHandshake).Inc()
			e.log.Debug("handshake: no frame in time", "peer", c.RemoteAddr().String(), "timeout", e.cfg.HandshakeTimeout)
			return
		}
		e.log.Warn("handshake: bad frame", "peer", c.RemoteAddr().String(), "err", err)
		return
	}
	if !json.Valid(payload) {
		e.log.Warn("handshake: malformed json", "peer", c.RemoteAddr().String(), "type", t.String(), "bytes", len(payload))
		return
	}
	var reply []byte
	switch t {
	case FrameMetadata:
		seg := e.Segment()
		// kvflow's ops are advertised only to an initiator that
		// advertised its own: a Mooncake initiator gets Mooncake's
		// descriptor.
		var req struct {
			KvflowOps uint32 `json:"kvflow_ops"`
		}
		if json.Unmarshal(payload, &req) != nil || req.KvflowOps == 0 {
			seg.KvflowOps = 0
		}
		reply = EncodeSegment(seg)
		if len(reply)+1 > DefaultMaxFrame {
			e.log.Warn("handshake: segment descriptor exceeds Mooncake's default frame cap", "bytes", len(reply))
		}
	case FrameConnection, FrameLegacy:
		reply = replyConnection
	case FrameNotify:
		var n struct {
			Name string `json:"name"`
			Msg  string `json:"notify_msg"`
		}
		_ = json.Unmarshal(payload, &n)
		e.log.Debug("handshake: notify", "peer_name", n.Name, "bytes", len(n.Msg))
		reply = replyNotify
	case FrameProbe:
		reply = replyProbe
	}
	if _, err := c.Write(AppendFrame(nil, t, reply)); err != nil {
		e.log.Warn("handshake: reply failed", "peer", c.RemoteAddr().String(), "err", err)
		return
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.CloseWrite()
	}
	// Wait for the peer's close (bounded by the deadline).
	io.Copy(io.Discard, io.LimitReader(c, 1<<10))
}

// The TCP engine's optional capabilities.
var (
	_ GatherReader      = (*TCPEngine)(nil)
	_ StridedReader     = (*TCPEngine)(nil)
	_ SegmentReader     = (*TCPEngine)(nil)
	_ Granter           = (*TCPEngine)(nil)
	_ PeerAuthenticator = (*TCPEngine)(nil)
)
