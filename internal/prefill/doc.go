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
// The package answers every DONE (known, unknown or duplicate) with ACK, as
// the seed does, and counts the unknown and duplicate ones; it never frees
// a request because of a DONE that was not expected.
package prefill
