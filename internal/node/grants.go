package node

import (
	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/hw/npu"
)

// engineGrants turns a request's block ids into the byte ranges of every
// cache tensor (npu.BlockRanges) and grants or revokes them on an engine
// with read grants.
type engineGrants struct {
	e mooncake.Granter
	d npu.Device
}

func (g engineGrants) ranges(blocks []int) []mooncake.Range {
	rs := npu.BlockRanges(g.d, blocks)
	out := make([]mooncake.Range, len(rs))
	for i, r := range rs {
		out[i] = mooncake.Range{Addr: r.Addr, Length: r.Len}
	}
	return out
}

func (g engineGrants) Grant(blocks []int) error { return g.e.Grant(g.ranges(blocks)...) }

// Revoke never waits for readers (prefill.Grants).
func (g engineGrants) Revoke(blocks []int) (<-chan struct{}, error) {
	return g.e.RevokeAsync(g.ranges(blocks)...)
}

func (g engineGrants) GrantAll() error  { g.e.GrantAll(); return nil }
func (g engineGrants) RevokeAll() error { return g.e.RevokeAll() }
