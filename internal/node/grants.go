package node

import (
	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/hw/npu"
)

// engineGrants turns a request's block ids into the byte ranges of every
// cache tensor and grants or revokes them on the TCP engine.
type engineGrants struct {
	e *mooncake.TCPEngine
	d *npu.Host
}

func (g engineGrants) ranges(blocks []int) []mooncake.Range {
	l := g.d.Layout()
	base := g.d.BaseAddrs()
	out := make([]mooncake.Range, 0, len(base)*len(blocks))
	for k, b0 := range base {
		_, part := l.CacheOf(k)
		bl := uint64(l.BlockLen(part))
		for _, b := range blocks {
			out = append(out, mooncake.Range{Addr: b0 + uint64(b)*bl, Length: bl})
		}
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
