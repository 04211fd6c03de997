// Package handshake is the decode pipeline's second stage: it gets the agent
// metadata (engine id, transfer-engine RPC port, cache base addresses,
// block count) of every remote prefill rank a job reads from.
//
// Metadata is cached per (engine id, host, handshake port) in a bounded LRU
// cache; concurrent misses for the same peer share one fetch
// (singleflight); fetches for different peers run independently, and a
// failed fetch is remembered for Options.FailureTTL (1 s), so requests
// queued for a dead or silent peer fail at once rather than each holding a
// stage worker for a fetch timeout while requests to the others wait
// behind them. The read stage
// invalidates an entry when a read fails in a way that suggests the peer
// restarted; the next job re-fetches it. A peer whose boot epoch changed is
// also re-fetched.
//
// The package never opens a socket itself: it calls a Fetcher (the
// side-channel client in production) and never holds a lock while it
// waits on one.
package handshake
