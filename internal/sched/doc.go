// Package sched is the scheduler side of the seed's connector
// (MooncakeConnectorScheduler) as a pure Go state machine, so that a
// Go-native engine, the demo and the benchmarks drive kvflow exactly as
// vLLM drives the seed. It is the Go twin of clients/python/kvflow/scheduler.py:
// both run the op scripts in testdata/cases.json and must answer each the same.
//
// The rules, as in the seed:
//
//   - MatchedTokens: with do_remote_prefill, the whole prompt beyond the
//     locally computed tokens is external and loads asynchronously
//     (count, count > 0); otherwise (0, false).
//   - AfterAlloc: with do_remote_prefill, a request whose params have
//     remote_block_ids and all of remote_engine_id, remote_host and
//     remote_port (keys present; values unchecked, as in the seed) is queued
//     to receive into its unhashed blocks (none when no external tokens: a
//     full local prefix hit still owes the prefill its DONE); incomplete
//     params are skipped (the request is computed locally). Either way
//     do_remote_prefill is turned off: one transfer per request.
//   - BuildMeta hands the queued receives and sends over and clears them.
//   - RequestFinished: only a do_remote_decode request finished by length
//     cap is handed over; with blocks their free is delayed and the request
//     queued to send at Clock(); the params are the seed's nine keys, in its
//     order (Handover), plus kvflow's optional kvflow_boot_epochs last
//     when Rules.BootEpochs is set (each prefill rank's boot epoch, from
//     its status: a kvflow decode refuses a request whose rank restarted
//     since; a seed decode ignores the key). BuildMeta passes a request's
//     kvflow_boot_epochs on (Recv.BootEpochs).
//
// Where kvflow differs from the seed (each tested):
//
//  1. The seed's asserts (computed tokens not a whole number of blocks;
//     external tokens without remote blocks) are errors naming the request.
//  2. A request finished (aborted) while do_remote_prefill is still set was
//     never allocated: it is queued with no local blocks, so the decode
//     worker sends DONE at once and the prefill frees its blocks (the seed
//     leaves them held until the abort timeout).
//  3. Finished while its receive is queued: handled as 2. Finished while
//     handed to workers and not reported done (FinishedRecving): listed in
//     the next Meta's ToAbort, so the workers cancel the pull rather than
//     keep writing into blocks the engine has freed.
//
// The package holds no goroutines, sockets or clocks of its own and is not
// safe for concurrent use (one scheduler loop owns it).
package sched
