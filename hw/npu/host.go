package npu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"unsafe"
)

// HostOptions tunes a Host.
type HostOptions struct {
	// NoHugePages skips the huge-page attempts (MAP_HUGETLB, then
	// MADV_HUGEPAGE). They are tried by default and fall back silently.
	NoHugePages bool
	// NoLock leaves the caches pageable. By default they are locked in
	// memory as they are first touched (mlock2 MLOCK_ONFAULT), as
	// registering memory with an RDMA engine pins it: a page once present
	// stays, and reclaim (or a DAMON pageout scheme) never unmaps it, so
	// no transfer takes a page fault per 4 KiB again. A lock refused by
	// RLIMIT_MEMLOCK (an unprivileged process) leaves the memory pageable;
	// Locked reports it.
	NoLock bool
	// StitchWorkers bounds the goroutines of one Stitch; 0 means GOMAXPROCS.
	StitchWorkers int
	// RemoveOnClose (CreateShm only) removes the file at Close. A Host never
	// removes a file it attached to with OpenShm.
	RemoveOnClose bool
	// Mode (CreateShm only) is the file's permission; 0 means 0600. Give the
	// serving engine's user access if it runs as another user.
	Mode os.FileMode
	// Expect (OpenShm only), if set, is the shape the file must have.
	Expect *Shape
}

// Host is the host-memory backend of Device: the caches live in one mmap'd
// allocation, anonymous (NewHost) or a shared-memory file that the serving
// engine maps too (CreateShm, OpenShm). Its methods are safe for concurrent
// use; Close waits for running Stitch calls.
type Host struct {
	layout  Layout
	mapping []byte // the whole mmap'd range
	data    []byte // the caches: mapping[dataOffset:]
	base    uint64 // address of data[0]
	path    string
	remove  bool // remove path at Close
	hugeTLB bool
	locked  bool
	lockErr error // why the lock was refused, if it was
	opts    StitchOptions

	ownerLock *os.File // CreateShm: the file's owner lock (flock), held until Close
	reclaimed string   // what CreateShm did with a dead owner's file ("" if none)

	mu     sync.RWMutex // Stitch holds it shared, Close exclusive
	closed bool
}

var _ Device = (*Host)(nil)

func newHost(l Layout, mapping []byte, dataOffset int, path string, remove, huge bool, opts HostOptions) *Host {
	data := mapping[dataOffset : dataOffset+int(l.Size()) : dataOffset+int(l.Size())]
	h := &Host{
		layout: l, mapping: mapping, data: data, path: path, remove: remove, hugeTLB: huge,
		opts: StitchOptions{Workers: opts.StitchWorkers, Scratch: &sync.Pool{}},
	}
	if len(data) > 0 {
		h.base = uint64(uintptr(unsafe.Pointer(&data[0])))
		if !opts.NoLock {
			h.lockErr = lockMemory(data)
			h.locked = h.lockErr == nil
		}
	}
	return h
}

// Layout describes the caches.
func (h *Host) Layout() Layout { return h.layout }

// BaseAddrs is kv_caches_base_addr, seed order; nil after Close.
func (h *Host) BaseAddrs() []uint64 {
	if _, base := h.view(); base != 0 {
		return h.layout.BaseAddrs(base)
	}
	return nil
}

// Regions are the caches to register, seed order; nil after Close.
func (h *Host) Regions() []Region {
	if _, base := h.view(); base != 0 {
		return h.layout.Regions(base)
	}
	return nil
}

// Bytes is cache (layer, part); nil if out of range or closed.
func (h *Host) Bytes(layer, part int) []byte {
	data, _ := h.view()
	if data == nil || layer < 0 || layer >= h.layout.shape.NumLayers || part < 0 || part >= h.layout.NumParts() {
		return nil
	}
	off := h.layout.Offset(layer, part)
	end := off + h.layout.CacheLen(part)
	return data[off:end:end]
}

// Block is block b of cache (layer, part); nil if out of range or closed.
func (h *Host) Block(layer, part, b int) []byte {
	c := h.Bytes(layer, part)
	if c == nil || b < 0 || b >= h.layout.shape.NumBlocks {
		return nil
	}
	bl := h.layout.BlockLen(part)
	return c[b*bl : (b+1)*bl : (b+1)*bl]
}

// Data is the whole cache memory (Layout.Size() bytes, caches at
// Layout.Offset); nil after Close.
func (h *Host) Data() []byte {
	data, _ := h.view()
	return data
}

// Path is the shared-memory file, "" for anonymous memory.
func (h *Host) Path() string { return h.path }

// Reclaimed says what CreateShm did with a file a dead owner had left at
// its path: "" when it created the file afresh (and for NewHost, OpenShm).
func (h *Host) Reclaimed() string { return h.reclaimed }

// HugeTLB reports whether the memory came from MAP_HUGETLB pages
// (transparent huge pages are advice and not reported).
func (h *Host) HugeTLB() bool { return h.hugeTLB }

// Locked reports whether the caches are locked in memory (HostOptions.
// NoLock) and, if a lock was asked for and refused, why.
func (h *Host) Locked() (bool, error) { return h.locked, h.lockErr }

// ValidateStitch checks a Stitch request against the layout without
// touching memory (Layout.ValidateStitch).
func (h *Host) ValidateStitch(blockIDs []int, p int) error {
	return h.layout.ValidateStitch(blockIDs, p)
}

// Stitch runs the stitch kernel (StitchMemory) on this memory.
func (h *Host) Stitch(ctx context.Context, blockIDs []int, p int) error {
	h.mu.RLock()
	defer h.mu.RUnlock()
	if h.closed {
		return ErrClosed
	}
	return StitchMemory(ctx, h.layout, h.data, blockIDs, p, h.opts)
}

// Close unmaps the memory (waiting for running Stitch calls) and, for a
// file created with RemoveOnClose, removes the file. It is idempotent.
func (h *Host) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil
	}
	h.closed = true
	var errs []error
	if err := munmap(h.mapping); err != nil {
		errs = append(errs, fmt.Errorf("npu: munmap: %w", err))
	}
	h.mapping, h.data, h.base = nil, nil, 0
	if h.remove {
		// Removed while still locked: no other worker can have taken
		// the name over yet.
		if err := os.Remove(h.path); err != nil {
			errs = append(errs, fmt.Errorf("npu: remove cache file: %w", err))
		}
	}
	if h.ownerLock != nil {
		h.ownerLock.Close() // drops the owner lock
		h.ownerLock = nil
	}
	return errors.Join(errs...)
}

// view is the data and its address, or nil and 0 after Close.
func (h *Host) view() ([]byte, uint64) {
	h.mu.RLock()
	defer h.mu.RUnlock()
	return h.data, h.base
}
