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
// admitted after the failure tries again. The read stage reaches the cache
// only through this stage (Stage.Invalidate, Stage.Refetch: read.Peers):
// it invalidates an entry when a read fails in a way that suggests the
// peer restarted, so the next job re-fetches it, or re-fetches it at once
// (one fetch for all the reads that failed together) and the fresh
// metadata is checked for compatibility like any other. A peer whose boot
// epoch changed is also re-fetched.
//
// A fetcher with the Reacher capability (the node's side-channel adapter)
// also connects to the peer's port alongside each fetch: a refused
// connection (nothing listens) fails the fetch at once with job.ErrRefused
// instead of after every attempt's timeout; a port that accepts leaves
// the fetch to its attempts, so a slow but alive peer still answers. A
// fetch cut by its own bound (the attempts' timeouts) is marked
// job.ErrNoReply. A task's failure is returned as a job.PeerError naming
// its rank, so peer health blames that rank only.
//
// Request boot epochs: before the compatibility check, Stage.Process
// compares each task's metadata with the boot epoch the request's
// kv_transfer_params name for that rank (kvflow_boot_epochs; a request or
// a peer without one passes). On a mismatch, metadata cached before the
// request's admission is re-fetched once (Cache.Refetch: the prefill may
// have restarted and the request come from the new process); a mismatch
// that remains fails the job (job.ErrBootEpoch) before any read, and the
// job keeps that metadata so notify sends the rank no DONE.
//
// Leases: with Stage.Leases set, a job whose handshake ended is leased at
// exactly the ranks whose metadata advertised leases (lease.Keeper.Add;
// the plan stage already leased it at admission where it could).
//
// New(Config, Deps) builds the stage: Config (timeout, attempts, backoff,
// cache size; DefaultConfig, Validate, RegisterFlags) bounds every fetch
// by FetchTimeout; DefaultPool is its worker pool.
//
// # Compatibility check
//
// With Stage.Compat set, every task's peer is checked, on every job (hit
// or miss), before the read stage moves a byte: the peer's cache must be
// the one the read of it assumes (Compat.Expect: this worker's own cache
// fingerprint with the layers of the task's prefill PP stage and KV heads
// and block_len divided by the task's tp_num_need_pulls, as plan.Reads
// divides them; both instances' sizes as this worker's topology states
// them; the rank the task dials). A peer whose metadata carries a
// fingerprint (kvflow's extension) is compared field by field; one
// without (seed, Mooncake) through its transfer engine's segment
// descriptor (SegmentLister): len(kv_caches_base_addr) == layers × parts
// and each address the start of a registered buffer of num_blocks ×
// block_len bytes of its part. num_blocks is the peer's own (prefill and
// decode size their caches independently); the fingerprint's must equal
// the metadata's. A mismatch fails the job with a *MismatchError (wrapping
// ErrIncompatible) naming the peer, each differing field and both values,
// counted in kvflow_handshake_peer_mismatches_total{field} by the first
// field (a bounded label set, MismatchFields); the notify stage still
// sends the DONE. The peer's metadata is refused (Cache.Refuse): it is not
// cached, and every later fetch that returns the same metadata fails with
// the same reason, whoever fetches (the decode worker's admission
// prefetch too), until the peer's metadata changes. A peer without a
// fingerprint and an engine that cannot list segments (the cgo binding)
// is not checked (kvflow_handshake_peers_unchecked_total).
//
// The package never opens a socket itself: it calls a Fetcher (the
// side-channel client in production) and a SegmentLister (the transfer
// engine, whose handshake the next read reuses) and never holds a lock
// while it waits on one.
package handshake
