// Package peers tracks the health of the prefill peers (side-channel
// endpoints) a decode worker reads from and sends DONEs to.
//
// A peer is up until DownAfter requests to it fail in a row (a handshake,
// a read or a DONE that failed or timed out); it is then down, and Check
// fails new requests to it at once with ErrPeerDown, naming the peer, its
// failure count and last error, so no worker waits a timeout for them. A
// background probe (Run: GET_META through the decode's handshake fetcher)
// tries each down peer at most once per ProbeInterval, at most MaxProbes
// per tick and one at a time (a bounded rate however many peers are
// down), and marks it up when it answers; a request that succeeds marks
// it up too. /debug/peers (ServeHTTP) lists every peer with its state,
// requests in flight, recent failures, last probe and last error.
//
// # What counts (the decode worker's use, internal/decode/health.go)
//
// A failure counts against the peer whose hop failed, never against every
// peer of the request: a request that reads two prefill ranks, one of which
// is dead, degrades only that one. The handshake and read stages name the
// rank of the task that failed (job.PeerError); each DONE is recorded for
// its own endpoint. A failure that names no peer, or whose cause is the
// request's or this worker's own — an abort, a shutdown, a plan or lease
// problem here, a stale read refused, an incompatible peer, a peer that
// restarted — counts against none. A refusal by a peer's keyed queue
// (peer_stalled) does not count either: how many come in a row measures
// this worker's offered load, not the peer, and counting them would mark a
// slow but alive peer down within a burst (then up again at the next
// probe: flapping); the reads and DONEs that peer holds count when they
// fail.
//
// # How fast a dead peer is found
//
// With the defaults (handshake and notify: 3 attempts of 1 s, 100 ms
// apart; DownAfter 3), a prefill rank that is not running used to cost
// its first request the handshake's attempts (3.2 s) plus its DONE's
// (3.2 s), and the next one the handshake's again: 9.6 s of failing
// requests before it was marked down. Now:
//   - a rank whose port refuses connections (nothing listens): the
//     handshake reaches the port alongside GET_META (handshake.Reacher)
//     and fails at once, with no DONE (nothing there holds the blocks):
//     about a millisecond per request, down after DownAfter of them;
//   - a rank that accepts and never answers: the GET_META keeps all its
//     attempts (a slow but alive peer must still work), the requests
//     waiting for it share that one fetch (handshake.Cache.GetSince), and
//     the DONE after it gets one attempt instead of three: about 4.3 s
//     for the first request and 3.2 s for the second, down after about
//     7.5 s one request at a time (measured on loopback), after one fetch
//     (3.2 s) when several wait together.
//
// Metrics: kvflow_peers_down (gauge), kvflow_peers_transitions_total{to}
// (up, down), kvflow_peers_probes_total{result} — never a per-peer label.
//
// The package never does I/O of its own (the probe is injected), keeps at
// most MaxPeers records (the least recently used up, idle one is
// forgotten), and never blocks a caller on a probe.
package peers
