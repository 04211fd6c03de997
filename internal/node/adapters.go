package node

import (
	"context"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// Fetcher adapts a side-channel client to handshake.Fetcher.
func Fetcher(c *sidechannel.Client) handshake.Fetcher { return fetcher{c} }

// Transfer adapts a transfer engine to read.Transfer.
func Transfer(e mooncake.Engine) read.Transfer { return transfer{e} }

type fetcher struct{ c *sidechannel.Client }

func (f fetcher) GetMeta(ctx context.Context, endpoint string) (job.Meta, error) {
	m, err := f.c.GetMeta(ctx, endpoint)
	if err != nil {
		return job.Meta{}, err
	}
	return job.Meta{EngineID: m.EngineID, TERPCPort: m.TERPCPort, BaseAddrs: m.KVCachesBaseAddr,
		NumBlocks: m.NumBlocks, BootEpoch: m.Ext.BootEpoch, LeaseTTL: m.Ext.LeaseTTL}, nil
}

type transfer struct{ e mooncake.Engine }

func (t transfer) BatchRead(ctx context.Context, session string, ops []plan.Op) error {
	mops := make([]mooncake.Op, len(ops))
	for i, op := range ops {
		mops[i] = mooncake.Op{Local: op.Local, Remote: op.Remote, Length: op.Len}
	}
	return t.e.BatchRead(ctx, session, mops)
}

// CacheLayout is the planner's view of a device layout.
func CacheLayout(l npu.Layout) plan.CacheLayout {
	lens := l.BlockLens()
	out := plan.CacheLayout{BlockLen: make([]uint64, len(lens)), CachesPerLayer: l.NumParts()}
	for i, n := range lens {
		out.BlockLen[i] = uint64(n)
	}
	return out
}
