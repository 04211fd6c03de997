package plan

import "fmt"

// HeadSource is where decode TP rank tp of a topology with decode TP >
// prefill TP reads its KV from, within every prefill PP stage: prefill TP
// rank TP, and (GQA) slice Slice of Split equal head slices of that rank's
// blocks (Split 1: the whole block, as for MLA or replicated heads).
type HeadSource struct {
	TP, Slice, Split int
}

// HeadSourceFor is the head source of decode TP rank tp for request reqID
// (decode TP > prefill TP; kvflow only). GQA: the decode rank's first KV
// head g (tp*H/decode_tp, or tp/(decode_tp/H) when heads are replicated
// on the decode side) lives on prefill rank g/(H/prefill_tp) at slice
// (g mod (H/prefill_tp)) / (H/decode_tp); when the prefill side replicates
// heads too (prefill TP > H), the decode replica j of head g reads prefill
// replica j mod (prefill_tp/H): the same for every request, and each
// replica is read by decode_tp/prefill_tp decode ranks. MLA and sparse:
// the whole latent from prefill rank (hash(reqID) + tp) mod prefill_tp, so
// requests spread over the prefill ranks and decode ranks of one request
// over as many of them as they can.
func (t Topology) HeadSourceFor(reqID string, tp int) (HeadSource, error) {
	ptp, dtp, h := t.Prefill.TP, t.Decode.TP, t.Model.NumKVHeads
	if ptp < 1 || dtp <= ptp || tp < 0 || tp >= dtp {
		return HeadSource{}, fmt.Errorf("head source: decode tp rank %d of decode tp %d, prefill tp %d: needs 0 <= rank < decode tp and decode tp > prefill tp", tp, dtp, ptp)
	}
	if t.Model.MLA || t.Model.Sparse {
		start := int(StringToInt64Hash(reqID) % uint64(ptp))
		return HeadSource{TP: (start + tp) % ptp, Split: 1}, nil
	}
	if h < 1 || dtp%ptp != 0 || (h%dtp != 0 && dtp%h != 0) || (h%ptp != 0 && ptp%h != 0) {
		return HeadSource{}, fmt.Errorf("head source: %d kv heads, prefill tp %d, decode tp %d do not split evenly", h, ptp, dtp)
	}
	hp, hd := max(1, h/ptp), max(1, h/dtp)
	g := tp * hd
	if dtp > h {
		g = tp / (dtp / h)
	}
	if ptp <= h {
		return HeadSource{TP: g / hp, Slice: (g % hp) / hd, Split: hp / hd}, nil
	}
	rep := ptp / h
	j := tp % (dtp / h)
	return HeadSource{TP: g*rep + j%rep, Split: 1}, nil
}

// planKvflow plans a request of a kvflow-only topology (decode TP >
// prefill TP, or decode PP > 1; no context parallelism): for every prefill
// PP stage whose layers overlap this decode stage's, the tasks of the TP
// choice (the seed's rank choice when prefill TP >= decode TP, else
// HeadSourceFor), restricted to the overlap. Offsets, head slots and the
// stitch keep the seed's meaning; the last task is Last (and Stitch when
// P > 1).
func planKvflow(topo Topology, self Rank, req Request) (Plan, error) {
	nl := topo.Model.NumLayers
	dlo, dhi, err := PPIndices(nl, self.PP, topo.Decode.PP, topo.DecodePPLayerPartition)
	if err != nil {
		return Plan{}, fmt.Errorf("decode pp stage %d: %w", self.PP, err)
	}
	ptp, pp := topo.Prefill.TP, topo.Prefill.PP
	pl := Plan{RequestID: req.ID, RemoteHost: req.RemoteHost, RemoteEngineID: req.RemoteEngineID, Mode: ModeTP, P: 1, KvflowOnly: true}
	// srcs[i]: prefill TP rank of head slot i (the same in every stage).
	var srcs []int
	src := HeadSource{Split: 1}
	if ptp >= topo.Decode.TP {
		p := topo.NeedPulls()
		ranks, err := topo.RemoteRanks(req.ID, self.TP)
		if err != nil {
			return Plan{}, err
		}
		if len(ranks) < p*pp {
			return Plan{}, fmt.Errorf("%s chosen, %s needed", plural(len(ranks), "remote rank"), plural(p*pp, "task"))
		}
		srcs = make([]int, p)
		for i := range srcs {
			srcs[i] = ranks[i] // stage 0: tp ranks
		}
		pl.P, pl.Stitch = p, p > 1
	} else {
		if src, err = topo.HeadSourceFor(req.ID, self.TP); err != nil {
			return Plan{}, err
		}
		srcs = []int{src.TP}
	}
	p := pl.P
	for s := 0; s < pp; s++ {
		plo, phi, err := PPIndices(nl, s, pp, topo.PPLayerPartition)
		if err != nil {
			return Plan{}, err
		}
		lo, hi := max(plo, dlo), min(phi, dhi)
		if lo >= hi {
			continue
		}
		for i, tp := range srcs {
			t := Task{
				RemoteRank: tp + s*ptp, Offset: s*p + i, P: p, HeadSlot: i, PPStage: s,
				LayerStart: lo, LayerEnd: hi,
				LocalBlockIDs: req.LocalBlockIDs, RemoteBlockIDs: req.RemoteBlockIDs,
				LocalLayerBase: dlo, RemoteLayerSkip: lo - plo, RemoteLayers: phi - plo,
			}
			t.HandshakePort = req.RemotePort + t.RemoteRank
			if src.Split > 1 {
				t.HeadSplit, t.HeadSlice = src.Split, src.Slice
			}
			pl.Tasks = append(pl.Tasks, t)
		}
	}
	if n := len(pl.Tasks); n > 0 {
		pl.Tasks[n-1].Last = true
		pl.Tasks[n-1].Stitch = p > 1
	}
	return pl, nil
}
