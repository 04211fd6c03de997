// Package decode is kvflow's decode role (vLLM's kv_consumer): the thin
// shell that runs the pull pipeline plan → handshake → read → stitch →
// notify for one decode worker and offers the engine-facing API the seed's
// worker has (start_load_kv / get_finished): Load, Abort, Finished, Status.
//
// The shell builds the chain from one table (stages.go: each stage's name,
// pool, whether failed jobs visit it, and how it is built from the
// worker's Options and the stages before it), admits and submits requests,
// and collects how they ended. It decides nothing about a request itself:
// what a stage does at admission, when a request ends and at shutdown is
// written in that stage and called through hooks.go (Admit/Unadmit, End,
// Close), in chain order:
//   - plan (stages/plan/planstage): with leases on (Options.Renewer), plans
//     a request at admission and leases it at once (stages/lease), fetching
//     uncached ranks' metadata; drops its leases when it ends; stops the
//     fetches and renewals at Close;
//   - handshake (stages/handshake): fills the metadata cache, checks peers'
//     caches (compatibility), sets the request's leases from its metadata;
//     the read stage invalidates and re-fetches through it;
//   - read (stages/read): the reads, the stale-read guard (abort timeout,
//     leases), the retry after a peer restart;
//   - stitch (stages/stitch): the head transpose unless the read fused it;
//   - notify (stages/notify): the DONEs, also after a failure; at shutdown
//     the DONEs owed by requests canceled before they reached it.
//
// See docs/request-path.md for one request's path, hop by hop.
//
// Prefill peers are kept apart (peers.go, health.go): the read and notify
// stages are keyed pipeline stages with one queue per peer (PeerKey: the
// remote engine id and the side-channel endpoints of the request's tasks),
// so a slow or wedged prefill rank holds only its share of their workers
// and queues (Options.Peers); with Options.Health, a peer marked down has
// its requests fail at once at handshake and read (reason peer_down) and
// its DONEs skipped until a probe finds it back. A failure counts only
// against the rank whose hop failed (job.PeerError, job.Blame), never
// against the other ranks of the request, and a failure that is not a
// peer's (abort, shutdown, plan, a lease or stale read here, a stall
// refusal) against none (health.go).
//
// A request whose kv_transfer_params carry kvflow_boot_epochs (a kvflow
// prefill's scheduler adds them) fails, reason peer_restarted, without a
// byte read, when a prefill rank's metadata shows another boot epoch: the
// rank restarted since the hand-over and its blocks are gone, even if this
// worker first met the rank after the restart (job.Job.CheckBootEpoch, in
// the handshake and read stages); that rank gets no DONE
// (job.Job.OwesDone). Params without them (a seed prefill) are read as
// before.
//
// Every loaded request ends exactly once, in Finished's done list or in its
// failed list with the request's local block ids and a reason — never both,
// never neither (the seed reports failed transfers as done; kvflow does
// not); its reason is also counted by a fixed label set
// (kvflow_decode_failures_total, reason.go). One bound: results wait for
// Finished up to Options.MaxFinished (65,536); an engine that stops polling
// loses the oldest beyond that, done ones first, each counted
// (Status.DroppedResults) and logged once per second at warn level, with
// OnFinish still called. Requests overlap: many are in flight at once, each
// stage with its own worker pool.
//
// Close drains until its context ends, then cancels the rest (failed,
// "shutdown"), then closes the stages last first.
//
// The package owns no sockets, memory or goroutines of its own (those are
// the pipeline's and the stages', injected as the stages' interfaces), and
// must never reach into a stage's work.
package decode
