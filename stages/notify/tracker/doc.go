// Package tracker is the prefill side's bookkeeping of which requests wait
// for DONE before their KV blocks may be freed: the seed's
// KVCacheTaskTracker (vllm-ascend mooncake_connector.py, as used by
// KVCacheSendingThread and the worker), made bounded and exact.
//
// For every request in the scheduler's requests_to_send, the worker asks
// the rank choice (plan.PrefillMustWait / plan.PrefillExpectedDones) whether
// this rank is read by a decode rank: if so it calls AddDelayed with the
// expected DONE count, otherwise AddNotTransfer. The side channel calls
// Done for every DONE_RECVING it receives. Once per engine step the worker
// calls Finished and hands the ids to the engine, which frees their blocks.
// IsHeld / Held let a caller check a request's state between steps; read
// grants (the prefill worker's, when enabled) are revoked when Finished
// reports the request, or at once when its send finds it no longer held
// (AddDelayed returned 0), not at the moment the tracker frees it.
//
// # API
//
//	New(Options{AbortTimeout, LeaseTTL, MaxRecords, EarlyDoneQuorum, EarlyQuorum}) *Tracker
//	(Options).Validate() error
//	(*Tracker).AddNotTransfer(id string)
//	(*Tracker).AddDelayed(id string, start time.Time, expectedDones int, blockIDs []int) (gen uint64)
//	(*Tracker).Done(id string, now time.Time) (DoneResult, error)   // ErrAlreadyFinished
//	(*Tracker).Abort(id string) bool
//	(*Tracker).Renew(id string, now time.Time) bool                 // leases (kvflow only)
//	(*Tracker).Finished(now time.Time) []Freed                      // Freed{ID, Reason}
//	(*Tracker).IsHeld(id string, gen uint64) bool
//	(*Tracker).Held(id string) (gen uint64, blocks []int, ok bool)
//	(*Tracker).Stats() Stats
//	(*Tracker).Len() int
//	(*Tracker).Options() Options
//
// Reason is done, not_transfer, expired or aborted (String gives the metric
// label; Reasons lists them). DoneResult.Status is DoneFreed (last expected
// DONE), DoneWaiting (Remaining more), DoneEarly (no delayed record yet) or
// DoneDuplicate (with ErrAlreadyFinished).
//
// # Contract (the seed's semantics)
//
//   - AddNotTransfer: reported by the next Finished.
//   - AddDelayed: held until its DONEs; a second AddDelayed of a held
//     request refreshes its start in place (the OrderedDict assignment:
//     same position, same generation).
//   - Done of a held request frees it (the last of its expected DONEs).
//   - Done of a request not held yet is an early DONE: as in the seed it is
//     reported by the next Finished (with Options.EarlyDoneQuorum = 1, the
//     default) and kept, so the later AddDelayed finds it satisfied and
//     holds nothing.
//   - Finished(now) returns the requests freed since the last call (in the
//     order they were freed), then force-frees held requests with
//     now - start > AbortTimeout (strict), scanning from the oldest
//     insertion and stopping at the first unexpired one, so a refreshed
//     start holds back those behind it exactly as in the seed. Each request
//     is reported once.
//   - AbortTimeout is vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s).
//
// Every case and step of testdata/seedref/task_tracker.json is checked:
// a transcription of the seed reproduces each result and state; the
// Tracker equals that transcription with the rules below applied, and
// every step where it differs from the vector follows a rule firing in its
// case.
//
// # Deviations (decided by rules on the inputs)
//
//  1. Once (§5b.9). An operation on a request that is already finished
//     (freed and still remembered) changes nothing: AddDelayed does not
//     re-arm it (the seed re-arms it after a DONE, or after a not-transfer
//     or a force-free, and reports it a second time at expiry), Done
//     returns ErrAlreadyFinished (the seed reports it again and leaves a
//     record_finished_requests entry behind) and AddNotTransfer is ignored
//     (the seed reports it again). AddDelayed still consumes an early-DONE
//     record, as in the seed.
//
//  2. AddNotTransfer of a held request frees it at once (reason
//     not_transfer) and ends its read grant; the seed reports it but keeps
//     its delayed entry, to report it again when that expires.
//
//  3. Bounded (§5b.6). Early-DONE records and finished requests
//     (tombstones) are remembered by count, not by time: at most
//     MaxRecords of them, oldest first (early DONEs from their first Done,
//     finished requests from the Finished that reported them); the seed's
//     record_finished_requests grows forever. A record still awaiting its
//     report is never forgotten. Records are evicted at Finished and on
//     insertion. Nothing ages by time, so a DONE however late (a slow
//     decode after a force-free) finds its tombstone and is a duplicate,
//     never a second report, as long as fewer than MaxRecords requests
//     finished after it.
//
//  4. Several DONEs (§5b.5). AddDelayed takes the expected DONE count; the
//     request is freed by the last one, or at the abort timeout; the seed
//     frees on the first. Early DONEs count toward it. Because the seed
//     reports an early DONE at once, a request whose first DONE arrives
//     before its AddDelayed is freed by it unless EarlyDoneQuorum is raised
//     to the deployment's DONE count, or EarlyQuorum gives each request's
//     (the prefill worker passes plan.PrefillExpectedDones for a request
//     large enough that every decode rank reads it). Stats.EarlyShort
//     counts the requests freed with fewer DONEs than AddDelayed later
//     expected.
//
//  5. HoldEarly (the prefill worker's setting). Early DONEs are not
//     reported by themselves: they wait, bounded by MaxEarly (count,
//     oldest dropped) and EarlyTTL (age), for the request's AddDelayed
//     (freed at once when they cover its expected DONEs) or
//     AddNotTransfer. Finished then names only requests the caller
//     handed over; a flood of DONEs for unknown ids costs at most
//     MaxEarly records and reaches no one. Dropped early DONEs are
//     counted (Stats.EarlyEvicted, Stats.EarlyExpired). The seed vectors
//     run with it off.
//
// Limitation: a request evicted under rule 3 is new to the tracker; an
// operation on it after that (a DONE arriving after MaxRecords later
// requests finished) behaves as for an unknown request (for a DONE: an
// early DONE, reported again). The tracker cannot tell an early DONE from a DONE for a
// request it never heard of, so there is no "unknown" error: both are
// DoneEarly, as in the seed.
//
// # Leases (kvflow ↔ kvflow; not in the seed)
//
// With Options.LeaseTTL > 0 the prefill side advertises leases in its
// metadata and kvflow decode workers send RENEW for the requests they are
// still pulling, every LeaseTTL/3. Renew(id, now) moves a held request's
// lease end to now + LeaseTTL (never backwards). A renewed request is
// force-freed when now > lastRenew + LeaseTTL (Freed.Lease,
// Stats.LeaseExpired), whatever its start:
//
//   - a request never renewed (a seed decode, or a decode that never
//     reached it) expires at the abort timeout, as in the seed;
//   - a live decode that keeps renewing keeps its blocks however slow its
//     reads, so the abort timeout can be short (it then only has to cover
//     the time until the decode's first Renew: its queue and handshake);
//   - a decode that dies stops renewing: its requests are force-freed
//     LeaseTTL after its last Renew, even when that is long before the
//     abort timeout. (Until #18 the abort timeout was a floor here, so with
//     the default 480 s, or a 600 s config, a killed decode's blocks stayed
//     held for the whole abort timeout: the lease only ever lengthened a
//     hold.) A Renew is a decode's word that it is alive and still
//     reading; once it has given it, its silence is what frees.
//
// Renewed requests leave the seed's head-of-line scan: they are kept in
// order of last renewal, so a live lease at the head never holds back the
// expiry of others, and never-renewed requests keep the seed's exact order.
// A Renew of a request that is not held records nothing (no early
// renewals): it cannot re-arm a finished request.
//
// # Never
//
// No goroutines, no clocks (every time is a parameter), no I/O, no logging,
// no metrics registration (Stats feeds the caller's metrics), no global
// state. All methods are safe for concurrent use (one mutex); none blocks
// on anything but that mutex. Returned slices are the caller's.
package tracker
