// Package peers tracks the health of the prefill peers (side-channel
// endpoints) a decode worker reads from and sends DONEs to.
//
// A peer is up until DownAfter requests to it fail in a row (a read or a
// DONE that failed or timed out); it is then down, and Check fails new
// requests to it at once with ErrPeerDown, naming the peer, its failure
// count and last error, so no worker waits a timeout for them. A
// background probe (Run: GET_META through the decode's handshake fetcher)
// tries each down peer at most once per ProbeInterval, at most MaxProbes
// per tick and one at a time (a bounded rate however many peers are
// down), and marks it up when it answers; a request that succeeds marks
// it up too. /debug/peers (ServeHTTP) lists every peer with its state,
// requests in flight, recent failures, last probe and last error.
//
// Metrics: kvflow_peers_down (gauge), kvflow_peers_transitions_total{to}
// (up, down), kvflow_peers_probes_total{result} — never a per-peer label.
//
// The package never does I/O of its own (the probe is injected), keeps at
// most MaxPeers records (the least recently used up, idle one is
// forgotten), and never blocks a caller on a probe.
package peers
