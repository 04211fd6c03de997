// Package plan turns one KV pull request into its transfer tasks and their
// address triples, exactly as the seed (vllm-ascend's Mooncake connector,
// ../../shared/seed/mooncake_connector.py) computes them, except for the
// deliberate deviations listed below.
//
// The prefill side computes the same rank choice independently to decide
// which of its ranks wait for a DONE, so everything here is bit-exact with
// the seed, including CPython's random.Random (subpackage pyrandom).
//
// # Contract
//
// Everything in this package is a pure function of its arguments: no I/O,
// no goroutines, no clocks, no environment (VLLM_PP_LAYER_PARTITION is the
// Topology.PPLayerPartition value), no global state. Functions never panic
// on bad input; they return an error that names the offending field
// (errors.Join when there are several). Results may alias the caller's
// block-id slices; nothing here mutates them.
//
// # API
//
//	Topology{Prefill, Decode Parallel; Model Model; PPLayerPartition string}
//	Parallel{TP, PP, DP, PCP, DCP, KVPort int}   // PCP/DCP 0 means 1
//	Model{NumLayers, NumKVHeads int; MLA, Sparse bool}
//	Rank{TP, PP, DP, PCP, DCP int}
//	Request{ID; LocalBlockIDs, RemoteBlockIDs; RemoteHost; RemotePort; RemoteEngineID; RemotePCPSize, RemoteDCPSize}
//
//	(Topology).Validate() error                       // every problem of the P/D configuration
//	(Topology).NeedsKvflowPeer() bool                 // decode TP > prefill TP or decode PP > 1
//	(Topology).HeadSourceFor(reqID, tp) (HeadSource, error)
//	PlanRequest(topo, self Rank, req Request) (Plan, error)
//	(*Reads).Build(layout CacheLayout, t Task, local, remote Caches) error
//	AppendOps(dst []Op, layout CacheLayout, t Task, local, remote Caches) ([]Op, error)
//	PrefillExpectedDones(topo, self Rank, reqID string, numBlocks int) (int, error)
//	PrefillMustWait(topo, self Rank, reqID string, numBlocks int) (bool, error)
//
// A Plan (RequestID, RemoteHost, RemoteEngineID, Mode, P, Stitch, Tasks) holds the Tasks in the order the seed's start_load_kv queues them.
// Each Task names one remote prefill rank (RemoteRank, HandshakePort =
// RemotePort + RemoteRank), the head slot it fills (HeadSlot = Offset % P of
// P = tp_num_need_pulls), the prefill PP stage and its layers
// [LayerStart, LayerEnd), the block lists, Last (the seed's all_task_done)
// and Stitch (the seed runs _cat_kv_cache after it). Every task ends with a
// DONE_RECVING to its HandshakePort, also when it moves no block.
//
// AppendOps is _transfer_kv_cache's arithmetic: remote blocks trimmed to the
// last len(local) (local prefix hit); with P == 1 contiguous runs are grouped
// (GroupContiguous), with P > 1 one op per block; for cache tensor k (local
// tensors sliced to the task's layers) with L = BlockLen[k % parts] and
// inner = L / P:
//
//	Local  = local.Base[k]  + local_block*L + HeadSlot*inner
//	Remote = remote.Base[k] + remote_block*inner
//	Len    = inner * run_length
//
// # Compact reads and where the ops are written
//
// A task's op list is a product: every cache tensor reads every block run
// (one op per block with P > 1), so a GQA task with P = 4, 64 layers and
// 128 blocks is 16,384 ops (384 KiB) that differ only by strides. Reads is
// that product in compact form: per tensor its bases, strides and length
// per block (Tensor(k), a TensorReads), and the task's block runs (Run(j),
// a BlockRun), with op i = Tensor(i / Runs()).Op(Run(i % Runs())) in
// AppendOps' (tensor-major) order. Reads.Build does all of AppendOps'
// validation and the grouping in O(blocks), writes no op, reuses its run
// storage (no allocation once warm) and aliases the task's block lists and
// the base-address lists; Len, Bytes and At(i) are O(1). AppendOps is
// Build followed by AppendTo, which writes the first tensor of each part
// from the runs and every later one as a copy shifted by the base-address
// differences.
//
// Planning a request therefore ends with compact Reads: the read stage
// (stages/read) builds one per task, counts bytes from it and hands it to
// the transfer, whose adapter (internal/node) expands it once, straight
// into the engine's own op list (the engine needs that list anyway). No
// []Op is built on the request path. bench.BenchmarkPlan measures both
// halves: planning (PlanRequest + Build, ~1-2 µs for the GQA P = 4 request)
// and the expansion.
//
// The building blocks are exported for the other stages and the vectors:
// StringToInt64Hash, (Topology).RemoteRanksForReq / RemoteRanks /
// PrefillRemoteRanks (_get_remote_ranks_for_req, _get_remote_rank,
// _prefill_get_remote_rank; these reproduce the seed for any sizes it
// accepts, without Validate), NeedPulls (tp_num_need_pulls), PPIndices
// (vLLM's get_pp_indices), SplitMetadata (_get_kv_split_metadata),
// SideChannelPort, HandshakePort, DeviceIndex, NeedsStitch and OpCount.
//
// # Validation
//
// Topology.Validate rejects, before any request runs: missing or
// non-positive sizes; decode TP not dividing prefill TP (when smaller) or
// not a multiple of it (when larger, GQA); KV heads and a TP size neither
// dividing the other (GQA); DCP not dividing TP; decode TP > prefill TP or
// decode PP > 1 with context parallelism; fewer layers than decode PP
// stages, a bad DecodePPLayerPartition or one with an empty stage; PP with
// PCP on one instance, and prefill PP with
// any context parallelism; fewer layers than prefill PP stages; a bad
// PPLayerPartition (not ints, wrong count, wrong sum, negative); rank groups
// that would not give every decode rank exactly P ranks per stage; sparse
// without MLA; the split-mode size combinations the seed asserts on; split
// ports that would repeat; point-to-point GQA pairs whose heads differ; handshake
// ports outside 1..65535. PlanRequest validates the topology, the rank
// (each field in range) and the request (non-negative block ids, local
// count <= remote count outside split mode, remote port in range, remote
// PCP/DCP sizes equal to the topology's prefill sizes).
//
// # Kvflow-only topologies (issue 24)
//
// The seed serves prefill TP >= decode TP and decode PP = 1 only, and
// raises otherwise. kvflow also plans decode TP > prefill TP and decode
// PP > 1 (Topology.NeedsKvflowPeer), between kvflow nodes only: the
// prefill side must count the DONEs planned here, so a decode worker
// refuses a peer that does not advertise kvflow metadata. Every topology
// the seed accepts is planned exactly as before (the vectors); the new
// fields of Task are zero there.
//
//   - Decode TP > prefill TP (HeadSourceFor). GQA: decode rank d holds
//     max(1, H/decode_tp) heads starting at head g (d*H/decode_tp, or
//     d/(decode_tp/H) when the decode side replicates heads); they lie on
//     one prefill rank, g/(H/prefill_tp), as slice (g mod hp)/hd of
//     Split = hp/hd equal head slices of every token row. The task reads
//     that slice (Task.HeadSplit, HeadSlice): one op per token row, local
//     rows contiguous, remote rows Split times longer (Reads: runs are
//     rows; CacheLayout.BlockSize is needed). When the prefill side also
//     replicates (prefill TP > H), replica j of the decode ranks holding
//     head g reads prefill replica j mod (prefill_tp/H), for every
//     request. MLA/sparse: each decode rank reads the whole latent from
//     prefill rank (hash(id) + d) mod prefill_tp. P is 1, no stitch.
//   - Decode PP > 1. Decode stage s holds layers PPIndices(layers, s,
//     decode_pp, DecodePPLayerPartition) and reads, from every prefill
//     stage whose layers overlap them, only the overlap: Task.LayerStart/
//     LayerEnd is the overlap, LocalLayerBase the decode stage's first
//     layer (its local tensors start there), RemoteLayerSkip and
//     RemoteLayers locate the overlap in the prefill stage's tensor list.
//     Prefill stages without overlap get no task from that decode stage.
//     With prefill TP >= decode TP the head slots are the seed's rank
//     choice; the last task is Last (and Stitch when P > 1).
//   - PrefillExpectedDones counts the tasks of every decode rank (TP x PP)
//     aimed at the prefill rank, so it frees after all of them.
//
// # Deliberate deviations from the seed (ARCHITECTURE §5b)
//
// The tests load every vector case, decide by the rule given here whether the
// case is one of these, and check kvflow's corrected answer for those;
// everything else matches the seed field by field.
//
//  1. Point-to-point PCP ports (§5b.1). The seed steps by pcp_rank*tp_size
//     of the decode side while prefill workers listen at
//     pcp_rank*prefill_tp + tp_rank. kvflow steps by the prefill TP. Rule:
//     point-to-point, pcp_rank > 0 and prefill TP != decode TP.
//  2. Point-to-point with P > 1 (§5b.2). The seed keeps only the first
//     port and then raises IndexError. kvflow keeps P ports, and uses the
//     plain rank choice's ranks for this decode TP rank (contiguous head
//     slots), not the seed's range(tp_rank, prefill_tp, tp) whose stride
//     would pair head slot i with the wrong prefill rank. Rule:
//     point-to-point and tp_num_need_pulls > 1.
//  3. Point-to-point prefix hits (§5b.3). The seed asserts when local and
//     remote block counts differ; kvflow passes both lists whole and
//     AppendOps trims as for every other path. Rule: point-to-point and
//     len(local) != len(remote) (local > remote stays an error).
//  4. All-empty context-parallel requests (§5b.4). The seed queues no task
//     and never finishes the request or sends DONE. kvflow emits one empty
//     task per split entry and head slot (no ops, a DONE each, the last one
//     finishing the request). Rule: PCP/DCP path and every split entry has
//     no local and no remote block. Also, with all sizes 1 kvflow always
//     takes the plain path (the seed's PCP-enabled all-ones path would pull
//     only prefill PP stage 0 and also drops all-empty requests).
//  5. Several DONEs per prefill rank (§5b.5). In split mode with
//     remote_dcp/dcp > 1 several decode ranks read one prefill rank; the
//     seed's prefill side frees on the first DONE. PrefillExpectedDones
//     counts the tasks all decode ranks send to a prefill rank, so the
//     prefill tracker frees after the last one.
//  6. Sparse without MLA (§5b.8) is rejected by Validate: the seed treats
//     heads as 1 for the rank choice but uses the GQA heads for
//     tp_num_need_pulls and indexes out of range. Rule: use_sparse and not
//     is_deepseek_mla.
//  7. Prefill membership (§5b.10) is computed with the worker's pp-global
//     device index (tp + (pp + pcp)*prefill_tp), not the bare TP rank the
//     seed compares; the answers are the same (every stage picks the same
//     columns), which the prefill_send_decision vectors confirm.
//  8. Duplicate split ports (§5b.11). remote_dcp/dcp > prefill TP makes the
//     seed dial repeated (and foreign) ports; Validate and SplitMetadata
//     reject it. Rule: split mode and remote_dcp/dcp > prefill TP.
//
// Further strictness that never changes a seed answer the vectors show:
// AppendOps (Reads.Build) rejects local tensor lists shorter than the task's layers, local
// and remote tensor counts that differ (the seed's zip truncates), block ids
// outside the caches and block lengths not divisible by P; GroupContiguous
// rejects lists of unequal length. Failures after planning (transfer errors,
// §5b.7) and tracker bounds (§5b.6, §5b.9) belong to other packages.
//
// In split mode a prefill rank whose split entry would get no block gets no
// task from the seed's decode side (only tiny requests, fewer blocks than
// entries); PrefillExpectedDones follows that using numBlocks, the block
// count the decode side pulls, which a decode-side prefix hit can make
// smaller than the prefill side knows; the prefill tracker's abort timeout
// covers that case.
package plan
