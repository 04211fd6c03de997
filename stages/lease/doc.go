// Package lease keeps the leases a decode worker holds at prefill ranks
// (kvflow ↔ kvflow): a request whose remote ranks advertised a lease TTL in
// their metadata (job.Meta.LeaseTTL) is renewed at those ranks from its
// admission until it ends, so that time spent queued (a handshake stage
// stalled by a dead peer, a full read stage) never outlasts the prefill's
// abort timeout.
//
// Who does what, stage by stage:
//   - the plan stage (stages/plan/planstage) owns the Keeper: at admission
//     it leases a request where its ranks' metadata is cached (Lease) and
//     starts one fetch per uncached rank (Pend, then Resolve once it
//     lands); when the request ends it removes its leases (Remove);
//   - the handshake stage sets the request's leases from the metadata it
//     used (Add): the fallback for what admission could not lease;
//   - the read stage's stale-read guard asks LeaseOf whether a lease still
//     holds before (and after) a read.
//
// One loop goroutine per Keeper schedules, per endpoint, one RENEW with
// all that endpoint's request ids every TTL/3 (and within 5 ms of a new
// request's arrival, so the first renewal beats a short abort timeout);
// each RENEW runs on its own goroutine, at most one per endpoint, so a dead
// peer delays no one else. Close stops them and waits for the calls. Seed
// peers (no TTL) get no RENEW.
//
// A lease holds only while RENEWs get through: the prefill frees a renewed
// request one TTL after it last took a RENEW for it. The Keeper records,
// per request and endpoint, the send time of the last acknowledged RENEW
// (Hold); the guard trusts it until that time plus the TTL less Margin
// (TTL/5). A later ACK that came back only after that point proves nothing
// (the prefill ACKs ids it no longer holds), so the hold lapses for good.
//
// The package does no I/O of its own beyond the injected Renewer, owns no
// sockets, and never imports cgo.
package lease
