//go:build linux

package shm

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvflow/kvflow/hw/npu"
)

// MakeClaim is the claim a prefill worker publishes for its cache file at
// cachePath (npu.CreateShm's) guarded by t.
func MakeClaim(cachePath string, t *Table) (Claim, error) {
	id, err := HostID()
	if err != nil {
		return Claim{}, fmt.Errorf("shm: claim: host id: %w", err)
	}
	f, err := os.Open(cachePath)
	if err != nil {
		return Claim{}, fmt.Errorf("shm: claim: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return Claim{}, fmt.Errorf("shm: claim: %w", err)
	}
	head := make([]byte, npu.HeaderSize)
	if _, err := f.ReadAt(head, 0); err != nil {
		return Claim{}, fmt.Errorf("shm: claim: read the cache file header: %w", err)
	}
	if _, err := npu.ParseFileHeader(cachePath, head, st.Size()); err != nil {
		return Claim{}, fmt.Errorf("shm: claim: %w", err)
	}
	sys := st.Sys().(*syscall.Stat_t)
	c := Claim{
		HostID: id, Path: cachePath, Dev: uint64(sys.Dev), Ino: uint64(sys.Ino), Size: uint64(st.Size()),
		Header: head, Grants: t.Path(), Epoch: t.Epoch(),
	}
	c.GrantsDev, c.GrantsIno = t.Identity()
	return c, nil
}

// Options are what Open needs besides the claim.
type Options struct {
	// HostID is this host's id; "" reads it (HostID).
	HostID string
	// BaseAddrs is the peer's kv_caches_base_addr, from the metadata that
	// carried the claim: how its addresses map onto the file.
	BaseAddrs []uint64
	// Local is the memory reads land in: this process's cache tensors
	// (npu.Device.Bytes). A local address outside them is refused.
	Local [][]byte
}

// Op is one read: Len bytes at the peer's address Remote into this
// process's address Local.
type Op struct{ Local, Remote, Len uint64 }

// Stride, when Row > 0, lays each op's bytes out in rows of Row bytes,
// Pitch apart from Local on (the fused head transpose). With Gather the
// rows are Pitch apart on the peer's side instead, from Remote on, and
// land back to back from Local (a decode TP above the prefill's: one head
// slice of every token row): byte i of an op comes from Remote +
// (i/Row)*Pitch + i%Row.
type Stride struct {
	Row, Pitch uint64
	Gather     bool
}

// Reader maps a same-host peer's cache file read-only and serves batch
// reads from it as memory copies, each checked against the peer's grant
// table. Its methods are safe for concurrent use; Close waits for running
// reads.
type Reader struct {
	layout  npu.Layout
	data    []byte // the caches, mapped read-only
	cache   []byte // the whole cache mapping
	table   []byte // the grant table, mapped read-only
	nblocks int
	slots   int // request slots of the table
	epoch   uint64
	pidfd   int
	uid     uint32 // the cache file's owner, which the table's must be
	remote  []span // the peer's caches by address
	local   []span // this process's memory by address

	mu     sync.RWMutex
	closed bool

	// testAfterCopy, when set (tests), runs after each op's copy, before
	// the checks that follow it.
	testAfterCopy func()
}

// span is a range of addresses: a peer's cache k (remote) or a local
// slice (local).
type span struct {
	addr, n uint64
	k       int    // remote: cache index
	off     int64  // remote: offset of the cache in data
	bl      uint64 // remote: block length
	mem     []byte // local
}

// Open checks claim c against this host and the files it names and maps
// the cache file read-only. Errors wrap ErrNotSameHost (another host),
// ErrMismatch (the file at the path, or the grant table, is not the one
// claimed: nothing is mapped) or ErrOwnerGone (the claim's run of the
// owner is over); the caller falls back to the network.
func Open(c Claim, opts Options) (*Reader, error) {
	id := opts.HostID
	if id == "" {
		var err error
		if id, err = HostID(); err != nil {
			return nil, fmt.Errorf("%w: this host's id: %w", ErrNotSameHost, err)
		}
	}
	if c.HostID == "" || c.HostID != id {
		return nil, fmt.Errorf("%w: claim says host %q, this is %q", ErrNotSameHost, c.HostID, id)
	}
	// The grant table is bound to the cache file: next to it, with its
	// owner. Otherwise a hostile prefill could name another worker's
	// cache (its identity and header are no secret) with a table of its
	// own, and this process, which may read that file where the prefill
	// cannot, would serve that cache's bytes as the prefill's.
	if c.Grants != c.Path+TableSuffix {
		return nil, fmt.Errorf("%w: grant table %q is not the cache file's (%q)", ErrMismatch, c.Grants, c.Path+TableSuffix)
	}
	cf, st, err := openChecked(c.Path, c.Dev, c.Ino)
	if err != nil {
		return nil, err
	}
	defer cf.Close()
	if uint64(st.Size()) != c.Size {
		return nil, fmt.Errorf("%w: %s is %d bytes, claim says %d", ErrMismatch, c.Path, st.Size(), c.Size)
	}
	head := make([]byte, npu.HeaderSize)
	if _, err := cf.ReadAt(head, 0); err != nil {
		return nil, fmt.Errorf("%w: %s: read its header: %w", ErrMismatch, c.Path, err)
	}
	if !bytes.Equal(head, c.Header) {
		return nil, fmt.Errorf("%w: %s: header differs from the claim's", ErrMismatch, c.Path)
	}
	fh, err := npu.ParseFileHeader(c.Path, head, st.Size())
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrMismatch, err)
	}
	if lim := HostMemory(); uint64(fh.FileSize) > lim {
		// A cache lives in memory: a larger (sparse) file would only
		// spend this process's address space, which the next mapping
		// or heap growth then lacks.
		return nil, fmt.Errorf("%w: %s is %d bytes, more than this host's memory and swap (%d)", ErrMismatch, c.Path, fh.FileSize, lim)
	}
	l := fh.Layout
	if len(opts.BaseAddrs) != l.NumCaches() {
		return nil, fmt.Errorf("%w: %d base addresses for a file of %d caches", ErrMismatch, len(opts.BaseAddrs), l.NumCaches())
	}
	r := &Reader{layout: l, nblocks: l.Shape().NumBlocks, epoch: c.Epoch, pidfd: -1, uid: st.Sys().(*syscall.Stat_t).Uid}
	if err := r.openTableSafe(c); err != nil {
		r.release()
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			r.release()
		}
	}()
	for k, a := range opts.BaseAddrs {
		layer, part := l.CacheOf(k)
		n := uint64(l.CacheLen(part))
		if a+n < a {
			return nil, fmt.Errorf("%w: base address %#x of cache %d wraps", ErrMismatch, a, k)
		}
		r.remote = append(r.remote, span{addr: a, n: n, k: k, off: l.Offset(layer, part), bl: uint64(l.BlockLen(part))})
	}
	if err := sortSpans(r.remote); err != nil {
		return nil, fmt.Errorf("%w: peer's base addresses: %w", ErrMismatch, err)
	}
	for _, b := range opts.Local {
		if len(b) > 0 {
			r.local = append(r.local, span{addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))), n: uint64(len(b)), mem: b})
		}
	}
	if err := sortSpans(r.local); err != nil {
		return nil, fmt.Errorf("shm: local memory: %w", err)
	}
	mem, err := syscall.Mmap(int(cf.Fd()), 0, int(fh.FileSize), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("shm: mmap %s: %w", c.Path, err)
	}
	r.cache = mem
	r.data = mem[fh.DataOffset : fh.DataOffset+l.Size() : fh.DataOffset+l.Size()]
	ok = true
	return r, nil
}

// HostMemory is this host's memory and swap in bytes (the most a
// same-host cache file can hold), or the largest uint64 when unknown.
func HostMemory() uint64 {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil || si.Unit == 0 {
		return ^uint64(0)
	}
	return (uint64(si.Totalram) + uint64(si.Totalswap)) * uint64(si.Unit)
}

// openChecked opens path read-only, refusing a symbolic link, anything
// but a regular file, and a file other than (dev, ino). The name is
// checked with lstat before it is opened, and opened non-blocking, so a
// claim naming a FIFO or a device never blocks the caller or opens the
// device; the open file is checked again.
func openChecked(path string, dev, ino uint64) (*os.File, os.FileInfo, error) {
	lst, err := os.Lstat(path)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %s: %w", ErrMismatch, path, err)
	}
	if lsys, _ := lst.Sys().(*syscall.Stat_t); !lst.Mode().IsRegular() || lsys == nil || uint64(lsys.Dev) != dev || uint64(lsys.Ino) != ino {
		return nil, nil, fmt.Errorf("%w: %s is not the claimed regular file (device/inode %d/%d)", ErrMismatch, path, dev, ino)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: open %s: %w", ErrMismatch, path, err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("%w: %s: %w", ErrMismatch, path, err)
	}
	sys, _ := st.Sys().(*syscall.Stat_t)
	switch {
	case !st.Mode().IsRegular():
		err = fmt.Errorf("%w: %s is not a regular file", ErrMismatch, path)
	case sys == nil || uint64(sys.Dev) != dev || uint64(sys.Ino) != ino:
		err = fmt.Errorf("%w: %s is another file (device/inode differ from the claim's %d/%d)", ErrMismatch, path, dev, ino)
	}
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	return f, st, nil
}

// openTableSafe is openTable with a fault in the mapping (the table
// truncated under it by a restarting owner of another size) an error.
func (r *Reader) openTableSafe(c Claim) (err error) {
	old := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(old)
		if p := recover(); p != nil {
			if _, ok := p.(interface{ Addr() uintptr }); ok {
				err = fmt.Errorf("%w: grant table %s faulted while opening (truncated?)", ErrOwnerGone, c.Grants)
				return
			}
			panic(p)
		}
	}()
	return r.openTable(c)
}

// openTable maps the claim's grant table read-only, checks it, and opens
// a pidfd on its owner, checked to be the process that wrote the table.
func (r *Reader) openTable(c Claim) error {
	f, st, err := openChecked(c.Grants, c.GrantsDev, c.GrantsIno)
	if err != nil {
		return err
	}
	defer f.Close()
	if uid := st.Sys().(*syscall.Stat_t).Uid; uid != r.uid {
		return fmt.Errorf("%w: grant table %s is owned by uid %d, the cache file by uid %d", ErrMismatch, c.Grants, uid, r.uid)
	}
	// Its header is read before anything is mapped.
	head := make([]byte, tableHeader)
	if _, err := f.ReadAt(head, 0); err != nil {
		return fmt.Errorf("%w: grant table %s: %w", ErrMismatch, c.Grants, err)
	}
	le := binary.LittleEndian
	if string(head[:8]) != tableMagic || le.Uint32(head[8:]) != tableVersion || le.Uint64(head[offNumBlocks:]) != uint64(r.nblocks) {
		return fmt.Errorf("%w: %s is not a grant table for %d blocks", ErrMismatch, c.Grants, r.nblocks)
	}
	slots := le.Uint64(head[offSlots:])
	if slots != uint64(numSlots(r.nblocks)) {
		return fmt.Errorf("%w: grant table %s has %d request slots, want %d", ErrMismatch, c.Grants, slots, numSlots(r.nblocks))
	}
	r.slots = int(slots)
	size := tableSize(r.nblocks, r.slots)
	if lim := HostMemory(); uint64(size) > lim {
		return fmt.Errorf("%w: grant table %s would be %d bytes, more than this host's memory and swap (%d)", ErrMismatch, c.Grants, size, lim)
	}
	if st.Size() != size {
		return fmt.Errorf("%w: grant table %s is %d bytes, want %d", ErrMismatch, c.Grants, st.Size(), size)
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, int(size), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("shm: mmap grant table %s: %w", c.Grants, err)
	}
	r.table = mem
	if e := word(mem, offEpoch).Load(); c.Epoch == 0 || e != c.Epoch {
		return fmt.Errorf("%w: grant table epoch %#x, claim's %#x", ErrOwnerGone, e, c.Epoch)
	}
	pid, start := int(word(mem, offPID).Load()), word(mem, offStart).Load()
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return fmt.Errorf("%w: owner pid %d: %w", ErrOwnerGone, pid, err)
	}
	r.pidfd = fd
	// The pidfd is taken first: if pid now names the table's writer, so
	// does the pidfd, for good.
	if got, err := procStart(pid); err != nil || got != start {
		return fmt.Errorf("%w: pid %d is not the process that wrote the grant table", ErrOwnerGone, pid)
	}
	if e := word(mem, offEpoch).Load(); e != c.Epoch {
		return fmt.Errorf("%w: grant table epoch changed while opening", ErrOwnerGone)
	}
	return nil
}

func sortSpans(s []span) error {
	slices.SortFunc(s, func(a, b span) int {
		switch {
		case a.addr < b.addr:
			return -1
		case a.addr > b.addr:
			return 1
		}
		return 0
	})
	for i := 1; i < len(s); i++ {
		if s[i-1].addr+s[i-1].n > s[i].addr {
			return fmt.Errorf("ranges [%#x,+%d) and [%#x,+%d) overlap", s[i-1].addr, s[i-1].n, s[i].addr, s[i].n)
		}
	}
	return nil
}

// find is the span holding [addr, addr+n), or nil.
func find(s []span, addr, n uint64) *span {
	i, _ := slices.BinarySearchFunc(s, addr, func(sp span, a uint64) int {
		switch {
		case sp.addr+sp.n <= a:
			return -1
		case sp.addr > a:
			return 1
		}
		return 0
	})
	if i >= len(s) || addr < s[i].addr || addr+n < addr || addr+n > s[i].addr+s[i].n {
		return nil
	}
	return &s[i]
}

// Layout is the peer's cache layout, from its file's header.
func (r *Reader) Layout() npu.Layout { return r.layout }

// snap is one grant word as a read saw it before its copy.
type snap struct {
	off int // offset in the table
	w   uint64
}

// plan is one resolved op.
type plan struct {
	src, dst      []byte
	rows          uint64 // 0: one copy; else rows of rowLen bytes, pitch apart in dst (src with gather)
	rowLen, pitch uint64
	gather        bool
	b0, b1        int // blocks covered
}

// copy copies the op's bytes: one memmove, or row by row into the strided
// destination (the head transpose fused into the copy).
func (p *plan) copy() {
	if p.rows == 0 {
		copy(p.dst, p.src)
		return
	}
	if p.gather {
		for i := range p.rows {
			copy(p.dst[i*p.rowLen:(i+1)*p.rowLen], p.src[i*p.pitch:i*p.pitch+p.rowLen])
		}
		return
	}
	for i := range p.rows {
		copy(p.dst[i*p.pitch:i*p.pitch+p.rowLen], p.src[i*p.rowLen:(i+1)*p.rowLen])
	}
}

// Read runs ops as one batch: every op is resolved and checked first
// (nothing is copied if any is out of range), then each is copied if
// its blocks are granted, and the batch fails unless, after the last
// copy, the owner is alive in the same run and no block read changed its
// grant generation. With req (the request's id, as the prefill's send
// named it) the request itself must have been granted by GrantRequest
// before the first copy and still be, with the same generation, after the
// last (or, without a record of it, every block granted by GrantAll): a
// block freed and re-granted to another request is never read as req's.
// With s.Row > 0 each op's bytes land in rows of s.Row bytes, s.Pitch
// apart (or, with s.Gather, come from such rows). A failed batch may have
// written any of its local ranges.
func (r *Reader) Read(ctx context.Context, req string, ops []Op, s Stride) (err error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.closed {
		return ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("shm: read not started: %w", err)
	}
	if s.Row > 0 && s.Pitch < s.Row {
		return fmt.Errorf("%w: stride pitch %d under row %d", ErrRange, s.Pitch, s.Row)
	}
	plans := make([]plan, len(ops))
	for i, op := range ops {
		if plans[i], err = r.resolve(op, s); err != nil {
			return fmt.Errorf("shm: op %d: %w", i, err)
		}
	}
	snaps := make([]snap, 0, 2*len(ops)+2)
	all := word(r.table, offAll)
	old := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(old)
		if p := recover(); p != nil {
			if f, ok := p.(interface{ Addr() uintptr }); ok {
				err = fmt.Errorf("%w: at %#x", ErrFault, f.Addr())
				return
			}
			panic(p)
		}
	}()
	if e := word(r.table, offEpoch).Load(); e != r.epoch {
		return fmt.Errorf("%w: epoch %#x, opened at %#x", ErrOwnerGone, e, r.epoch)
	}
	allW := all.Load()
	if req != "" {
		key := requestKey(req)
		off, ok, err := r.findSlot(ctx, key)
		switch {
		case err != nil:
			return fmt.Errorf("shm: read of request %q not started: %w", req, err)
		case ok:
			w := word(r.table, off+8).Load()
			if uint32(w) == 0 {
				return fmt.Errorf("%w: request %q freed", ErrNotGranted, req)
			}
			snaps = append(snaps, snap{off, key}, snap{off + 8, w})
		case uint32(allW) == 0:
			return fmt.Errorf("%w: request %q not held", ErrNotGranted, req)
		}
	}
	nreq := len(snaps)
	for i := range plans {
		if i > 0 && ctx.Err() != nil {
			return fmt.Errorf("shm: read canceled after %d of %d ops: %w", i, len(plans), ctx.Err())
		}
		p := &plans[i]
		if e := word(r.table, offEpoch).Load(); e != r.epoch {
			return fmt.Errorf("%w: epoch %#x, opened at %#x", ErrOwnerGone, e, r.epoch)
		}
		for b := p.b0; b <= p.b1; b++ {
			w := word(r.table, blockOff(b)).Load()
			if uint32(w) == 0 && uint32(allW) == 0 {
				return fmt.Errorf("%w: block %d", ErrNotGranted, b)
			}
			snaps = append(snaps, snap{blockOff(b), w})
		}
		p.copy()
		if r.testAfterCopy != nil {
			r.testAfterCopy()
		}
	}
	fence()
	if nreq > 0 {
		if k := word(r.table, snaps[0].off).Load(); k != snaps[0].w {
			return fmt.Errorf("%w: request %q freed during or before the read (its slot reused)", ErrNotGranted, req)
		}
		if w := word(r.table, snaps[1].off).Load(); w>>32 != snaps[1].w>>32 {
			return fmt.Errorf("%w: request %q freed during the read", ErrNotGranted, req)
		}
	}
	for _, sn := range snaps[nreq:] {
		if w := word(r.table, sn.off).Load(); w>>32 != sn.w>>32 {
			return fmt.Errorf("%w: block %d freed during or before the read (generation %d → %d)", ErrNotGranted, (sn.off-tableHeader)/8, sn.w>>32, w>>32)
		}
	}
	if w := all.Load(); w>>32 != allW>>32 {
		return fmt.Errorf("%w: grant of every block ended during the read", ErrNotGranted)
	}
	if e := word(r.table, offEpoch).Load(); e != r.epoch {
		return fmt.Errorf("%w: epoch %#x, opened at %#x", ErrOwnerGone, e, r.epoch)
	}
	if !r.ownerAlive() {
		return fmt.Errorf("%w: owner exited", ErrOwnerGone)
	}
	return nil
}

// findSlot is the offset of key's request slot, probing as Table.slot.
// The table is the peer's to write: a chain as long as the table (every
// key set) is probed with ctx checked every 4096 slots.
func (r *Reader) findSlot(ctx context.Context, key uint64) (int, bool, error) {
	mask := r.slots - 1
	for n, i := 0, int(key)&mask; n < r.slots; n, i = n+1, (i+1)&mask {
		if n&4095 == 4095 && ctx.Err() != nil {
			return 0, false, ctx.Err()
		}
		off := slotOff(r.nblocks, i)
		switch word(r.table, off).Load() {
		case key:
			return off, true, nil
		case 0:
			return 0, false, nil
		}
	}
	return 0, false, nil
}

// resolve checks op against the peer's caches and the local memory.
func (r *Reader) resolve(op Op, s Stride) (plan, error) {
	if op.Len == 0 {
		return plan{}, fmt.Errorf("%w: empty op", ErrRange)
	}
	p := plan{rowLen: s.Row, pitch: s.Pitch, gather: s.Gather && s.Row > 0}
	rn, ln := op.Len, op.Len // spans on each side
	if s.Row > 0 {
		if op.Len%s.Row != 0 {
			return plan{}, fmt.Errorf("%w: %d bytes are not rows of %d", ErrRange, op.Len, s.Row)
		}
		p.rows = op.Len / s.Row
		if p.rows-1 > (^uint64(0)-s.Row)/s.Pitch {
			return plan{}, fmt.Errorf("%w: %d rows %d bytes apart overflow", ErrRange, p.rows, s.Pitch)
		}
		if p.gather {
			rn = (p.rows-1)*s.Pitch + s.Row
		} else {
			ln = (p.rows-1)*s.Pitch + s.Row
		}
	}
	rs := find(r.remote, op.Remote, rn)
	if rs == nil {
		return plan{}, fmt.Errorf("%w: remote [%#x, +%d) is not inside one of the peer's caches", ErrRange, op.Remote, rn)
	}
	off := op.Remote - rs.addr
	p.b0, p.b1 = int(off/rs.bl), int((off+rn-1)/rs.bl)
	start := uint64(rs.off) + off
	p.src = r.data[start : start+rn : start+rn]
	ls := find(r.local, op.Local, ln)
	if ls == nil {
		return plan{}, fmt.Errorf("%w: local [%#x, +%d) is not inside this process's cache memory", ErrRange, op.Local, ln)
	}
	lo := op.Local - ls.addr
	p.dst = ls.mem[lo : lo+ln : lo+ln]
	return p, nil
}

// fenceWord takes fence's atomic add.
var fenceWord atomic.Uint64

// fence orders the copies' loads before the grant checks' loads. On
// amd64 loads are never reordered with older loads and the atomic loads
// alone suffice; on arm64 an atomic load is only an acquire, which does
// not keep older plain loads before it, and an atomic read-modify-write
// (acquire and release) does.
func fence() { fenceWord.Add(1) }

// ownerAlive polls the owner's pidfd: readable once the process exited.
func (r *Reader) ownerAlive() bool {
	fds := []unix.PollFd{{Fd: int32(r.pidfd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return err == nil && n == 0
	}
}

// Close unmaps the file and the table (waiting for running reads). It is
// idempotent.
func (r *Reader) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	return r.release()
}

func (r *Reader) release() error {
	var errs []error
	if r.cache != nil {
		errs = append(errs, syscall.Munmap(r.cache))
	}
	if r.table != nil {
		errs = append(errs, syscall.Munmap(r.table))
	}
	if r.pidfd >= 0 {
		errs = append(errs, unix.Close(r.pidfd))
	}
	r.cache, r.data, r.table, r.pidfd = nil, nil, nil, -1
	return errors.Join(errs...)
}
