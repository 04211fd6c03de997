// Package decode is kvflow's decode role (vLLM's kv_consumer): it runs the
// pull pipeline plan → handshake → read → stitch → notify for one decode
// worker and offers the engine-facing API the seed's worker has
// (start_load_kv / get_finished): Load, Abort, Finished, Status.
//
// Every loaded request ends exactly once, in Finished's done list or in its
// failed list with the request's local block ids and a reason — never both,
// never neither (the seed reports failed transfers as done; kvflow does
// not). One bound: results wait for Finished up to Options.MaxFinished
// (65,536); an engine that stops polling loses the oldest beyond that,
// done ones first, each counted (Status.DroppedResults) and logged once
// per second at warn level, with OnFinish still called. Requests overlap: many are in flight at once, each stage with its
// own worker pool.
//
// Leases (kvflow ↔ kvflow): with Options.Renewer set, a request whose
// remote ranks advertised a lease TTL in their metadata (job.Meta.LeaseTTL)
// is renewed at those ranks from its admission until it ends, so that time
// spent queued (a handshake stage stalled by a dead peer, a full read
// stage) never outlasts the prefill's abort timeout: Load plans the
// request and leases it at once where the ranks' metadata is cached; for
// a rank not cached it starts a fetch (one per rank at a time, shared with
// the handshake stage through the cache) and leases the requests waiting
// for it when it lands; the handshake stage then sets the request's leases
// from the metadata it used (the fallback when admission could not). A
// request's leases are removed exactly once, when it ends (done, failed —
// also before its handshake — or never submitted). One renewer goroutine
// per worker schedules, per endpoint, one RENEW with
// all that endpoint's request ids every TTL/3 (and within 5 ms of a new
// request's arrival, so the first renewal beats a short abort timeout);
// each RENEW runs on its own goroutine, at most one per endpoint, so a
// dead peer delays no one else. Close drains with renewals going, then
// stops them and waits for the calls. Seed peers (no TTL) get no RENEW.
//
// Lease guard: a lease holds only while RENEWs get through. The prefill
// frees a renewed request one TTL after it last took a RENEW for it, so a
// decode cut off from a rank's side channel (RENEWs failing) while its data
// path works must not read that rank's blocks past then. The renewer keeps,
// per request and rank, the send time of the last acknowledged RENEW (the
// prefill took it no earlier; before any ACK, the lease start), and the
// read stage refuses a read (ErrLeaseLost, an ErrStaleRead, counted in
// kvflow_decode_lease_lost_reads_total; notify still sends the DONEs) once
// that time plus the TTL less TTL/5 has passed. The margin covers the time
// from the check to the bytes leaving the prefill, scheduling delays and
// clock rates (network latency needs none: the hold is measured from the
// send); with RENEWs every TTL/3 one lost renewal is tolerated. A later
// ACK that came back only after that point proves nothing (the prefill
// ACKs ids it no longer holds), so the hold lapses for good; the first ACK
// always counts (until it, the prefill holds the request by its abort
// timeout, which the lease does not shorten). The check runs again when
// the read ends: bytes read while the lease may have run out are never
// reported done. Ranks this worker does not renew at keep the abort-timeout
// check below.
//
// Shutdown: requests Close cancels (its context ended before they
// drained) in a stage before notify owe the prefill their DONEs; Close
// sends them, one per task as notify would, within ReleaseTimeout, so the
// prefill frees those blocks at once rather than at its abort timeout.
// Their reads have stopped by then; a request canceled inside notify may
// have sent some already and gets none (a DONE counted twice could free
// blocks another decode rank still reads).
//
// Stale reads (ranks without a lease this worker renews): the metadata
// does not carry the prefill's abort timeout, so with Options.PeerAbortTimeout set to it a
// request whose read would start more than that after its admission from
// a rank that advertised no lease fails (ErrStaleRead, counted in
// kvflow_decode_stale_reads_refused_total) instead of reading blocks the
// prefill may have force-freed and handed to another request. It is a
// safety net, not a guarantee: the prefill's timer starts before the
// decode's admission, and a read may start in time and still run past it.
//
// Prefill restarts: a read that failed because its rank may have restarted
// re-fetches the rank's metadata (one GET_META for all the requests that
// failed on the same metadata) and is read once more when the new process
// booted before the request's admission and the stale-read guard allows
// (stages/read's retry.go); a request admitted before its rank restarted
// fails with read.ErrPeerRestarted.
//
// The package wires stages; it owns no sockets or memory of its own (those
// are injected as the stages' interfaces).
package decode
