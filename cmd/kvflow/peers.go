package main

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/stages/plan"
)

// peerSampleIDs is how many request ids prefillPeers plans. When prefill
// and decode TP differ the seed picks a request's prefill ranks at random
// (seeded by the request id); 512 ids reach every choice a topology of up
// to hundreds of ranks can make.
const peerSampleIDs = 512

// samplePort is the remote_port of the sample requests (any valid port:
// ranks are offsets from it).
const samplePort = 10000

// prefillPeers is the set of prefill ranks (offsets from a request's
// remote_port: tp + (pp + pcp)*prefill_tp) that this decode worker may
// dial, sorted. It plans sample requests against the configured topology
// exactly as the read path does.
func prefillPeers(cfg config.Config) ([]int, error) {
	topo, self := cfg.Topology(), cfg.Self()
	blocks := make([]int, 64) // enough for every context-parallel shard to get blocks
	for i := range blocks {
		blocks[i] = i
	}
	seen := map[int]bool{}
	for i := range peerSampleIDs {
		req := plan.Request{ID: "peer-sample-" + strconv.Itoa(i), LocalBlockIDs: blocks, RemoteBlockIDs: blocks,
			RemoteHost: "prefill", RemoteEngineID: "prefill", RemotePort: samplePort}
		pl, err := plan.PlanRequest(topo, self, req)
		if err != nil {
			return nil, err
		}
		for _, t := range pl.Tasks {
			seen[t.RemoteRank] = true
		}
	}
	ranks := make([]int, 0, len(seen))
	for r := range seen {
		ranks = append(ranks, r)
	}
	slices.Sort(ranks)
	return ranks, nil
}

// describePeers is the start-up line of a decode worker: which prefill
// ranks it will dial and at which side-channel ports.
func describePeers(cfg config.Config, ranks []int) string {
	p := cfg.KVTransfer.KVConnectorExtraConfig.Prefill
	var b strings.Builder
	for i, r := range ranks {
		if i > 0 {
			b.WriteString(", ")
		}
		tp := r % max(1, p.TPSize)
		fmt.Fprintf(&b, "remote_port+%d (prefill tp %d, pp/pcp %d)", r, tp, r/max(1, p.TPSize))
	}
	return b.String()
}
