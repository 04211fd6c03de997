package plan

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"

	"github.com/kvflow/kvflow/stages/plan/pyrandom"
)

// StringToInt64Hash is the seed's string_to_int64_hash: the first 8 bytes of
// SHA-256 of the UTF-8 id, read little-endian.
func StringToInt64Hash(s string) uint64 {
	sum := sha256.Sum256([]byte(s))
	return binary.LittleEndian.Uint64(sum[:8])
}

// rankConfig is what the seed's rank choice reads from the worker.
type rankConfig struct {
	PrefillTP, DecodeTP, PrefillPP int
	Heads                          int
	MLA, Sparse                    bool
	P                              int // tp_num_need_pulls
}

func (t Topology) rankConfig() rankConfig {
	return rankConfig{
		PrefillTP: t.Prefill.TP, DecodeTP: t.Decode.TP, PrefillPP: t.Prefill.PP,
		Heads: t.Model.NumKVHeads, MLA: t.Model.MLA, Sparse: t.Model.Sparse,
		P: t.NeedPulls(),
	}
}

func (c rankConfig) kvHeads() int {
	if c.MLA || c.Sparse {
		return 1
	}
	return c.Heads
}

// randomBranch is the condition of _get_remote_tp_ranks' random split.
func (c rankConfig) randomBranch() bool {
	return c.PrefillTP > c.Heads || c.MLA || c.Sparse
}

func (c rankConfig) numGroups() int { return max(1, c.PrefillTP/c.kvHeads()) }
func (c rankConfig) sampleK() int   { return max(c.DecodeTP/c.kvHeads(), 1) }

// remoteRanks is _get_remote_ranks_for_req: for every group index (decode TP
// rank) the prefill ranks it pulls, pp-global (tp + pp*prefill_tp), stage by
// stage. It fails where the seed raises (numpy reshape, sample ValueError).
func (c rankConfig) remoteRanks(reqID string) ([][]int, error) {
	if c.PrefillTP < 1 || c.DecodeTP < 1 || c.PrefillPP < 1 || c.Heads < 1 || c.P < 1 {
		return nil, fmt.Errorf("rank choice: sizes must be >= 1 (prefill tp %d, decode tp %d, prefill pp %d, heads %d, tp_num_need_pulls %d)",
			c.PrefillTP, c.DecodeTP, c.PrefillPP, c.Heads, c.P)
	}
	ptp, pp := c.PrefillTP, c.PrefillPP
	if ptp == c.DecodeTP {
		out := make([][]int, ptp)
		flat := make([]int, ptp*pp)
		for tp := 0; tp < ptp; tp++ {
			g := flat[tp*pp : (tp+1)*pp : (tp+1)*pp]
			for s := 0; s < pp; s++ {
				g[s] = tp + s*ptp
			}
			out[tp] = g
		}
		return out, nil
	}
	var perStage []int // chosen stage-0 TP ranks, in the seed's flattened order
	var chunk int      // group length within one stage
	if c.randomBranch() {
		ng := c.numGroups()
		if ptp%ng != 0 {
			return nil, fmt.Errorf("rank choice: cannot reshape %d prefill tp ranks into rows of %d groups", ptp, ng)
		}
		var r pyrandom.Random
		r.Seed(StringToInt64Hash(reqID))
		var buf [16]int
		idx, err := r.AppendSample(buf[:0], ng, c.sampleK())
		if err != nil {
			return nil, fmt.Errorf("rank choice: %w", err)
		}
		rows := ptp / ng
		perStage = make([]int, 0, rows*len(idx))
		for row := 0; row < rows; row++ {
			for _, g := range idx {
				perStage = append(perStage, row*ng+g)
			}
		}
		chunk = c.P
	} else {
		gs := ptp / c.DecodeTP
		if gs < 1 {
			return nil, fmt.Errorf("rank choice: prefill tp %d < decode tp %d", ptp, c.DecodeTP)
		}
		// Slices [i*gs, (i+1)*gs) for i < decode tp: all of 0..decode_tp*gs.
		perStage = make([]int, 0, c.DecodeTP*gs)
		for i := 0; i < c.DecodeTP*gs && i < ptp; i++ {
			perStage = append(perStage, i)
		}
		chunk = gs
	}
	// Groups: consecutive chunks of perStage; the seed's last chunk may be short.
	ngroups := (len(perStage) + chunk - 1) / chunk
	out := make([][]int, ngroups)
	flat := make([]int, 0, len(perStage)*pp)
	for gi := 0; gi < ngroups; gi++ {
		lo, hi := gi*chunk, min((gi+1)*chunk, len(perStage))
		start := len(flat)
		for s := 0; s < pp; s++ {
			for _, r := range perStage[lo:hi] {
				flat = append(flat, r+s*ptp)
			}
		}
		out[gi] = flat[start:len(flat):len(flat)]
	}
	return out, nil
}

// RemoteRanksForReq is the seed's _get_remote_ranks_for_req(req_id): for each
// decode TP rank, the prefill ranks (tp + pp*prefill_tp) it pulls from, in
// task order. It computes exactly what the seed computes for any sizes the
// seed accepts, without Validate; it returns an error where the seed raises.
func (t Topology) RemoteRanksForReq(reqID string) ([][]int, error) {
	return t.rankConfig().remoteRanks(reqID)
}

// RemoteRanks is the seed's _get_remote_rank(req_id) for decode TP rank tp.
func (t Topology) RemoteRanks(reqID string, tp int) ([]int, error) {
	all, err := t.RemoteRanksForReq(reqID)
	if err != nil {
		return nil, err
	}
	if tp < 0 || tp >= len(all) {
		return nil, fmt.Errorf("rank.tp_rank: %d outside the %d rank groups chosen for this topology", tp, len(all))
	}
	return all[tp], nil
}

// PrefillRemoteRanks is the seed's _prefill_get_remote_rank(req_id): every
// prefill rank some decode rank pulls from, flattened.
func (t Topology) PrefillRemoteRanks(reqID string) ([]int, error) {
	all, err := t.RemoteRanksForReq(reqID)
	if err != nil {
		return nil, err
	}
	var flat []int
	for _, g := range all {
		flat = append(flat, g...)
	}
	return flat, nil
}
