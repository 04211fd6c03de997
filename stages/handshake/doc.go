// Package handshake is the decode pipeline's second stage: it gets the agent
// metadata (engine id, transfer-engine RPC port, cache base addresses,
// block count) of every remote prefill rank a job reads from.
//
// Metadata is cached per (engine id, host, handshake port) in a bounded LRU
// cache; concurrent misses for the same peer share one fetch
// (singleflight); fetches for different peers run independently, and a
// request that was already waiting when its peer's fetch failed gets that
// failure at once (Cache.GetSince), so the requests queued for a dead or
// silent peer share one fetch timeout instead of each holding a stage
// worker for one while requests to the others wait behind them; a request
// admitted after the failure tries again. The read stage
// invalidates an entry when a read fails in a way that suggests the peer
// restarted; the next job re-fetches it. A peer whose boot epoch changed is
// also re-fetched.
//
// The package never opens a socket itself: it calls a Fetcher (the
// side-channel client in production) and never holds a lock while it
// waits on one.
package handshake
