package mooncake

import (
	"errors"
	"flag"
	"fmt"
	"time"
)

// TCPConfig configures the pure-Go TCP engine.
type TCPConfig struct {
	// Host is the address both listeners bind to; "" or "0.0.0.0" binds all
	// interfaces.
	Host string
	// AdvertiseHost is the host part of SessionID. Empty: Host, or the
	// machine's hostname when Host is unspecified.
	AdvertiseHost string
	// RPCPort is the handshake port (Mooncake's rpc_port); 0 picks a free one.
	RPCPort int
	// DataPort is the data port advertised as tcp_data_port; 0 picks one.
	DataPort int

	// Lanes is the number of persistent data connections per peer.
	Lanes int
	// QueueDepth bounds the requests queued per peer: a batch submitter
	// waits while this many are queued, then queues all of its own (a
	// batch shorter than every queued one does not wait).
	QueueDepth int
	// Pipeline is the number of READ requests a lane keeps outstanding:
	// headers sent ahead while the responses of earlier ones are still
	// arriving, served in order by the target. 1 sends one request per
	// round trip. WRITEs always run one at a time.
	Pipeline int
	// PipelineBytes caps the bytes of a lane's outstanding READs beyond
	// the first two: small requests get a deep window (many in flight per
	// round trip), large ones keep two, so a short batch queued behind
	// large ones waits for little data. 0 means no cap.
	PipelineBytes int
	// ChunkSize is the largest single request and socket read/write: ops
	// longer than this are split into several requests spread over lanes.
	ChunkSize int
	// MaxFrame caps a handshake frame (length prefix included type byte).
	MaxFrame int

	ConnectTimeout   time.Duration // dialing a peer's RPC or data port
	HandshakeTimeout time.Duration // one whole handshake exchange
	// IOTimeout fails a transfer when no chunk completes for this long
	// (an initiator's lane notices within IOTimeout/8 more: its deadline
	// moves at most that often).
	IOTimeout time.Duration

	// ReadGrants, when on, serves only ranges covered by Grant (and not yet
	// Revoked); other requests are refused with the v2 reject status and
	// counted. Off by default for Mooncake compatibility.
	ReadGrants bool
	// RevokeGrace is how long a revoked grant lets reads already in
	// flight of its bytes finish (RevokeAsync's channel closes when the
	// last ends) before their connections are cut.
	RevokeGrace time.Duration
	// AcceptWrites serves WRITE requests: a peer writing into this
	// engine's registered memory. Off by default: kvflow only reads, and a
	// target that takes writes lets any peer that reaches its data port
	// overwrite its KV cache. Refused writes get the v2 reject status and
	// are counted (reason write_refused). Mooncake's engines accept them;
	// turn it on to serve a peer that writes (kvflow bench te does).
	AcceptWrites bool
	// RequireAuth makes both ports serve only initiators that prove they
	// hold a credential this engine issued (AuthToken, sent by the side
	// channel over CURVE; see doc.go, "Data-plane authentication"): the
	// segment descriptor and every byte are refused to anyone else,
	// Mooncake peers included. The engine draws its secret at start, so
	// credentials die with the process. Off by default (Mooncake
	// compatibility); kvflow's node turns it on with auth.mode curve.
	RequireAuth bool
	// ProtoVersion is the tcp_proto_version advertised to peers: 2 (status
	// frames). 1 exists to exercise legacy framing in tests.
	ProtoVersion int
	// NoKvflowOps makes the engine speak Mooncake's protocol only: it
	// neither advertises nor serves nor sends kvflow's strided READ
	// (BatchReadGather then reads row by row). Off by default: the op is
	// negotiated per peer in the handshake, so Mooncake peers never see it
	// anyway (doc.go, "kvflow's strided READ").
	NoKvflowOps bool
	// NoEventLoop serves every data connection on a goroutine of its own.
	// Off by default: on Linux, connections start on the data port's event
	// loop, which serves one plain READ at a time (Mooncake's initiator,
	// pool off or on) and hands anything else to a goroutine (loop_linux.go).
	// The event loop is off anyway when RequireAuth is on.
	NoEventLoop bool

	// What a peer that reaches the data or RPC port can hold; see
	// doc.go, "Connections an outsider can open". Every refusal is counted
	// in kvflow_transfer_connections_refused_total{port,reason}.

	// FirstByteTimeout closes a data connection on which no request header
	// starts this long after the accept.
	FirstByteTimeout time.Duration
	// IdleTimeout closes a data connection with no request for this long
	// (a persistent lane between bursts). An initiator drops its own lanes
	// after IdleTimeout/2 without a request and dials afresh, so a kvflow
	// peer with the same setting never sends on a lane the target is about
	// to close.
	IdleTimeout time.Duration
	// MaxConns caps the open connections of each port (data, RPC).
	// MaxConnsPerPeer caps, per port and remote address (an IPv6 peer
	// counts per /64), the connections not yet working (a data connection
	// works once its first request is valid; an RPC one never does), and
	// only while the port is under pressure: it holds at least as many
	// connections as it has room left for, under MaxConns or under
	// FDReserve, whichever is less. A connection beyond either cap is
	// closed at once. Working connections count only against MaxConns, so
	// a Mooncake initiator with its pool off (a connection per request, a
	// whole batch at once) is not capped per address.
	MaxConns, MaxConnsPerPeer int
	// FDReserve is the number of file descriptors kept free for the rest of
	// the process: a new connection to either port is closed at once when
	// the process holds more than the soft RLIMIT_NOFILE minus this many,
	// so the control socket, the side channel and the HTTP endpoint can
	// still accept (libzmq aborts the process when an ipc:// accept fails
	// for want of a descriptor). 0 turns the check off.
	FDReserve int
}

// DefaultTCPConfig returns the defaults; each number says why.
func DefaultTCPConfig() TCPConfig {
	return TCPConfig{
		// Loopback: the embedded default (demo, tests) runs P and D on one
		// host. Deployments set the worker's address.
		Host: "127.0.0.1",
		// Mooncake's own default lane count (MC_TCP_LANES_PER_PEER=4); on
		// two cores four lanes keep the socket busy while one lane is
		// between requests.
		Lanes: 4,
		// A lane's next header is on the wire while the current response
		// streams, so the server never idles for a round trip. Small
		// requests (4–32 KiB per layer in the small case) need many in
		// flight to fill a round trip and let the target gather their
		// answers into one write; large ones need two. Over a 1 ms link
		// (bench e2e --netem "delay 1ms", small) a window of 64 requests
		// × 4 lanes kept reads waiting ~10 round trips behind each other
		// (~800 req/s); 256 and 4 MiB carried ~950–1250 req/s. Once the
		// delay is the kernel's (a 2 ms round trip TCP sees) and a lane
		// refills at half its window, 4 KiB answers need 512: 256 kept
		// ~0.75 MiB per lane in flight, under the link's bandwidth-delay
		// product (small netem, 6 interleaved runs each: 1082 → 1178
		// req/s; small on loopback 1.9k–2.1k → 2.0k–2.6k). The byte
		// cap bounds what a short batch (taken first by the queue) waits
		// for behind requests already on the wire: ~Lanes × (4 MiB + two
		// requests); mixed 1-block p99 stayed at 30–40 ms on loopback.
		Pipeline:      512,
		PipelineBytes: 4 << 20,
		// Mooncake's default per-peer queue bound
		// (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER).
		QueueDepth: 1024,
		// ≥1 MiB socket writes reach iperf3 parity on this box (Mooncake's
		// 64 KiB slice does not); 4 MiB also splits huge ops over lanes.
		ChunkSize: 4 << 20,
		// Mooncake's kDefaultHandshakeMaxLength.
		MaxFrame: DefaultMaxFrame,
		// A refused or unroutable peer should fail a batch fast.
		ConnectTimeout: 3 * time.Second,
		// Mooncake's handshake daemon uses SO_RCVTIMEO of 5 s.
		HandshakeTimeout: 5 * time.Second,
		// A 4 MiB chunk takes ~2 ms at 2 GB/s; 10 s of no progress is a
		// dead or wedged peer, not a slow one.
		IOTimeout: 10 * time.Second,
		// Mooncake compatibility: serve everything registered.
		ReadGrants: false,
		// A read still in flight when its blocks are freed belongs to a
		// request already given up (aborted, force-freed) or to a peer
		// that does not read what it asked for: a legitimate one has
		// sent its DONE after its reads. A 4 MiB chunk takes ~2 ms at
		// 2 GB/s (~40 ms at 100 MB/s), so 1 s is a stalled reader; the
		// engine gets the blocks back at most this late.
		RevokeGrace: time.Second,
		// kvflow never writes into a peer: refuse what it never needs.
		AcceptWrites: false,
		ProtoVersion: ProtoVersion,
		// kvflow's lanes and Mooncake's initiators send a header within
		// microseconds of connecting; 10 s also covers a peer descheduled
		// under load. An outsider's silent connection is gone after it.
		FirstByteTimeout: 10 * time.Second,
		// Lanes are persistent and legitimately idle between bursts: a
		// decode worker can be quiet for minutes at low traffic. 5 min
		// keeps every lane of an active peer (kvflow's own drop theirs at
		// 2.5 min) while an idle connection cannot be held for ever.
		IdleTimeout: 5 * time.Minute,
		// A kvflow peer holds Lanes (4) connections, but a Mooncake
		// initiator with its connection pool off (its default) opens one
		// per request, a whole batch at once: the seed's decode reads
		// layers × caches × block groups requests (61 × 2 × G) per batch
		// from 32 threads, several ranks per host. 8 threads × 2048
		// requests from one process (TestStockMooncakeInitiator) held up
		// to ~3400 connections open at once on loopback, ~1600 of them
		// before their first request. 32768 leaves a busy prefill rank
		// room for several such hosts; what bounds it in practice is the
		// descriptor budget (FDReserve below the soft RLIMIT_NOFILE, which
		// kvflow serve raises to the hard limit). Each open data
		// connection costs ~72 KiB (a 64 KiB header buffer and a
		// goroutine), ~2.3 GiB at the cap.
		MaxConns: 32768,
		// The per-address cap bounds only connections that have sent no
		// valid request yet, and only once the port is under pressure
		// (half of its room taken): what a slowloris holds, each gone
		// within FirstByteTimeout. Then one outside address holds at most
		// 256 of the other half, and a legitimate peer's working
		// connections (its lanes, a one-shot initiator's transfers in
		// flight) still count only against MaxConns.
		MaxConnsPerPeer: 256,
		// Room for what the process opens besides data connections: the
		// side channel's peers (ZMQ keeps one descriptor per connected
		// socket; each decode rank holds up to ~20), the control socket,
		// HTTP (capped at 64) and the cache file. At the common soft limit
		// of 1024 it leaves data connections ~750.
		FDReserve: 256,
	}
}

// Validate reports every problem of c.
func (c TCPConfig) Validate() error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf("mooncake config: "+format, a...)) }
	if c.RPCPort < 0 || c.RPCPort > 65535 {
		bad("rpc port %d out of range", c.RPCPort)
	}
	if c.DataPort < 0 || c.DataPort > 65535 {
		bad("data port %d out of range", c.DataPort)
	}
	if c.RPCPort != 0 && c.RPCPort == c.DataPort {
		bad("rpc port and data port are both %d", c.RPCPort)
	}
	if c.Lanes < 1 || c.Lanes > 64 {
		bad("lanes %d not in 1..64", c.Lanes)
	}
	if c.Pipeline < 1 || c.Pipeline > 1024 {
		bad("pipeline %d not in 1..1024", c.Pipeline)
	}
	if c.PipelineBytes < 0 {
		bad("pipeline bytes %d < 0", c.PipelineBytes)
	}
	if c.QueueDepth < 1 {
		bad("queue depth %d < 1", c.QueueDepth)
	}
	if c.ChunkSize < 64<<10 {
		bad("chunk size %d < 64 KiB", c.ChunkSize)
	}
	if c.MaxFrame < 1<<10 || c.MaxFrame > 128<<20 {
		bad("max frame %d not in 1 KiB..128 MiB", c.MaxFrame)
	}
	for name, d := range map[string]time.Duration{
		"connect timeout": c.ConnectTimeout, "handshake timeout": c.HandshakeTimeout, "io timeout": c.IOTimeout,
		"revoke grace": c.RevokeGrace,
	} {
		if d <= 0 {
			bad("%s %v must be positive", name, d)
		}
	}
	for name, d := range map[string]time.Duration{"first byte timeout": c.FirstByteTimeout, "idle timeout": c.IdleTimeout} {
		if d <= 0 {
			bad("%s %v must be positive", name, d)
		}
	}
	if c.MaxConns < 1 {
		bad("max conns %d < 1", c.MaxConns)
	}
	if c.MaxConnsPerPeer < 1 || c.MaxConnsPerPeer > c.MaxConns {
		bad("max conns per peer %d not in 1..max conns (%d)", c.MaxConnsPerPeer, c.MaxConns)
	}
	if c.FDReserve < 0 {
		bad("fd reserve %d < 0", c.FDReserve)
	}
	if c.ProtoVersion != 1 && c.ProtoVersion != 2 {
		bad("proto version %d not 1 or 2", c.ProtoVersion)
	}
	return errors.Join(errs...)
}

// RegisterFlags binds c's fields to fs under prefix (e.g. "te.").
func (c *TCPConfig) RegisterFlags(fs *flag.FlagSet, prefix string) {
	fs.StringVar(&c.Host, prefix+"host", c.Host, "transfer engine listen host")
	fs.StringVar(&c.AdvertiseHost, prefix+"advertise-host", c.AdvertiseHost, "host part of the session id (default: listen host or hostname)")
	fs.IntVar(&c.RPCPort, prefix+"rpc-port", c.RPCPort, "handshake (rpc) port, 0 = any free port")
	fs.IntVar(&c.DataPort, prefix+"data-port", c.DataPort, "data port, 0 = any free port")
	fs.IntVar(&c.Lanes, prefix+"lanes", c.Lanes, "persistent connections per peer")
	fs.IntVar(&c.Pipeline, prefix+"pipeline", c.Pipeline, "READ requests outstanding per lane")
	fs.IntVar(&c.PipelineBytes, prefix+"pipeline-bytes", c.PipelineBytes, "cap on outstanding READ bytes per lane beyond two requests, 0 = none")
	fs.IntVar(&c.QueueDepth, prefix+"queue-depth", c.QueueDepth, "requests queued per peer before a batch waits")
	fs.IntVar(&c.ChunkSize, prefix+"chunk-size", c.ChunkSize, "largest request and socket I/O in bytes")
	fs.IntVar(&c.MaxFrame, prefix+"max-frame", c.MaxFrame, "handshake frame length cap in bytes")
	fs.DurationVar(&c.ConnectTimeout, prefix+"connect-timeout", c.ConnectTimeout, "dial timeout")
	fs.DurationVar(&c.HandshakeTimeout, prefix+"handshake-timeout", c.HandshakeTimeout, "handshake timeout")
	fs.DurationVar(&c.IOTimeout, prefix+"io-timeout", c.IOTimeout, "no-progress timeout of a transfer")
	fs.BoolVar(&c.ReadGrants, prefix+"read-grants", c.ReadGrants, "serve only granted ranges")
	fs.DurationVar(&c.RevokeGrace, prefix+"revoke-grace", c.RevokeGrace, "how long reads in flight of revoked blocks may finish before their connections are cut")
	fs.BoolVar(&c.AcceptWrites, prefix+"accept-writes", c.AcceptWrites, "serve peers' WRITE requests into registered memory")
	fs.BoolVar(&c.NoEventLoop, prefix+"no-event-loop", c.NoEventLoop, "serve every data connection on a goroutine instead of starting them on the event loop")
	fs.DurationVar(&c.FirstByteTimeout, prefix+"first-byte-timeout", c.FirstByteTimeout, "close a data connection with no request this long after accept")
	fs.DurationVar(&c.IdleTimeout, prefix+"idle-timeout", c.IdleTimeout, "close a data connection with no request for this long")
	fs.IntVar(&c.MaxConns, prefix+"max-conns", c.MaxConns, "open connections per port (data, rpc)")
	fs.IntVar(&c.MaxConnsPerPeer, prefix+"max-conns-per-peer", c.MaxConnsPerPeer, "connections per port from one remote address not yet past a valid first request, capped once the port is half full")
	fs.IntVar(&c.FDReserve, prefix+"fd-reserve", c.FDReserve, "refuse connections when fewer file descriptors than this are left, 0 = no check")
}
