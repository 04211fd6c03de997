package sidechannel

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"

	"github.com/kvflow/kvflow/internal/sidechannel/wire"
)

// Protocol types, from the pure package wire.
type (
	// Metadata is the seed's MooncakeAgentMetadata plus kvflow's optional Ext.
	Metadata = wire.Metadata
	// SameHost is a prefill worker's same-host claim (Ext.SameHost).
	SameHost = wire.SameHost
	// Ext is kvflow's optional metadata extension, omitted when zero.
	Ext = wire.Ext
	// RemoteError is a peer's "ERR <reason>" reply.
	RemoteError = wire.RemoteError
	// DecodeError says where a message failed to decode; wraps ErrMalformed.
	DecodeError = wire.DecodeError
)

// Errors; test with errors.Is (or errors.As for *RemoteError, *DecodeError).
var (
	// ErrMalformed: a message (request or reply) did not decode.
	ErrMalformed = wire.ErrMalformed
	// ErrUnknownMessage: a request of unknown type.
	ErrUnknownMessage = wire.ErrUnknownMessage
	// ErrUnexpectedReply: a DONE_RECVING reply other than "ACK", or a reply
	// of more than one frame.
	ErrUnexpectedReply = wire.ErrUnexpectedReply
	// ErrTimeout: no reply within the per-attempt timeout on every attempt.
	ErrTimeout = errors.New("sidechannel: timeout")
	// ErrClosed: the client, server or context is closed.
	ErrClosed = errors.New("sidechannel: closed")
	// ErrEndpoint: an endpoint is not host:port.
	ErrEndpoint = errors.New("sidechannel: bad endpoint")
)

// endpoint is a parsed "host:port" (optionally "tcp://host:port").
type endpoint struct {
	key  string // host:port, the pool key and what errors show
	zmq  string // tcp://host:port
	ipv6 bool
}

// parseEndpoint accepts "host:port", "[v6]:port" and the same prefixed with
// "tcp://". wildcardPort allows port 0 (servers: pick a free port).
func parseEndpoint(s string, wildcardPort bool) (endpoint, error) {
	hp := strings.TrimPrefix(s, "tcp://")
	host, port, err := net.SplitHostPort(hp)
	if err != nil {
		return endpoint{}, fmt.Errorf("%w %q: %v", ErrEndpoint, s, err)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil || (p == 0 && !wildcardPort) {
		return endpoint{}, fmt.Errorf("%w %q: port must be 1..65535", ErrEndpoint, s)
	}
	if host == "" {
		if !wildcardPort {
			return endpoint{}, fmt.Errorf("%w %q: empty host", ErrEndpoint, s)
		}
		host = "*"
	}
	zport := port
	if p == 0 {
		zport = "*"
	}
	ipv6 := strings.Contains(host, ":")
	zhost := host
	if ipv6 {
		zhost = "[" + host + "]"
	}
	return endpoint{key: net.JoinHostPort(host, port), zmq: "tcp://" + zhost + ":" + zport, ipv6: ipv6}, nil
}
