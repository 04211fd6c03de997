// Package plancmd is `kvflow plan`: it validates a P/D configuration and
// prints, for one request, the plan every decode rank would run — remote
// ranks, handshake ports and, per task, the prefill PP stage and its layers,
// the head slot, the block lists, the number of reads (ops) and the bytes
// they move — so an operator can check a deployment before it serves.
//
// # Usage
//
//	kvflow plan [--config FILE] [config flags] --request-id ID \
//	    --local-blocks 0-2 [--remote-blocks 5,6,7] [--remote-port 20001] \
//	    [--remote-host H] [--remote-engine-id E] [--remote-pcp N] [--remote-dcp N] \
//	    [--decode-rank N] [--json]
//
// The configuration is internal/config's (file and/or flags, flags winning,
// via config.Parse). It may be either side's: a configuration without kv_role
// is read as the decode instance's, and a missing engine_id is replaced by a
// placeholder ("plan"); everything else must pass config.Validate, whose
// problems are all printed. With a prefill configuration, --remote-port,
// --remote-host and --remote-engine-id default to its kv_port (DP replica 0),
// node.side_channel_host and engine_id; with a decode configuration
// --remote-port is required. --remote-blocks defaults to --local-blocks.
// Block lists are "0,1,2", ranges "0-127" or both; "" is the empty list.
//
// Every decode rank of one DP replica is planned (device index
// (pp_rank+pcp_rank)*decode_tp + tp_rank, dcp_rank = tp_rank % dcp_size), or only
// --decode-rank. Ops and bytes come from plan.Ops over the decode rank's and
// the prefill stage's cache layouts (npu.NewLayout of config.Shape), addressed
// from 0; block ids are checked against model.num_blocks on the side the
// configuration describes (the other side's cache size is not in it).
//
// Kvflow-only topologies (decode tp > prefill tp, decode pp > 1; see
// package plan) are marked as such, show each task's head slice (HEAD_SLICE
// i/n: slice i of n of every token row) and end with the prefill ranks'
// side: the decode ranks reading each prefill rank, the DONEs it waits for
// (plan.PrefillExpectedDones) and the bytes it serves. Seed topologies print
// exactly as before.
//
// # Contract
//
// Run returns a *clierr.UsageError (exit 2) for bad flags, an invalid
// configuration and a request plan.PlanRequest or plan.Ops refuses (package
// plan's request field names are rewritten to the flags: --local-blocks,
// ...); flag.ErrHelp for -h, after printing the flag list to stdout; a write
// error otherwise. The table goes to stdout through text/tabwriter; --json
// prints the same report as one indented JSON object (lists never null).
//
// # Never
//
// No I/O other than the configuration file and stdout/stderr: nothing is
// dialed, allocated or registered. Planning is package plan's; this package
// only gathers and prints.
package plancmd
