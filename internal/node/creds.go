package node

import (
	"container/list"
	"fmt"
	"log/slog"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// A decode worker keeps one data-plane credential per transfer session,
// "host:te_rpc_port", the port as the GET_META reply names it. A hostile
// side-channel endpoint on a prefill's host could name that prefill's port
// and replace (or clear) its credential, breaking every read from it. So,
// as with same-host claims (samehost.go), each session with a credential
// remembers the side-channel endpoint that first named it: that endpoint
// may refresh or drop it (its prefill restarted), another endpoint's
// metadata naming it is refused, the request failing with both endpoints
// named, counted in kvflow_handshake_meta_refusals_total{reason=
// "session_conflict"}. An endpoint naming a new session (its prefill
// restarted on another te_rpc_port) gives up its previous one, whose
// credential is forgotten. Sessions without a credential (auth off, open
// ports) have nothing to take over and are not owned.
//
// Which of two endpoints is the session's prefill cannot be told here, so
// a prefill whose side channel moves to another port while keeping its
// te_rpc_port is refused as well, until this decode restarts or the
// session is forgotten past maxCredSessions.

// metaRefusalReasons are the label values of kvflow_handshake_meta_refusals_total.
var metaRefusalReasons = []string{"session_conflict", "lease_ttl"}

// maxCredSessions bounds the sessions credOwners remembers: far above the
// prefill ranks one decode rank reads from; past it the least recently
// named session is forgotten (its credential too) and is taken again by
// the next endpoint that names it.
var maxCredSessions = 4096

// credOwners maps each transfer session to the side-channel endpoint that
// first named it, and each endpoint to its current session.
type credOwners struct {
	refusals *prometheus.CounterVec
	log      *slog.Logger

	mu         sync.Mutex
	bySession  map[string]*list.Element // of *credOwner
	byEndpoint map[string]*list.Element
	lru        list.List // most recently named first
}

type credOwner struct{ session, endpoint string }

func newCredOwners(reg prometheus.Registerer, log *slog.Logger) *credOwners {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	o := &credOwners{
		refusals: promauto.With(reg).NewCounterVec(prometheus.CounterOpts{Name: "kvflow_handshake_meta_refusals_total",
			Help: "GET_META replies a decode worker refused (the request fails), by reason: session_conflict (the reply names a transfer session another side-channel endpoint named first), lease_ttl (an absurd kvflow.lease_ttl_ms)."},
			[]string{"reason"}),
		log:        log,
		bySession:  map[string]*list.Element{},
		byEndpoint: map[string]*list.Element{},
	}
	for _, r := range metaRefusalReasons {
		o.refusals.WithLabelValues(r)
	}
	return o
}

// claim records that endpoint names session, with a credential (cred) or
// without. It returns the sessions whose credentials are to be forgotten
// (endpoint's previous session, sessions evicted past maxCredSessions),
// or an error naming both endpoints when another endpoint named session
// first, with a credential. Only sessions with a credential are owned:
// without one there is nothing to take over (auth off, or open ports).
func (o *credOwners) claim(endpoint, session string, cred bool) (forget []string, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if e, ok := o.bySession[session]; ok {
		w := e.Value.(*credOwner)
		if w.endpoint != endpoint {
			o.refusals.WithLabelValues("session_conflict").Inc()
			o.log.Warn("handshake: a side-channel endpoint names a transfer session another endpoint named first; its metadata is refused",
				"session", session, "first", w.endpoint, "now", endpoint)
			return nil, fmt.Errorf("sidechannel get_meta %s: transfer session %s was first named by side-channel endpoint %s (metadata refused: session conflict)",
				endpoint, session, w.endpoint)
		}
		if !cred { // the owner's prefill no longer asks for one
			o.removeLocked(e)
			return nil, nil
		}
		o.lru.MoveToFront(e)
		return nil, nil
	}
	if e, ok := o.byEndpoint[endpoint]; ok {
		// endpoint's prefill restarted on another te_rpc_port.
		forget = append(forget, e.Value.(*credOwner).session)
		o.removeLocked(e)
	}
	if !cred {
		return forget, nil
	}
	e := o.lru.PushFront(&credOwner{session: session, endpoint: endpoint})
	o.bySession[session], o.byEndpoint[endpoint] = e, e
	for o.lru.Len() > maxCredSessions {
		b := o.lru.Back()
		forget = append(forget, b.Value.(*credOwner).session)
		o.removeLocked(b)
	}
	return forget, nil
}

func (o *credOwners) removeLocked(e *list.Element) {
	w := o.lru.Remove(e).(*credOwner)
	delete(o.bySession, w.session)
	delete(o.byEndpoint, w.endpoint)
}

// refused counts a reply refused for reason (one of metaRefusalReasons).
func (o *credOwners) refused(reason string) {
	if o != nil {
		o.refusals.WithLabelValues(reason).Inc()
	}
}
