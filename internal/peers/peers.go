package peers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// ErrPeerDown fails a request to a peer marked down, at once.
var ErrPeerDown = errors.New("peers: peer down")

// Defaults (Options' zero values take them).
const (
	// DefaultDownAfter: three failures in a row is a pattern, not a blip
	// (one lost connection fails the reads in flight on it, usually one
	// or two per peer).
	DefaultDownAfter = 3
	// DefaultProbeInterval: a restarted prefill is found within a second,
	// at one GET_META per second per down peer.
	DefaultProbeInterval = time.Second
	// DefaultMaxPeers bounds the records kept (one per side-channel
	// endpoint); the oldest up, idle peer is forgotten beyond.
	DefaultMaxPeers = 1024
	// DefaultMaxProbes bounds the probes sent per interval, all peers
	// together.
	DefaultMaxProbes = 16
	// recentFailures is how many failures a record keeps for /debug/peers.
	recentFailures = 4
)

// Probe checks that a peer answers (GET_META on its side channel).
type Probe func(ctx context.Context, endpoint string) error

// Options configures a Tracker.
type Options struct {
	// DownAfter consecutive failures (handshakes, reads or DONEs failed or
	// timed out, each blamed on its own peer: see the package doc) mark a
	// peer down.
	DownAfter int
	// ProbeInterval: how often a down peer is probed (Probe).
	ProbeInterval time.Duration
	// Probe marks a down peer up when it returns nil; nil: peers stay
	// down until a request to them... never: a down peer without a probe
	// is retried after ProbeInterval by letting one request through.
	Probe      Probe
	MaxPeers   int
	MaxProbes  int
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

// State is a peer's state.
type State string

// States.
const (
	Up   State = "up"
	Down State = "down"
)

// Failure is one recorded failure.
type Failure struct {
	At    time.Time `json:"at"`
	Error string    `json:"error"`
}

// Status is a peer as /debug/peers lists it.
type Status struct {
	Peer           string    `json:"peer"`
	State          State     `json:"state"`
	InFlight       int       `json:"in_flight"`
	Consecutive    int       `json:"consecutive_failures"`
	Failures       uint64    `json:"failures_total"`
	Successes      uint64    `json:"successes_total"`
	RecentFailures []Failure `json:"recent_failures"`
	Since          time.Time `json:"since"` // when it entered its state
	LastProbe      time.Time `json:"last_probe,omitzero"`
	LastError      string    `json:"last_error,omitempty"`
}

type peer struct {
	st       Status
	lastUsed time.Time
	lastFail time.Time
	probing  bool
}

// Tracker is the health of the prefill peers a decode worker talks to.
// Safe for concurrent use. Run starts its probe loop.
type Tracker struct {
	o   Options
	log *slog.Logger

	mu    sync.Mutex
	peers map[string]*peer

	down        prometheus.GaugeFunc
	transitions *prometheus.CounterVec
	probes      *prometheus.CounterVec
	nDown       int
}

// New makes a tracker and registers its metrics.
func New(o Options) (*Tracker, error) {
	if o.DownAfter <= 0 {
		o.DownAfter = DefaultDownAfter
	}
	if o.ProbeInterval <= 0 {
		o.ProbeInterval = DefaultProbeInterval
	}
	if o.MaxPeers <= 0 {
		o.MaxPeers = DefaultMaxPeers
	}
	if o.MaxProbes <= 0 {
		o.MaxProbes = DefaultMaxProbes
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	t := &Tracker{o: o, log: log.With("component", "peers"), peers: map[string]*peer{}}
	t.down = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvflow_peers_down", Help: "Prefill peers marked down (their requests fail at once with peer_down).",
	}, func() float64 { t.mu.Lock(); defer t.mu.Unlock(); return float64(t.nDown) })
	t.transitions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_peers_transitions_total", Help: "Prefill peers marked down or up again, by the state entered.",
	}, []string{"to"})
	t.probes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_peers_probes_total", Help: "GET_META probes of down peers, by result (ok, failed).",
	}, []string{"result"})
	for _, s := range []string{string(Up), string(Down)} {
		t.transitions.WithLabelValues(s)
	}
	for _, s := range []string{"ok", "failed"} {
		t.probes.WithLabelValues(s)
	}
	if o.Registerer != nil {
		for _, c := range []prometheus.Collector{t.down, t.transitions, t.probes} {
			if err := o.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("peers: register metrics: %w", err)
			}
		}
	}
	return t, nil
}

// get returns endpoint's record, making it (and forgetting the least
// recently used up, idle peer beyond MaxPeers). Called with t.mu held.
func (t *Tracker) get(endpoint string, now time.Time) *peer {
	p := t.peers[endpoint]
	if p == nil {
		if len(t.peers) >= t.o.MaxPeers {
			// An idle up peer first; with none, an idle down one (names
			// come from requests: distinct dead endpoints must not grow
			// the records without bound). Least recently used first.
			var oldest, oldestDown string
			var at, atDown time.Time
			for ep, q := range t.peers {
				switch {
				case q.st.InFlight != 0:
				case q.st.State == Up && (oldest == "" || q.lastUsed.Before(at)):
					oldest, at = ep, q.lastUsed
				case q.st.State == Down && (oldestDown == "" || q.lastUsed.Before(atDown)):
					oldestDown, atDown = ep, q.lastUsed
				}
			}
			if oldest == "" && oldestDown != "" {
				oldest = oldestDown
				t.nDown--
			}
			if oldest != "" {
				delete(t.peers, oldest)
			}
		}
		p = &peer{st: Status{Peer: endpoint, State: Up, Since: now}}
		t.peers[endpoint] = p
	}
	p.lastUsed = now
	return p
}

// Check is nil when endpoint may be used, ErrPeerDown (naming the peer,
// its failures and the last error) while it is down.
func (t *Tracker) Check(endpoint string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.peers[endpoint]
	if p == nil || p.st.State == Up {
		return nil
	}
	if t.o.Probe == nil && time.Since(p.lastFail) >= t.o.ProbeInterval {
		return nil // no prober: let requests try it again
	}
	return fmt.Errorf("peer %s: %w since %s after %d failures in a row (last: %s); probed every %v",
		endpoint, ErrPeerDown, p.st.Since.Format(time.RFC3339Nano), p.st.Consecutive, p.st.LastError, t.o.ProbeInterval)
}

// Begin counts a request in flight to endpoint; End with its outcome.
func (t *Tracker) Begin(endpoint string) {
	t.mu.Lock()
	t.get(endpoint, time.Now()).st.InFlight++
	t.mu.Unlock()
}

// End ends a Begin: err nil is a success (the peer answered), else a
// failure that counts toward DownAfter. Outcomes that say nothing of the
// peer (an abort, a shutdown) must be passed as Skip.
func (t *Tracker) End(endpoint string, err error) {
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.get(endpoint, now)
	p.st.InFlight = max(0, p.st.InFlight-1)
	t.record(p, err, now)
}

// Skip is End for an outcome that says nothing about the peer.
func (t *Tracker) Skip(endpoint string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.get(endpoint, time.Now())
	p.st.InFlight = max(0, p.st.InFlight-1)
}

func (t *Tracker) record(p *peer, err error, now time.Time) {
	if err == nil {
		p.st.Successes++
		p.st.Consecutive = 0
		if p.st.State == Down {
			t.setState(p, Up, now, "a request succeeded")
		}
		return
	}
	p.st.Failures++
	p.st.Consecutive++
	p.lastFail = now
	p.st.LastError = err.Error()
	p.st.RecentFailures = append(p.st.RecentFailures, Failure{At: now, Error: err.Error()})
	if n := len(p.st.RecentFailures); n > recentFailures {
		p.st.RecentFailures = slices.Clone(p.st.RecentFailures[n-recentFailures:])
	}
	if p.st.State == Up && p.st.Consecutive >= t.o.DownAfter {
		t.setState(p, Down, now, "failures in a row")
	}
}

func (t *Tracker) setState(p *peer, s State, now time.Time, why string) {
	p.st.State, p.st.Since = s, now
	if s == Down {
		t.nDown++
	} else {
		t.nDown--
	}
	t.transitions.WithLabelValues(string(s)).Inc()
	t.log.Warn("peer "+string(s), "peer", p.st.Peer, "why", why, "consecutive_failures", p.st.Consecutive, "last_error", p.st.LastError)
}

// Snapshot lists every peer, sorted by endpoint.
func (t *Tracker) Snapshot() []Status {
	t.mu.Lock()
	out := make([]Status, 0, len(t.peers))
	for _, p := range t.peers {
		st := p.st
		st.RecentFailures = slices.Clone(st.RecentFailures)
		out = append(out, st)
	}
	t.mu.Unlock()
	slices.SortFunc(out, func(a, b Status) int {
		switch {
		case a.Peer < b.Peer:
			return -1
		case a.Peer > b.Peer:
			return 1
		}
		return 0
	})
	return out
}

// ServeHTTP serves /debug/peers: {"peers": [Status...]} as JSON, empty
// lists as [] (never null).
func (t *Tracker) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	peers := t.Snapshot()
	for i := range peers {
		if peers[i].RecentFailures == nil {
			peers[i].RecentFailures = []Failure{}
		}
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(struct {
		DownAfter     int      `json:"down_after"`
		ProbeInterval string   `json:"probe_interval"`
		Peers         []Status `json:"peers"`
	}{t.o.DownAfter, t.o.ProbeInterval.String(), peers})
}

// dueProbes picks down peers not probed for an interval, at most MaxProbes,
// and marks them probing.
func (t *Tracker) dueProbes(now time.Time) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var due []string
	for ep, p := range t.peers {
		if p.st.State != Down || p.probing || now.Sub(p.st.LastProbe) < t.o.ProbeInterval {
			continue
		}
		due = append(due, ep)
	}
	slices.Sort(due)
	if len(due) > t.o.MaxProbes {
		due = due[:t.o.MaxProbes]
	}
	for _, ep := range due {
		t.peers[ep].probing = true
		t.peers[ep].st.LastProbe = now
	}
	return due
}

func (t *Tracker) probed(endpoint string, err error) {
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.peers[endpoint]
	if p == nil {
		return
	}
	p.probing = false
	if err != nil {
		t.probes.WithLabelValues("failed").Inc()
		p.st.LastError = "probe: " + err.Error()
		return
	}
	t.probes.WithLabelValues("ok").Inc()
	if p.st.State == Down {
		p.st.Consecutive = 0
		t.setState(p, Up, now, "probe answered")
	}
}

// Run probes down peers every ProbeInterval/4 tick (each peer at most once
// per ProbeInterval, at most MaxProbes per tick, one at a time, each
// bounded by ProbeInterval) until ctx ends. Without a Probe it returns at
// once (see Options.Probe).
func (t *Tracker) Run(ctx context.Context) {
	if t.o.Probe == nil {
		return
	}
	tick := time.NewTicker(max(t.o.ProbeInterval/4, time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			for _, ep := range t.dueProbes(now) {
				pctx, cancel := context.WithTimeout(ctx, t.o.ProbeInterval)
				err := t.o.Probe(pctx, ep)
				cancel()
				t.probed(ep, err)
				if ctx.Err() != nil {
					return
				}
			}
		}
	}
}
