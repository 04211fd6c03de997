package npu

import (
	"context"
	"errors"
	"fmt"
)

// Region is one registrable span of cache memory: a cache tensor, as the
// seed passes it to register_buffer (ptr, length), with a name for logs and
// metrics. Addr is a virtual address in the owning process.
type Region struct {
	Addr uint64
	Len  uint64
	Name string
}

// Registrar is what a transfer engine offers to have memory registered
// (hw/mooncake's engines satisfy it; so can a test fake). npu does not import
// any engine.
type Registrar interface {
	Register(addr, length uint64, name string) error
}

// RegistrarFunc adapts a function to Registrar.
type RegistrarFunc func(addr, length uint64, name string) error

// Register calls f.
func (f RegistrarFunc) Register(addr, length uint64, name string) error { return f(addr, length, name) }

// RegisterAll registers every region of d with r, in seed order, and stops
// at the first failure (regions registered before it stay registered: the
// engine's unregister, if any, is the caller's to call).
func RegisterAll(r Registrar, d Device) error {
	for _, g := range d.Regions() {
		if err := r.Register(g.Addr, g.Len, g.Name); err != nil {
			return fmt.Errorf("npu: register %s [%#x, +%d): %w", g.Name, g.Addr, g.Len, err)
		}
	}
	return nil
}

// Device is a worker's KV-cache memory as the stages use it. The host
// backend (Host) is the embedded default; an accelerator backend (Ascend
// ACL/CANN, CUDA) implements the same methods over device memory. See the
// package documentation for the contract.
type Device interface {
	// Layout describes the caches; it never changes.
	Layout() Layout
	// BaseAddrs is kv_caches_base_addr in the seed's order (layer-major,
	// part-minor): what the handshake serves and the read stage offsets.
	BaseAddrs() []uint64
	// Regions are the spans to register with the transfer engine, one per
	// cache, in the same order as BaseAddrs.
	Regions() []Region
	// Bytes is the memory of cache (layer, part) as a slice, when the
	// backend's memory is host-addressable; nil otherwise, out of range, or
	// after Close.
	Bytes(layer, part int) []byte
	// Block is block b of cache (layer, part) as a slice: Bytes' rule
	// (host-addressable memory only; nil otherwise or out of range).
	Block(layer, part, b int) []byte
	// Stitch reorders, for each listed block of every layer and part, the
	// P = tp_num_need_pulls head slices pulled side by side
	// ([p][block_size][row/p]) into token-major rows ([block_size][row]): the
	// result of the seed's _cat_kv_cache. It validates everything before it
	// touches memory. See the package documentation for the errors.
	Stitch(ctx context.Context, blockIDs []int, p int) error
	// Close releases the memory. The slices and addresses handed out become
	// invalid; later calls fail with ErrClosed (or return nil/empty).
	Close() error
}

// Errors of every backend, for errors.Is.
var (
	// ErrClosed: the device was closed.
	ErrClosed = errors.New("npu: device closed")
	// ErrInvalidStitch: a Stitch request that does not fit the layout
	// (P not dividing the rows, P > 1 on MLA/Sparse, block ids out of range
	// or duplicated).
	ErrInvalidStitch = errors.New("npu: invalid stitch")
	// ErrInUse: CreateShm found its path owned by a live process.
	ErrInUse = errors.New("npu: cache file in use by a live process")
)

// BlockRanges is where the listed blocks of every cache of d lie: one
// Region per (cache, block), caches in BaseAddrs order, blocks in the
// order given (what a transfer engine's read grants cover for a request).
func BlockRanges(d Device, blocks []int) []Region {
	l := d.Layout()
	base := d.BaseAddrs()
	out := make([]Region, 0, len(base)*len(blocks))
	for k, b0 := range base {
		_, part := l.CacheOf(k)
		bl := uint64(l.BlockLen(part))
		for _, b := range blocks {
			out = append(out, Region{Addr: b0 + uint64(b)*bl, Len: bl})
		}
	}
	return out
}
