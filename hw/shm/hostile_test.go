//go:build linux

package shm

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"os"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"

	"github.com/kvflow/kvflow/hw/npu"
)

// hostileFile writes a cache file whose header is a good one edited by
// edit (its checksum made right again), size bytes long, and returns a
// claim that describes it exactly as a hostile prefill would.
func hostileFile(t *testing.T, p *prefill, name string, size int64, edit func(h []byte)) Claim {
	t.Helper()
	h := bytes.Clone(p.claim.Header)
	edit(h)
	n := binary.LittleEndian.Uint32(h[12:])
	binary.LittleEndian.PutUint32(h[n:], crc32.Checksum(h[:n], crc32.MakeTable(crc32.Castagnoli)))
	path := filepath.Join(filepath.Dir(p.claim.Path), name)
	must(t, os.WriteFile(path, h, 0o600))
	must(t, os.Truncate(path, size))
	st, err := os.Stat(path)
	must(t, err)
	sys := st.Sys().(*syscall.Stat_t)
	c := p.claim
	c.Path, c.Dev, c.Ino, c.Size, c.Header = path, uint64(sys.Dev), uint64(sys.Ino), uint64(size), h
	return c
}

// TestOpenRefusesHostileHeader: a claim is checked against its file, but
// a hostile prefill writes both, with a checksum that matches. A header
// whose data offset wraps the file size around 2^64, or whose shape has
// billions of layers in a small file, is refused (ErrMismatch) without
// a panic and without sizing anything by it.
func TestOpenRefusesHostileHeader(t *testing.T) {
	dir := t.TempDir()
	p := newPrefill(t, dir, testShape, 1)
	d := decodeMem(t, testShape)
	le := binary.LittleEndian
	dataSize := le.Uint64(p.claim.Header[112:])
	for _, tc := range []struct {
		name string
		size int64
		edit func(h []byte)
	}{
		// data offset + data size wraps to 8192: a file of 8 KiB "holds"
		// data at offset 2^64 - dataSize + 8192.
		{"data offset wraps", 8192, func(h []byte) {
			off := -dataSize + 8192
			le.PutUint64(h[104:], off)
			le.PutUint64(h[120:], off+dataSize)
		}},
		{"data offset past int64", 1 << 20, func(h []byte) {
			le.PutUint64(h[104:], 1<<63)
			le.PutUint64(h[120:], 1<<63+dataSize)
		}},
		// 2^22 layers: 2^23 cache offsets (64 MiB) for a 1 MiB file.
		{"millions of layers", 1 << 20, func(h []byte) {
			le.PutUint64(h[32:], 1<<22)
			le.PutUint64(h[112:], (1<<22)*dataSize/uint64(testShape.NumLayers))
			le.PutUint64(h[120:], le.Uint64(h[104:])+le.Uint64(h[112:]))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := hostileFile(t, p, tc.name, tc.size, tc.edit)
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			r, err := Open(c, Options{BaseAddrs: p.host.BaseAddrs(), Local: caches(d)})
			runtime.ReadMemStats(&after)
			if r != nil {
				r.Close()
			}
			if !errors.Is(err, ErrMismatch) || r != nil {
				t.Fatalf("Open: %v (reader %v), want %v", err, r != nil, ErrMismatch)
			}
			if n := after.TotalAlloc - before.TotalAlloc; n > 8<<20 {
				t.Fatalf("Open allocated %d bytes for a refused claim", n)
			}
		})
	}
}

// TestReadStrideOverflow: a stride whose span wraps 2^64 (rows x pitch) is
// refused as out of range, not resolved to a short span and then sliced
// past it (a panic).
func TestReadStrideOverflow(t *testing.T) {
	dir := t.TempDir()
	p := newPrefill(t, dir, testShape, 1)
	d := decodeMem(t, testShape)
	r := open(t, p, d)
	must(t, p.table.GrantAll())
	op := blockOps(p.host, d, []int{0}, []int{0})[0]
	op.Len = 3 // (3-1) x 2^63 wraps to 0: a span of one byte
	for _, s := range []Stride{{Row: 1, Pitch: 1 << 63}, {Row: 1, Pitch: 1 << 63, Gather: true}} {
		if err := r.Read(t.Context(), "", []Op{op}, s); !errors.Is(err, ErrRange) {
			t.Errorf("stride %+v: %v, want %v", s, err, ErrRange)
		}
	}
}

// TestOpenRefusesForeignCache: a hostile prefill on this host names
// another worker's cache file (whose identity and header it can learn or
// rebuild without reading the file) with a grant table of its own. The
// decode could read that file where the prefill cannot, and would serve
// another tenant's KV cache as the hostile prefill's. The table must be
// the cache file's own ("<cache>.grants") and have the cache file's owner.
func TestOpenRefusesForeignCache(t *testing.T) {
	dir := t.TempDir()
	victim := newPrefill(t, dir, testShape, 1)
	hostile := newPrefill(t, dir, testShape, 2)
	d := decodeMem(t, testShape)
	must(t, hostile.table.GrantAll())

	t.Run("own table elsewhere", func(t *testing.T) {
		c := victim.claim
		c.Grants, c.GrantsDev, c.GrantsIno, c.Epoch = hostile.claim.Grants, hostile.claim.GrantsDev, hostile.claim.GrantsIno, hostile.claim.Epoch
		r, err := Open(c, Options{BaseAddrs: victim.host.BaseAddrs(), Local: caches(d)})
		if r != nil {
			r.Close()
		}
		if !errors.Is(err, ErrMismatch) {
			t.Fatalf("Open of another's cache with the hostile table: %v, want %v", err, ErrMismatch)
		}
	})

	t.Run("table next to it, another owner", func(t *testing.T) {
		if os.Geteuid() != 0 {
			t.Skip("needs root to give the table another owner")
		}
		// A cache file with no table yet (a worker not offering shm): the
		// hostile prefill creates "<cache>.grants" (a shared directory
		// such as /dev/shm lets it), owned by itself.
		l, err := npu.NewLayout(testShape)
		must(t, err)
		path := filepath.Join(dir, "lonely")
		h, err := npu.CreateShm(path, l, npu.HostOptions{NoLock: true, NoHugePages: true})
		must(t, err)
		defer h.Close()
		tb, err := CreateTable(path+".grants", testShape.NumBlocks, 0)
		must(t, err)
		defer tb.Close(true)
		must(t, tb.GrantAll())
		must(t, os.Chown(path+".grants", 4242, 4242))
		c, err := MakeClaim(path, tb)
		must(t, err)
		r, err := Open(c, Options{BaseAddrs: h.BaseAddrs(), Local: caches(d)})
		if r != nil {
			r.Close()
		}
		if !errors.Is(err, ErrMismatch) {
			t.Fatalf("Open with a table of another owner: %v, want %v", err, ErrMismatch)
		}
	})
}

// TestTruncatedTableFaults: a grant table truncated under the mapping
// (its writer is the peer) fails the read instead of crashing.
func TestTruncatedTableFaults(t *testing.T) {
	dir := t.TempDir()
	p := newPrefill(t, dir, testShape, 1)
	d := decodeMem(t, testShape)
	r := open(t, p, d)
	must(t, p.table.Grant([]int{3}))
	st, err := os.Stat(p.claim.Grants)
	must(t, err)
	must(t, os.Truncate(p.claim.Grants, 0))
	// The owner's own mapping faults too (a Table is its writer's, which
	// alone may truncate it): give its size back before it closes.
	defer os.Truncate(p.claim.Grants, st.Size())
	err = r.Read(t.Context(), "req", blockOps(p.host, d, []int{3}, []int{3}), Stride{})
	if !errors.Is(err, ErrFault) {
		t.Fatalf("read with a truncated grant table: %v, want %v", err, ErrFault)
	}
}

// TestOpenRefusesFileLargerThanMemory: a claim for a (sparse) cache file
// larger than this host's memory and swap is refused before it is mapped:
// a few such claims would take the decode's whole address space.
func TestOpenRefusesFileLargerThanMemory(t *testing.T) {
	mem := HostMemory()
	// 1 KiB per unit of head_dim in testShape's other dimensions.
	hd := mem/1024 + 1
	if hd > 1<<31 {
		t.Skipf("host memory %d too large to exceed with a valid shape", mem)
	}
	shape := testShape
	shape.HeadDim = int(hd)
	l, err := npu.NewLayout(shape)
	must(t, err)
	dir := t.TempDir()
	p := newPrefill(t, dir, testShape, 1)
	le := binary.LittleEndian
	size := int64(le.Uint64(p.claim.Header[104:])) + l.Size()
	c := hostileFile(t, p, "huge", size, func(h []byte) {
		le.PutUint64(h[32+8*4:], hd)
		le.PutUint64(h[112:], uint64(l.Size()))
		le.PutUint64(h[120:], uint64(size))
	})
	tb, err := CreateTable(c.Path+TableSuffix, shape.NumBlocks, 0)
	must(t, err)
	defer tb.Close(true)
	must(t, tb.GrantAll())
	c.Grants, c.Epoch = tb.Path(), tb.Epoch()
	c.GrantsDev, c.GrantsIno = tb.Identity()
	base := make([]uint64, l.NumCaches())
	for k := range base {
		base[k] = uint64(k+1) << 44
	}
	d := decodeMem(t, testShape)
	r, err := Open(c, Options{BaseAddrs: base, Local: caches(d)})
	if r != nil {
		r.Close()
	}
	if !errors.Is(err, ErrMismatch) {
		t.Fatalf("Open of a %d-byte file on a host of %d bytes: %v, want %v", size, mem, err, ErrMismatch)
	}
}

// TestOpenRefusesSpecialFiles: a claim naming a device (with its real
// device and inode, which anyone can stat) or a directory is refused
// before anything is opened for reading data or mapped.
func TestOpenRefusesSpecialFiles(t *testing.T) {
	dir := t.TempDir()
	p := newPrefill(t, dir, testShape, 1)
	for _, path := range []string{"/dev/zero", "/dev/null", dir} {
		st, err := os.Stat(path)
		if err != nil {
			t.Skip(err)
		}
		sys := st.Sys().(*syscall.Stat_t)
		c := p.claim
		c.Path, c.Dev, c.Ino, c.Grants = path, uint64(sys.Dev), uint64(sys.Ino), path+TableSuffix
		r, err := Open(c, Options{BaseAddrs: p.host.BaseAddrs()})
		if r != nil {
			r.Close()
		}
		if !errors.Is(err, ErrMismatch) {
			t.Errorf("claim of %s: %v, want %v", path, err, ErrMismatch)
		}
	}
}

// flipCtx is a context that is canceled from its second Err call on: the
// read starts, then is canceled while it runs.
type flipCtx struct {
	context.Context
	calls int
}

func (c *flipCtx) Err() error {
	if c.calls++; c.calls > 1 {
		return context.Canceled
	}
	return nil
}

// TestReadFullSlotChainCancelable: the peer writes the grant table, and a
// table whose every request slot holds some other key makes a read probe
// the whole table (2^32 slots at most) for its request: that probe heeds
// the read's context.
func TestReadFullSlotChainCancelable(t *testing.T) {
	dir := t.TempDir()
	p := newPrefill(t, dir, testShape, 1)
	d := decodeMem(t, testShape)
	r := open(t, p, d)
	key := requestKey("req")
	for i := range p.table.slots {
		word(p.table.mem, slotOff(p.table.numBlocks, i)).Store(key ^ 1<<63 ^ uint64(i))
	}
	ctx := &flipCtx{Context: t.Context()}
	err := r.Read(ctx, "req", blockOps(p.host, d, []int{3}, []int{3}), Stride{})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("read probing a full slot table under a canceled context: %v", err)
	}
}
