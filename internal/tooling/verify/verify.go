package verify

import (
	"bytes"
	"encoding/binary"
	"fmt"

	"github.com/kvflow/kvflow/stages/plan"
)

// Blocks is a cache whose blocks can be addressed (hw/npu's Host).
type Blocks interface {
	Block(layer, part, b int) []byte
}

// Seed is the pattern seed of one prefill block.
func Seed(tag uint64, rank, layer, part, block int) uint64 {
	return mix(tag ^ mix(uint64(rank)<<48^uint64(layer)<<32^uint64(part)<<24^uint64(block)))
}

func mix(z uint64) uint64 {
	z += 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// Fill writes the pattern of seed into b.
func Fill(b []byte, seed uint64) {
	x := seed | 1
	i := 0
	for ; i+8 <= len(b); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(b[i:], x)
	}
	for ; i < len(b); i++ {
		b[i] = byte(x >> (8 * (i & 7)))
	}
}

// FillBlocks fills blocks of one prefill rank's cache (all its layers and
// parts) with the pattern of tag.
func FillBlocks(c Blocks, layers, parts int, rank int, blocks []int, tag uint64) {
	for l := range layers {
		for p := range parts {
			for _, b := range blocks {
				Fill(c.Block(l, p, b), Seed(tag, rank, l, p, b))
			}
		}
	}
}

// Check compares decode's blocks for the plan pl against the pattern the
// prefill ranks were filled with (tag; rank r's layer index is global
// layer minus its PP stage's first layer). rowBytes[part] is the bytes of
// one token of one part on a prefill rank (its heads × dim × dtype). The
// decode cache holds the layers of its own PP stage from the task's
// LocalLayerBase; a head-split task (HeadSplit > 1) holds slice HeadSlice
// of every prefill row. It returns the number of mismatching bytes and the
// first mismatch.
func Check(dec Blocks, pl plan.Plan, rowBytes []int, tag uint64) (bad int64, err error) {
	var scratch []byte
	for _, t := range pl.Tasks {
		nl := len(t.LocalBlockIDs)
		remote := t.RemoteBlockIDs[len(t.RemoteBlockIDs)-nl:]
		split := max(1, t.HeadSplit)
		for layer := t.LayerStart; layer < t.LayerEnd; layer++ {
			remoteLayer := layer - t.LayerStart + t.RemoteLayerSkip
			for part, row := range rowBytes {
				drow := row / split // the decode rank's share of a prefill row
				for i, lb := range t.LocalBlockIDs {
					got := dec.Block(layer-t.LocalLayerBase, part, lb)
					src := len(got) / max(1, t.P) * split
					if cap(scratch) < src {
						scratch = make([]byte, src)
					}
					want := scratch[:src]
					Fill(want, Seed(tag, t.RemoteRank, remoteLayer, part, remote[i]))
					// Token tok of the source lands at row tok*P + slot
					// (slice HeadSlice of it with a head split).
					for tok := 0; tok*row < src; tok++ {
						off := (tok*t.P + t.HeadSlot) * drow
						g, w := got[off:off+drow], want[tok*row+t.HeadSlice*drow:][:drow]
						if bytes.Equal(g, w) {
							continue
						}
						for k := range g {
							if g[k] != w[k] {
								bad++
								if err == nil {
									err = fmt.Errorf("request %q layer %d part %d local block %d (remote %d of rank %d): byte %d is %#x, want %#x",
										pl.RequestID, layer, part, lb, remote[i], t.RemoteRank, off+k, g[k], w[k])
								}
							}
						}
					}
				}
			}
		}
	}
	return bad, err
}
