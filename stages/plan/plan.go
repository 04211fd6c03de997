package plan

import (
	"errors"
	"fmt"
)

// Request is one pull request as the decode worker receives it (the seed's
// ReqMeta plus the request id). RemotePort is the prefill replica's side
// channel base port (kv_transfer_params.remote_port). RemotePCPSize and
// RemoteDCPSize may be 0, meaning 1; when set they must agree with the
// topology's prefill sizes.
type Request struct {
	ID             string
	LocalBlockIDs  []int
	RemoteBlockIDs []int
	RemoteHost     string
	RemotePort     int
	RemoteEngineID string
	RemotePCPSize  int
	RemoteDCPSize  int
	// BootEpochs is kvflow's optional kv_transfer_params.kvflow_boot_epochs:
	// entry r is the boot epoch of the prefill rank at RemotePort + r when
	// it handed the request over (0 or no entry: unknown). Planning never
	// reads it; the decode stages compare it with each rank's metadata
	// (job.Job.CheckBootEpoch). nil from seed prefills.
	BootEpochs []uint64
}

// Task is one transfer the decode worker runs for a request: one remote
// prefill rank, one head slot, one PP stage's layers. Each task ends with a
// DONE_RECVING to HandshakePort, whether or not it moved any block.
//
// LocalBlockIDs and RemoteBlockIDs alias the Request's slices (no copy).
// RemoteBlockIDs is the list as the seed queues it; the trim to the last
// len(LocalBlockIDs) blocks (local prefix hit) happens in Reads.Build
// (AppendOps).
type Task struct {
	RemoteRank     int // HandshakePort - RemotePort: tp + (pp + pcp)*prefill_tp of the prefill worker
	HandshakePort  int
	Offset         int // the seed's offset: index of the task within its split entry
	P              int // tp_num_need_pulls
	HeadSlot       int // Offset % P: which 1/P of the local block this task fills
	PPStage        int // Offset / P: prefill PP stage
	LayerStart     int // first layer of the prefill PP stage
	LayerEnd       int // one past its last layer
	LocalBlockIDs  []int
	RemoteBlockIDs []int
	Last           bool // the seed's all_task_done: the task whose end finishes the request
	Stitch         bool // the seed runs _cat_kv_cache after this task (P > 1, last offset)

	// Kvflow-only topologies (Topology.NeedsKvflowPeer); all zero in every
	// plan the seed makes, and zero values keep the seed's arithmetic.
	//
	// HeadSplit > 1 (decode TP > prefill TP, GQA): the remote block holds
	// HeadSplit times the local block's heads, and the task reads slice
	// HeadSlice of every token row (row = local block_len / block_size
	// bytes, remote rows HeadSplit times longer). P is 1 then.
	HeadSplit, HeadSlice int
	// LocalLayerBase is the first layer of this decode worker's PP stage:
	// its local cache tensors start there (decode PP > 1).
	LocalLayerBase int
	// RemoteLayerSkip is how many layers of the remote prefill stage come
	// before LayerStart, and RemoteLayers how many layers that stage has
	// (its metadata lists their tensors); 0 means LayerEnd-LayerStart, the
	// task covering the whole stage as in the seed.
	RemoteLayerSkip, RemoteLayers int
}

// Plan is everything the decode worker does for one request.
type Plan struct {
	RequestID      string
	RemoteHost     string // from the request, for the handshake and read stages
	RemoteEngineID string
	Mode           Mode
	P              int  // tp_num_need_pulls
	Stitch         bool // P > 1: heads must be re-interleaved after all tasks landed
	Tasks          []Task
	// KvflowOnly: planned for a topology the seed cannot serve
	// (Topology.NeedsKvflowPeer); every remote rank must be kvflow.
	KvflowOnly bool
}

// Entry is one element of the seed's _get_kv_split_metadata result: the ports
// of one remote context shard (one per head slot) and its block lists.
type Entry struct {
	Ports          []int
	LocalBlockIDs  []int
	RemoteBlockIDs []int
}

// SplitMetadata is _get_kv_split_metadata for decode worker self, with the
// deviations of the package docs (§5b.1-3: prefill-TP port stride, all P
// ports kept, prefix hits allowed). Slices alias req's.
func SplitMetadata(topo Topology, self Rank, req Request) (Mode, []Entry, error) {
	rpcp, rdcp := one(req.RemotePCPSize), one(req.RemoteDCPSize)
	d := topo.Decode
	mode := modeFor(d, rpcp, rdcp)
	nl, nr := len(req.LocalBlockIDs), len(req.RemoteBlockIDs)
	switch mode {
	case ModeTP:
		ranks, err := topo.RemoteRanks(req.ID, self.TP)
		if err != nil {
			return mode, nil, err
		}
		ports := make([]int, len(ranks))
		for i, r := range ranks {
			ports[i] = req.RemotePort + r
		}
		return mode, []Entry{{ports, req.LocalBlockIDs, req.RemoteBlockIDs}}, nil
	case ModePointToPoint:
		p := topo.NeedPulls()
		base := req.RemotePort + self.PCP*topo.Prefill.TP // §5b.1: prefill TP stride
		var ports []int
		if p == 1 {
			ports = []int{base + self.TP}
		} else {
			// §5b.2: all P ports, the head-correct ranks of the plain rank
			// choice (range(tp_rank, prefill_tp, tp) would interleave heads).
			ranks, err := topo.RemoteRanks(req.ID, self.TP)
			if err != nil {
				return mode, nil, err
			}
			if len(ranks) < p {
				return mode, nil, fmt.Errorf("point-to-point: %d remote ranks for tp_num_need_pulls %d", len(ranks), p)
			}
			ports = make([]int, p)
			for i := range ports {
				ports[i] = base + ranks[i]
			}
		}
		// §5b.3: local and remote counts may differ (prefix hit).
		return mode, []Entry{{ports, req.LocalBlockIDs, req.RemoteBlockIDs}}, nil
	}
	// ModeSplit.
	if d.pcp() != 1 {
		return mode, nil, fmt.Errorf("split: decode.pcp_size %d must be 1", d.pcp())
	}
	ptp := topo.Prefill.TP
	if topo.usesMLALayout() {
		if !((d.dcp() == 1 && (d.TP == 1 || d.TP == ptp)) || (d.dcp() == rdcp && d.TP == ptp)) {
			return mode, nil, fmt.Errorf("split: MLA decode tp %d / dcp %d cannot pull prefill tp %d / dcp %d", d.TP, d.dcp(), ptp, rdcp)
		}
	} else if d.TP != ptp || !(d.dcp() == 1 || d.dcp() == rdcp) {
		return mode, nil, fmt.Errorf("split: decode tp %d / dcp %d cannot pull prefill tp %d / dcp %d", d.TP, d.dcp(), ptp, rdcp)
	}
	if rdcp%d.dcp() != 0 {
		return mode, nil, fmt.Errorf("split: request remote_dcp_size %d not a multiple of decode.dcp_size %d", rdcp, d.dcp())
	}
	rd := rdcp / d.dcp()
	if rd > ptp {
		return mode, nil, fmt.Errorf("split: remote_dcp_size %d / decode dcp %d exceeds prefill tp %d (duplicate ports)", rdcp, d.dcp(), ptp)
	}
	kv := rpcp * rd
	tpOff := self.TP / rd * rd
	ports := make([]int, kv)
	nums := make([]int, kv)
	for cp := 0; cp < rpcp; cp++ {
		for j := 0; j < rd; j++ {
			ports[cp*rd+j] = req.RemotePort + cp*ptp + j + tpOff
		}
	}
	rem := nl % kv
	for i := range nums {
		nums[i] = nl / kv
		if i < rem {
			nums[i]++
		}
	}
	// Keep the last (maybe partial) block last: rotate the remainder to the end.
	entries := make([]Entry, kv)
	flat := make([]int, kv)
	for i := 0; i < kv; i++ {
		flat[i] = ports[(i+rem)%kv]
	}
	off := 0
	for i := 0; i < kv; i++ {
		n := nums[(i+rem)%kv]
		if n > nr {
			return mode, nil, fmt.Errorf("request.remote_block_ids: %d blocks, split entry %d needs %d", nr, i, n)
		}
		entries[i] = Entry{
			Ports:          flat[i : i+1 : i+1],
			LocalBlockIDs:  req.LocalBlockIDs[off : off+n : off+n],
			RemoteBlockIDs: req.RemoteBlockIDs[:n:n],
		}
		off += n
	}
	return mode, entries, nil
}

// checkRequest validates req's own fields against topo.
func checkRequest(topo Topology, req Request) error {
	var errs []error
	for i, b := range req.LocalBlockIDs {
		if b < 0 {
			errs = append(errs, fmt.Errorf("request.local_block_ids[%d]: negative block id %d", i, b))
			break
		}
	}
	for i, b := range req.RemoteBlockIDs {
		if b < 0 {
			errs = append(errs, fmt.Errorf("request.remote_block_ids[%d]: negative block id %d", i, b))
			break
		}
	}
	if req.RemotePort < 1 || req.RemotePort > 65535 {
		errs = append(errs, fmt.Errorf("request.remote_port: %d outside 1..65535", req.RemotePort))
	}
	if req.RemotePCPSize < 0 || req.RemoteDCPSize < 0 {
		errs = append(errs, fmt.Errorf("request.remote_pcp_size/remote_dcp_size: negative (%d, %d)", req.RemotePCPSize, req.RemoteDCPSize))
	} else {
		if one(req.RemotePCPSize) != topo.Prefill.pcp() {
			errs = append(errs, fmt.Errorf("request.remote_pcp_size: %d but prefill.pcp_size is %d", one(req.RemotePCPSize), topo.Prefill.pcp()))
		}
		if one(req.RemoteDCPSize) != topo.Prefill.dcp() {
			errs = append(errs, fmt.Errorf("request.remote_dcp_size: %d but prefill.dcp_size is %d", one(req.RemoteDCPSize), topo.Prefill.dcp()))
		}
	}
	mode := modeFor(topo.Decode, one(req.RemotePCPSize), one(req.RemoteDCPSize))
	if mode != ModeSplit && len(req.LocalBlockIDs) > len(req.RemoteBlockIDs) {
		errs = append(errs, fmt.Errorf("request.local_block_ids: %d blocks, more than the %d remote_block_ids", len(req.LocalBlockIDs), len(req.RemoteBlockIDs)))
	}
	return errors.Join(errs...)
}

// PlanRequest plans one request on decode worker self: the tasks the seed's
// start_load_kv would queue, in the same order, with the deviations listed
// in the package docs. It validates topo, self and req first and returns
// every problem found.
func PlanRequest(topo Topology, self Rank, req Request) (Plan, error) {
	if err := topo.Validate(); err != nil {
		return Plan{}, fmt.Errorf("plan: topology: %w", err)
	}
	if err := errors.Join(topo.checkDecodeRank(self), checkRequest(topo, req)); err != nil {
		return Plan{}, fmt.Errorf("plan: request %q: %w", req.ID, err)
	}
	pl, err := planValid(topo, self, req)
	if err != nil {
		return Plan{}, fmt.Errorf("plan: request %q: %w", req.ID, err)
	}
	return pl, nil
}

// planValid plans a request against an already validated topology.
func planValid(topo Topology, self Rank, req Request) (Plan, error) {
	if topo.NeedsKvflowPeer() {
		return planKvflow(topo, self, req)
	}
	p := topo.NeedPulls()
	mode, entries, err := SplitMetadata(topo, self, req)
	if err != nil {
		return Plan{}, err
	}
	pl := Plan{RequestID: req.ID, RemoteHost: req.RemoteHost, RemoteEngineID: req.RemoteEngineID, Mode: mode, P: p, Stitch: p > 1}
	pp := topo.Prefill.PP
	if mode == ModeTP {
		// The plain start_load_kv path: P tasks for every prefill PP stage.
		e := entries[0]
		n := p * pp
		if len(e.Ports) < n {
			return Plan{}, fmt.Errorf("%s chosen, %s needed", plural(len(e.Ports), "remote rank"), plural(n, "task"))
		}
		pl.Tasks = make([]Task, n)
		for i := 0; i < n; i++ {
			stage := i / p
			lo, hi, err := PPIndices(topo.Model.NumLayers, stage, pp, topo.PPLayerPartition)
			if err != nil {
				return Plan{}, err
			}
			pl.Tasks[i] = Task{
				RemoteRank: e.Ports[i] - req.RemotePort, HandshakePort: e.Ports[i],
				Offset: i, P: p, HeadSlot: i % p, PPStage: stage, LayerStart: lo, LayerEnd: hi,
				LocalBlockIDs: e.LocalBlockIDs, RemoteBlockIDs: e.RemoteBlockIDs,
				Last: i == n-1, Stitch: NeedsStitch(i, p, pp),
			}
		}
		return pl, nil
	}
	// The context-parallel path: P tasks per non-empty entry (pp is 1 here).
	lo, hi, err := PPIndices(topo.Model.NumLayers, 0, pp, topo.PPLayerPartition)
	if err != nil {
		return Plan{}, err
	}
	allEmpty := true
	count := 0
	for _, e := range entries {
		if len(e.LocalBlockIDs)+len(e.RemoteBlockIDs) > 0 {
			allEmpty = false
			count += len(e.Ports[:min(p, len(e.Ports))])
		}
	}
	if allEmpty {
		// §5b.4: the seed queues nothing and the request hangs; notify every
		// remote rank with an empty task so it is finished and freed.
		for _, e := range entries {
			count += min(p, len(e.Ports))
		}
	}
	pl.Tasks = make([]Task, 0, count)
	for _, e := range entries {
		if !allEmpty && len(e.LocalBlockIDs)+len(e.RemoteBlockIDs) == 0 {
			continue
		}
		if len(e.Ports) < p {
			return Plan{}, fmt.Errorf("%d ports for tp_num_need_pulls %d", len(e.Ports), p)
		}
		for i := 0; i < p; i++ {
			pl.Tasks = append(pl.Tasks, Task{
				RemoteRank: e.Ports[i] - req.RemotePort, HandshakePort: e.Ports[i],
				Offset: i, P: p, HeadSlot: i % p, PPStage: i / p, LayerStart: lo, LayerEnd: hi,
				LocalBlockIDs: e.LocalBlockIDs, RemoteBlockIDs: e.RemoteBlockIDs,
				Stitch: NeedsStitch(i, p, pp),
			})
		}
	}
	if len(pl.Tasks) > 0 {
		pl.Tasks[len(pl.Tasks)-1].Last = true
	}
	return pl, nil
}

// NeedsStitch is the seed's need_cat_cache for the task at offset: P > 1 and
// offset == P*prefill_pp - 1.
func NeedsStitch(offset, p, prefillPP int) bool {
	return p > 1 && offset == p*prefillPP-1
}

// PrefillExpectedDones is the prefill-side decision for a request that
// prefill worker self holds: how many DONE_RECVING messages it should wait
// for before freeing the request's blocks (0: free at once, the seed's
// add_not_transfer_request). It counts the tasks that every decode rank's
// plan sends to self, so it agrees with PlanRequest by construction;
// membership uses self's pp-global device index (§5b.10) and the count is
// more than one when several decode ranks read the same prefill rank
// (§5b.5). numBlocks is the number of blocks the decode side pulls: it only
// matters in split mode, where a split entry with no blocks gets no task.
func PrefillExpectedDones(topo Topology, self Rank, reqID string, numBlocks int) (int, error) {
	if err := topo.Validate(); err != nil {
		return 0, fmt.Errorf("plan: topology: %w", err)
	}
	if err := topo.checkPrefillRank(self); err != nil {
		return 0, fmt.Errorf("plan: prefill %w", err)
	}
	if numBlocks < 0 {
		return 0, fmt.Errorf("plan: numBlocks: negative (%d)", numBlocks)
	}
	me := DeviceIndex(topo.Prefill, self)
	const base = 1 // any valid port: only RemoteRank is compared
	blocks := make([]int, numBlocks)
	req := Request{ID: reqID, LocalBlockIDs: blocks, RemoteBlockIDs: blocks, RemotePort: base,
		RemotePCPSize: topo.Prefill.pcp(), RemoteDCPSize: topo.Prefill.dcp()}
	n := 0
	for pp := 0; pp < topo.Decode.PP; pp++ {
		for pcp := 0; pcp < topo.Decode.pcp(); pcp++ {
			for tp := 0; tp < topo.Decode.TP; tp++ {
				pl, err := planValid(topo, Rank{TP: tp, PP: pp, PCP: pcp}, req)
				if err != nil {
					return 0, fmt.Errorf("plan: request %q, decode tp %d pp %d pcp %d: %w", reqID, tp, pp, pcp, err)
				}
				for _, t := range pl.Tasks {
					if t.RemoteRank == me {
						n++
					}
				}
			}
		}
	}
	return n, nil
}

// PrefillMustWait reports whether prefill worker self must keep the
// request's blocks until DONE (the seed's add_delayed_request).
func PrefillMustWait(topo Topology, self Rank, reqID string, numBlocks int) (bool, error) {
	n, err := PrefillExpectedDones(topo, self, reqID, numBlocks)
	return n > 0, err
}
