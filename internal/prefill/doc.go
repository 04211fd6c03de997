// Package prefill is kvflow's prefill role (vLLM's kv_producer) for one
// worker: it answers the side channel (GET_META with this worker's agent
// metadata, DONE_RECVING with ACK) and keeps the tracker that decides when
// a request's blocks may be freed — after every expected DONE, at once
// when no decode rank reads from this worker, on abort, or when the abort
// timeout force-frees it.
//
// With read grants on, the transfer engine serves only the blocks of
// requests this worker holds; a block is revoked as its request is freed,
// so a read that arrives after a force-free is refused rather than served
// from memory the engine may have reused.
//
// Leases (Options.LeaseTTL > 0, kvflow ↔ kvflow): GET_META advertises the
// TTL in the metadata extension (lease_ttl_ms), the worker takes RENEW, and
// a held request last renewed at t is force-freed after t + LeaseTTL,
// whatever its abort timeout (package tracker), counted in
// kvflow_prefill_lease_expired_total. Seed decode workers never renew, so
// for them the abort timeout applies as before; it can be short without
// freeing blocks a live kvflow decode still reads.
//
// Sends are validated per request: delay_start_time finite, not negative,
// at most MaxClockSkew in the future; a request id already held is refused
// (the seed would refresh its start; an engine sends a request once).
//
// Drain (the first phase of shutdown, cmd/kvflow serve on SIGTERM):
// every later send is refused with ErrDraining while GET_META, reads,
// DONEs, renewals, aborts and finished polls go on; Drain returns when
// nothing is held and the engine collected the freed requests, or at the
// caller's deadline. It never frees a request itself.
//
// The package answers every DONE (known, unknown or duplicate) with ACK, as
// the seed does, and counts the unknown and duplicate ones; it never frees
// a request because of a DONE that was not expected.
package prefill
