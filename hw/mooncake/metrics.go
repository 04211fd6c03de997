package mooncake

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Label values.
const (
	dirRead       = "read"        // this engine initiated a READ
	dirWrite      = "write"       // this engine initiated a WRITE
	dirServeRead  = "serve_read"  // a peer read from this engine
	dirServeWrite = "serve_write" // a peer wrote into this engine

	roleInitiator = "initiator"
	roleTarget    = "target"

	reasonUnregistered = "unregistered"
	reasonNotGranted   = "not_granted"
	reasonBadOpcode    = "bad_opcode"
	reasonZeroLength   = "zero_length"
	reasonWriteRefused = "write_refused"
	reasonBadStrided   = "bad_strided" // a malformed kvflow strided READ
)

type metrics struct {
	bytes    *prometheus.CounterVec
	ops      *prometheus.CounterVec
	batch    *prometheus.HistogramVec
	conns    *prometheus.GaugeVec
	rejected *prometheus.CounterVec
	// Connections closed at accept (by port and reason) and cut by a
	// deadline before or between requests (by port and reason).
	connRefused  *prometheus.CounterVec
	connTimedOut *prometheus.CounterVec
	// Data connections cut because a revoke's grace ended while they
	// still served revoked bytes.
	grantCuts prometheus.Counter
	// Data connections the event loop handed to a goroutine.
	loopHandoffs prometheus.Counter

	// The per-direction series, resolved once (the hot paths add per op).
	readBytes, readOps             prometheus.Counter
	writeBytes, writeOps           prometheus.Counter
	serveReadBytes, serveReadOps   prometheus.Counter
	serveWriteBytes, serveWriteOps prometheus.Counter
	// conns{role="target"}, resolved once (updated per accepted
	// connection).
	targetConns prometheus.Gauge
}

// dir returns the bytes and ops counters of an initiated direction.
func (m *metrics) dir(opcode uint8) (bytes, ops prometheus.Counter) {
	if opcode == OpcodeWrite {
		return m.writeBytes, m.writeOps
	}
	return m.readBytes, m.readOps
}

// registerCollector registers c on reg, or returns the collector already there:
// several engines in one process (a P and a D worker in the demo) share
// the process-wide series instead of panicking.
func registerCollector[T prometheus.Collector](reg prometheus.Registerer, c T) T {
	if reg == nil {
		return c
	}
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(T); ok {
				return existing
			}
		}
		panic(err)
	}
	return c
}

// newMetrics builds the engine's metrics on reg (nil: not registered).
func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_transfer_bytes_total",
			Help: "Bytes moved by the transfer engine, by direction (read/write initiated here, serve_read/serve_write for peers).",
		}, []string{"direction"}),
		ops: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_transfer_ops_total",
			Help: "Transfer requests completed by the transfer engine, by direction.",
		}, []string{"direction"}),
		batch: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvflow_transfer_batch_duration_seconds",
			Help: "Duration of BatchRead/BatchWrite calls, by direction and outcome.",
			// 100 µs (a small batch on loopback) to ~52 s (a dead peer
			// at the default timeouts), factor 2.
			Buckets: prometheus.ExponentialBuckets(100e-6, 2, 20),
		}, []string{"direction", "outcome"}),
		conns: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvflow_transfer_connections",
			Help: "Open data connections, by role (initiator lanes, target sessions).",
		}, []string{"role"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_transfer_rejected_total",
			Help: "Data requests refused by this engine's server, by reason.",
		}, []string{"reason"}),
		connRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_transfer_connections_refused_total",
			Help: "Connections to the transfer engine's ports closed at accept, by port (data, rpc) and reason (peer_cap, total_cap, fd_reserve).",
		}, []string{"port", "reason"}),
		connTimedOut: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_transfer_connections_timed_out_total",
			Help: "Connections to the transfer engine's ports closed for want of a request, by port and reason (first_byte, idle, handshake).",
		}, []string{"port", "reason"}),
		grantCuts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvflow_transfer_grant_reads_cut_total",
			Help: "Data connections cut because they still served bytes whose read grant was revoked (their blocks freed) one revoke grace earlier: a reader stalled mid-range.",
		}),
		loopHandoffs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvflow_transfer_event_loop_handoffs_total",
			Help: "Data connections the data port's event loop (which serves one plain READ at a time, as Mooncake's initiator sends them) handed to a goroutine of their own: pipelined requests (kvflow's lanes), strided reads, writes and requests to refuse.",
		}),
	}
	m.bytes = registerCollector(reg, m.bytes)
	m.loopHandoffs = registerCollector(reg, m.loopHandoffs)
	m.grantCuts = registerCollector(reg, m.grantCuts)
	m.ops = registerCollector(reg, m.ops)
	m.batch = registerCollector(reg, m.batch)
	m.conns = registerCollector(reg, m.conns)
	m.rejected = registerCollector(reg, m.rejected)
	m.connRefused = registerCollector(reg, m.connRefused)
	m.connTimedOut = registerCollector(reg, m.connTimedOut)
	for _, p := range []string{portData, portRPC} {
		for _, r := range []string{refusedPeerCap, refusedTotalCap, refusedFDReserve} {
			m.connRefused.WithLabelValues(p, r)
		}
	}
	m.connTimedOut.WithLabelValues(portData, timeoutFirstByte)
	m.connTimedOut.WithLabelValues(portData, timeoutIdle)
	m.connTimedOut.WithLabelValues(portRPC, timeoutHandshake)
	for _, d := range []string{dirRead, dirWrite, dirServeRead, dirServeWrite} {
		m.bytes.WithLabelValues(d)
		m.ops.WithLabelValues(d)
	}
	m.readBytes, m.readOps = m.bytes.WithLabelValues(dirRead), m.ops.WithLabelValues(dirRead)
	m.writeBytes, m.writeOps = m.bytes.WithLabelValues(dirWrite), m.ops.WithLabelValues(dirWrite)
	m.serveReadBytes, m.serveReadOps = m.bytes.WithLabelValues(dirServeRead), m.ops.WithLabelValues(dirServeRead)
	m.serveWriteBytes, m.serveWriteOps = m.bytes.WithLabelValues(dirServeWrite), m.ops.WithLabelValues(dirServeWrite)
	for _, d := range []string{dirRead, dirWrite} {
		for _, o := range []string{"ok", "error"} {
			m.batch.WithLabelValues(d, o)
		}
	}
	m.conns.WithLabelValues(roleInitiator)
	m.targetConns = m.conns.WithLabelValues(roleTarget)
	for _, r := range []string{reasonUnregistered, reasonNotGranted, reasonWriteRefused, reasonBadOpcode, reasonZeroLength, reasonBadStrided} {
		m.rejected.WithLabelValues(r)
	}
	return m
}
