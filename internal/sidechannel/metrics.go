package sidechannel

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// Label values. Every combination is initialised to zero at registration so
// dashboards see the series before the first event.
const (
	roleClient = "client"
	roleServer = "server"

	opGetMeta = "get_meta"
	opDone    = "done"
	opRenew   = "renew"
	// opDoneBatch is one done_batch_msg (kvflow), whatever its id count.
	opDoneBatch = "done_batch"

	// Client outcomes.
	outcomeOK          = "ok"
	outcomeTimeout     = "timeout"      // every attempt timed out
	outcomeCanceled    = "canceled"     // the caller's ctx ended first
	outcomeTransport   = "transport"    // socket error (connect/send/recv)
	outcomeBadReply    = "bad_reply"    // reply not decodable / not ACK
	outcomeRemoteError = "remote_error" // peer answered "ERR ..."
	outcomeClosed      = "closed"       // client or context closed
	outcomeInvalid     = "invalid"      // bad endpoint

	// Server outcomes (bad messages are counted separately).
	outcomeHandlerError = "handler_error" // handler returned an error or panicked
	outcomeSendError    = "send_error"    // reply could not be queued
	outcomeDuplicate    = "duplicate"     // a retried DONE batch already handed over: ACKed, not counted

	// Bad message reasons (server).
	badEnvelope = "envelope" // not [identity, (""), payload] with one payload
	badDecode   = "decode"   // payload not a well-formed request
	badUnknown  = "unknown"  // well-formed, unknown message type

	// Authentication denial reasons (ZAP, CURVE servers).
	authDeniedKey           = "unauthorized_key" // key not in AuthorizedClients
	authDeniedMechanism     = "mechanism"        // not CURVE (cannot happen on a CURVE socket)
	authDeniedUnknownDomain = "unknown_domain"   // no server of this context has the domain
	authDeniedBadRequest    = "bad_request"      // malformed ZAP request

	// Socket reset reasons (client).
	resetTimeout  = "timeout"
	resetError    = "error"
	resetCanceled = "canceled"
)

var (
	clientOutcomes = []string{outcomeOK, outcomeTimeout, outcomeCanceled, outcomeTransport, outcomeBadReply, outcomeRemoteError, outcomeClosed, outcomeInvalid}
	serverOutcomes = []string{outcomeOK, outcomeHandlerError, outcomeSendError, outcomeDuplicate}
	badReasons     = []string{badEnvelope, badDecode, badUnknown}
	resetReasons   = []string{resetTimeout, resetError, resetCanceled}
	authReasons    = []string{authDeniedKey, authDeniedMechanism, authDeniedUnknownDomain, authDeniedBadRequest}
)

// metrics is shared by every client and server of one Context (one per
// process), so a process that is both prefill and decode registers once.
type metrics struct {
	requests    *prometheus.CounterVec   // role, op, outcome
	badMessages *prometheus.CounterVec   // reason
	resets      *prometheus.CounterVec   // reason
	authDenied  *prometheus.CounterVec   // reason
	connRefused *prometheus.CounterVec   // reason (servers with Limits)
	duration    *prometheus.HistogramVec // role, op
	batchIDs    *prometheus.HistogramVec // role
}

func newMetrics(reg prometheus.Registerer, openSockets func() float64) *metrics {
	f := promauto.With(reg) // nil reg: counted but not registered
	m := &metrics{
		requests: f.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_sidechannel_requests_total",
			Help: "Side-channel requests by role (client: calls made; server: requests answered), op and outcome.",
		}, []string{"role", "op", "outcome"}),
		badMessages: f.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_sidechannel_bad_messages_total",
			Help: "Malformed or unknown messages received by side-channel servers, by reason.",
		}, []string{"reason"}),
		resets: f.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_sidechannel_socket_resets_total",
			Help: "Client sockets closed and replaced after a timeout, error or cancellation, by reason.",
		}, []string{"reason"}),
		connRefused: f.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_sidechannel_connections_refused_total",
			Help: "Connections a side-channel server with limits closed unserved, by reason (max_conns, max_conns_per_peer, fd_reserve, upstream, first_byte: nothing sent within the first-byte timeout).",
		}, []string{"reason"}),
		authDenied: f.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_sidechannel_auth_denied_total",
			Help: "Connections refused by CURVE servers' client-key check (ZAP), by reason. Clients with no or a wrong server key fail the CURVE handshake and are not counted.",
		}, []string{"reason"}),
		duration: f.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvflow_sidechannel_request_duration_seconds",
			Help: "Side-channel request latency (client: whole call with retries; server: handling).",
			// 50 µs (loopback reply) to ~6.5 s (seed-like 3 × 1 s timeouts plus backoff).
			Buckets: prometheus.ExponentialBuckets(50e-6, 2.5, 14),
		}, []string{"role", "op"}),
		batchIDs: f.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvflow_sidechannel_done_batch_ids",
			Help: "Request ids per done_batch_msg (client: sent; server: received). Sum over count = DONEs per round trip.",
			// 1 (no batching) to 4096 (wire.MaxDoneBatchIDs).
			Buckets: prometheus.ExponentialBuckets(1, 2, 13),
		}, []string{"role"}),
	}
	f.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvflow_sidechannel_open_sockets",
		Help: "ZMQ sockets currently open on the side-channel context.",
	}, openSockets)
	m.batchIDs.WithLabelValues(roleClient)
	m.batchIDs.WithLabelValues(roleServer)
	for _, op := range []string{opGetMeta, opDone, opRenew, opDoneBatch} {
		for _, o := range clientOutcomes {
			m.requests.WithLabelValues(roleClient, op, o)
		}
		for _, o := range serverOutcomes {
			m.requests.WithLabelValues(roleServer, op, o)
		}
		m.duration.WithLabelValues(roleClient, op)
		m.duration.WithLabelValues(roleServer, op)
	}
	for _, r := range badReasons {
		m.badMessages.WithLabelValues(r)
	}
	for _, r := range resetReasons {
		m.resets.WithLabelValues(r)
	}
	for _, r := range authReasons {
		m.authDenied.WithLabelValues(r)
	}
	return m
}
