// Package read is the decode pipeline's third stage: it turns each task of
// a job plus its remote metadata into address triples (stages/plan's
// seed-exact arithmetic) and runs them through a transfer engine, one batch
// per task, the tasks of one job concurrently.
//
// The stage depends on one interface, Transfer: BatchRead of a Batch, and
// Capabilities, read once in New (local strided rows, gathered remote
// rows, a byte ledger, a failure classifier); a batch uses only the
// options its transfer stated, so nothing is type-switched per call.
// Engine adapts any hw/mooncake engine, resolving the engine's optional
// interfaces once; OpsFunc adapts a function of an op list (fakes).
//
// The triples travel compact: per task the stage builds a plan.Reads (the
// task's tensors times its block runs; validated, O(blocks), pooled), takes
// the batch's bytes and op count from it, and hands it to the transfer in
// a Batch. Engine expands it once, straight into its engine's own op list
// (AppendEngineOps). A GQA request with tp_num_need_pulls 4, 64 layers and
// 128 blocks is 65,536 ops (1.5 MiB), so that list is written once, where
// the engine needs it, never twice.
//
// Fused stitch: with tp_num_need_pulls P > 1 a decode block is the P
// prefill ranks' slices of every token, and the seed reads each slice
// contiguously and then transposes the block. When the transfer can lay an
// op's bytes out in strided rows (Capabilities.LocalStride: the TCP engine) and
// Options.BlockSize splits every block into P equal token slices, the
// stage instead interleaves the reads (plan.Reads.Interleave: same remote
// ranges and lengths, each op starting at its slot in the block's first
// token, rows of row/P bytes one token apart), so the blocks land
// stitched and the job is marked Stitched for the stitch stage to skip.
// The decision is per job, before any task runs: every slice of a block
// must land the same way. Options.NoFuse keeps the seed's way.
//
// Head slices (decode TP > prefill TP, kvflow ↔ kvflow only): a task with
// plan.Task.HeadSplit > 1 needs one slice of every token row of the remote
// blocks, so only the needed bytes cross the wire and land in place. With
// a transfer that gathers (Capabilities.Gather: the TCP engine) the task
// is one batch in its strided form (plan.Reads.AppendGather: one op per
// tensor and run of blocks, rows HeadSplit times longer remotely); the TCP
// engine sends it as kvflow's strided READ to a kvflow peer that
// negotiated it (up to 4 MiB of rows per request, gathered by the target)
// and row by row to any other. Otherwise it is one op per row
// (Options.BlockSize rows per block), posted a few layers at a time (at
// most 64Ki ops per batch; the same ops in the same order, the task still
// one unit). bench.BenchmarkHeadSlice measures the strided READ, the row
// reads and whole blocks sliced locally in one run; the strided READ is
// the fastest (figures in bench/RESULTS.md), so it is the default.
// A kvflow-only plan (plan.Plan.KvflowOnly) is refused with
// ErrPeerNotKvflow, before any read, when the remote rank's metadata has
// no kvflow boot epoch: a seed or Mooncake peer would not wait for the
// DONEs such a topology sends it.
//
// A per-session limit (the remote prefill rank's transfer-engine endpoint)
// bounds how many batches run against one peer, so one slow prefill rank
// cannot take every worker: jobs for other peers keep moving.
//
// Peer restarts (retry.go). A prefill rank that restarts keeps its
// side-channel port but gets a new transfer-engine port, new cache
// addresses and a new boot epoch, while decode workers still cache the old
// metadata. When a batch fails (not by the job's own cancellation or
// timeout) and the Transfer can tell how (Capabilities.Classify), the stage
// re-fetches the rank's metadata through Options.Refetch (the handshake
// cache: one fetch for all the reads that failed on the same metadata) and
// reads the task once more with it if retryVerdict allows: the same
// process after a lost connection (it still holds the job's blocks), or a
// new process whose boot epoch, a boot time in unix nanoseconds as kvflow
// sends it, is before the job's admission, with no op of the failed batch
// landed (else the old process was serving during this job's read: the
// job was there). The stale-read guard (below) may still refuse. Otherwise the job fails; when the rank restarted after the
// job's admission, with ErrPeerRestarted (its blocks were lost with the old
// process). Every read also refuses metadata whose boot epoch is after the
// job's admission, so a job whose metadata was first fetched after its
// rank restarted fails rather than reading the new process's blocks in
// place of its own. Between a restart and a job's admission the
// admission time cannot tell whether the old or the new process
// prefilled it: the request's own kvflow_boot_epochs can (a kvflow
// prefill's scheduler adds them). Every read, and every retry's fresh
// metadata, is refused when the rank's boot epoch is not the one the
// request names (job.Job.CheckBootEpoch: job.ErrBootEpoch, the rank
// restarted since the hand-over). Limit: a request without them (from a
// seed prefill) prefilled by the old process and admitted after the new
// one booted is read from the new one, which then refuses (read grants)
// or serves whatever those block ids hold.
// Without Capabilities.Classify or Refetch, a failed read only invalidates
// the peer's cached metadata so the next job re-fetches it.
//
// Reads before the grant. A prefill with read grants serves a request's
// blocks only from its engine's send on, which may reach it a scheduler
// step after the router handed the request to this decode. A batch the
// peer refused (Failure.Refused) is read again with backoff (2 ms doubling
// to 100 ms) until Options.GrantWait (1 s) after the job's admission,
// counted in kvflow_read_grant_waits_total, in two cases: no op landed
// (refused outright), or some landed and every op that failed was refused
// or skipped after the refusal (Failure.RefusedOnly: the grant reached the
// peer while the batch was in flight, after it had checked some ops and
// before others; the TCP engine spreads a batch over several connections).
// Any other failure mixed in (a lost connection, a timeout) is not read
// again here. The task is read again whole, not only its failed ops: the
// ops that landed are the granted request's blocks, which the prefill
// leaves as they are until this worker's DONE, read into the job's own
// local blocks, which nothing reads before the job ends, so they land the
// same bytes again (also when fused or gathered), and the batch stays one
// unit whatever form (plain, strided, gathered, head-slice chunks) the
// transfer runs it in. A job whose blocks were freed (abort, forged DONE)
// fails that much later. A refusal cannot tell a grant not yet arrived
// from one revoked: as for a read refused outright, blocks freed during
// the batch and granted to another request within the window would be
// read as this job's (grants are by block; the README's read grants). The
// cgo engine reports a refused op as a plain failure: never read again.
// Same-host reads (hw/shm) fail a batch with one error, classified by
// internal/node as refused (never Moved), so any refused one is read again.
//
// Byte ledger: when the transfer also reports the bytes that landed per op
// (Capabilities.Ledger; plain batches), the stage reconciles them with
// the manifest it posted; any op short of its length fails the job
// (ErrShortfall, naming the first short op's addresses), even when the
// batch said it succeeded. The TCP engine's batches are all-or-nothing and
// it has no ledger; the cgo engine reports Mooncake's transferred_bytes
// per task (mooncake.LedgerReader), which Engine hands to the stage.
//
// Stale reads (stale.go). With a Guard the stage refuses a read that
// would start past the prefill's abort timeout at a rank without a lease
// renewed here (ErrStaleRead, kvflow_decode_stale_reads_refused_total):
// the prefill may have force-freed and reused the blocks. A rank whose
// lease this worker renews (stages/lease) is checked by its lease instead:
// refused once no RENEW was acknowledged for the TTL less TTL/5
// (ErrLeaseLost, kvflow_decode_lease_lost_reads_total), and checked again
// when the read ends, so bytes read while a lease may have run out are
// never reported done. A retried read is checked before it starts. The
// metric names predate the guard's move here from the decode role.
//
// New(Config, Deps) builds the stage: Config (read.* keys: timeout,
// per-peer limit, fused stitch, and the prefill's grants mode) with
// DefaultConfig, Validate and RegisterFlags; DefaultPool is its pool.
//
// The package never touches sockets or memory itself; it calls a Transfer
// (hw/mooncake in production). A job whose read fails is failed with the
// task, the session and the engine's error; the bytes it did move are not
// trusted.
package read
