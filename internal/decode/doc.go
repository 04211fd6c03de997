// Package decode is kvflow's decode role (vLLM's kv_consumer): it runs the
// pull pipeline plan → handshake → read → stitch → notify for one decode
// worker and offers the engine-facing API the seed's worker has
// (start_load_kv / get_finished): Load, Abort, Finished, Status.
//
// Every loaded request ends exactly once, in Finished's done list or in its
// failed list with the request's local block ids and a reason — never both,
// never neither (the seed reports failed transfers as done; kvflow does
// not). Requests overlap: many are in flight at once, each stage with its
// own worker pool.
//
// The package wires stages; it owns no sockets or memory of its own (those
// are injected as the stages' interfaces).
package decode
