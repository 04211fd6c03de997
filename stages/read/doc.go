// Package read is the decode pipeline's third stage: it turns each task of
// a job plus its remote metadata into address triples (stages/plan's
// seed-exact arithmetic) and runs them through a transfer engine, one batch
// per task, the tasks of one job concurrently.
//
// The triples travel compact: per task the stage builds a plan.Reads (the
// task's tensors times its block runs; validated, O(blocks), pooled), takes
// the batch's bytes and op count from it, and hands it to the transfer. A
// ReadsTransfer (internal/node's adapter of hw/mooncake) expands it once,
// straight into its engine's own op list; the stage writes a []plan.Op
// itself (Reads.AppendTo) only for a transfer that takes op lists
// (Transfer, LedgerTransfer). A GQA request with
// tp_num_need_pulls 4, 64 layers and 128 blocks is 65,536 ops (1.5 MiB),
// so that list is written once, where the engine needs it, never twice.
//
// Fused stitch: with tp_num_need_pulls P > 1 a decode block is the P
// prefill ranks' slices of every token, and the seed reads each slice
// contiguously and then transposes the block. When the transfer can lay an
// op's bytes out in strided rows (StridedTransfer: the TCP engine) and
// Options.BlockSize splits every block into P equal token slices, the
// stage instead interleaves the reads (plan.Reads.Interleave: same remote
// ranges and lengths, each op starting at its slot in the block's first
// token, rows of row/P bytes one token apart), so the blocks land
// stitched and the job is marked Stitched for the stitch stage to skip.
// The decision is per job, before any task runs: every slice of a block
// must land the same way. Options.NoFuse keeps the seed's way.
//
// A per-session limit (the remote prefill rank's transfer-engine endpoint)
// bounds how many batches run against one peer, so one slow prefill rank
// cannot take every worker: jobs for other peers keep moving. A failed read
// invalidates the peer's cached metadata (it may have restarted with new
// addresses) so the next job re-fetches it.
//
// Byte ledger: when the transfer also reports the bytes that landed per op
// (ReadsLedgerTransfer or LedgerTransfer), the stage reconciles them with
// the manifest it posted; any op short of its length fails the job
// (ErrShortfall, naming the first short op's addresses), even when the
// batch said it succeeded. The TCP engine's batches are all-or-nothing, so
// its adapter needs no ledger; engines that report transferred bytes per
// task (Mooncake's C API) plug in here.
//
// The package never touches sockets or memory itself; it calls a Transfer
// (hw/mooncake in production). A job whose read fails is failed with the
// task, the session and the engine's error; the bytes it did move are not
// trusted.
package read
