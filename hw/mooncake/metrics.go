package mooncake

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
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
)

type metrics struct {
	bytes    *prometheus.CounterVec
	ops      *prometheus.CounterVec
	batch    *prometheus.HistogramVec
	conns    *prometheus.GaugeVec
	rejected *prometheus.CounterVec
}

// newMetrics builds the engine's metrics on reg (nil: not registered).
func newMetrics(reg prometheus.Registerer) *metrics {
	f := promauto.With(reg)
	m := &metrics{
		bytes: f.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_transfer_bytes_total",
			Help: "Bytes moved by the transfer engine, by direction (read/write initiated here, serve_read/serve_write for peers).",
		}, []string{"direction"}),
		ops: f.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_transfer_ops_total",
			Help: "Transfer requests completed by the transfer engine, by direction.",
		}, []string{"direction"}),
		batch: f.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvflow_transfer_batch_duration_seconds",
			Help: "Duration of BatchRead/BatchWrite calls, by direction and outcome.",
			// 100 µs (a small batch on loopback) to ~52 s (a dead peer
			// at the default timeouts), factor 2.
			Buckets: prometheus.ExponentialBuckets(100e-6, 2, 20),
		}, []string{"direction", "outcome"}),
		conns: f.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvflow_transfer_connections",
			Help: "Open data connections, by role (initiator lanes, target sessions).",
		}, []string{"role"}),
		rejected: f.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_transfer_rejected_total",
			Help: "Data requests refused by this engine's server, by reason.",
		}, []string{"reason"}),
	}
	for _, d := range []string{dirRead, dirWrite, dirServeRead, dirServeWrite} {
		m.bytes.WithLabelValues(d)
		m.ops.WithLabelValues(d)
	}
	for _, d := range []string{dirRead, dirWrite} {
		for _, o := range []string{"ok", "error"} {
			m.batch.WithLabelValues(d, o)
		}
	}
	m.conns.WithLabelValues(roleInitiator)
	m.conns.WithLabelValues(roleTarget)
	for _, r := range []string{reasonUnregistered, reasonNotGranted, reasonBadOpcode, reasonZeroLength} {
		m.rejected.WithLabelValues(r)
	}
	return m
}
