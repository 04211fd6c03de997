// Package prefill is kvflow's prefill role (vLLM's kv_producer) for one
// worker: it answers the side channel (GET_META with this worker's agent
// metadata, DONE_RECVING with ACK) and keeps the tracker that decides when
// a request's blocks may be freed — after every expected DONE, at once
// when no decode rank reads from this worker, on abort, or when the abort
// timeout force-frees it.
//
// With read grants (Options.Grants), the transfer engine serves only the
// blocks of requests this worker holds: a send's block ids are granted
// with its hold; a send without block ids opens every block while its
// request is held (GrantsAuto, warned once) or nothing (GrantsStrict). A
// grant is revoked as its request is freed, so a read that arrives after
// a force-free, an abort or a forged DONE is refused rather than served
// from memory the engine may have reused. Revoking never waits: Finished
// reports a freed request only once no read of its blocks is in flight
// (the transfer engine cuts a reader stalled past its revoke grace), and
// a later Finished reports the ones held back; nothing is lost, nothing
// blocks the caller.
//
// Early DONEs (for a request not sent yet) are kept, not reported, until
// the send finds them and frees the request at once (tracker.HoldEarly):
// the engine is told only of requests it sent, whatever DONEs name. The
// seed reports an early DONE at once; its send follows within an engine
// step, so the engine sees the same request freed one poll later. They
// are bounded by MaxEarly and EarlyTTL and the drops counted
// (kvflow_prefill_early_dones_dropped_total).
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
