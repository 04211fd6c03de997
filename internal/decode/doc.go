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
// Leases (kvflow ↔ kvflow): with Options.Renewer set, a request whose
// remote ranks advertised a lease TTL in their metadata (job.Meta.LeaseTTL)
// is renewed at those ranks from the end of its handshake until it ends:
// one renewer goroutine per worker schedules, per endpoint, one RENEW with
// all that endpoint's request ids every TTL/3 (and within 5 ms of a new
// request's arrival, so the first renewal beats a short abort timeout);
// each RENEW runs on its own goroutine, at most one per endpoint, so a
// dead peer delays no one else. Close drains with renewals going, then
// stops them and waits for the calls. Seed peers (no TTL) get no RENEW.
//
// The package wires stages; it owns no sockets or memory of its own (those
// are injected as the stages' interfaces).
package decode
