//go:build linux

package shm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"github.com/kvflow/kvflow/hw/npu"
)

// shape of a prefill rank in the tests; with P = 2 the decode rank has
// twice its heads.
var testShape = npu.Shape{NumLayers: 2, NumBlocks: 16, BlockSize: 4, NumKVHeads: 2, HeadDim: 8, DType: npu.BF16}

func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

// pattern is byte i of a prefill's data for a given seed: only that
// (seed, offset) gives it.
func pattern(seed, i int) byte { return byte(i*131 + i>>8*7 + seed*29 + 1) }

// prefill is a prefill worker's side in one process: its cache file,
// filled with pattern(seed), and its grant table.
type prefill struct {
	host  *npu.Host
	table *Table
	claim Claim
	seed  int
}

func newPrefill(t testing.TB, dir string, shape npu.Shape, seed int) *prefill {
	t.Helper()
	l, err := npu.NewLayout(shape)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, fmt.Sprintf("cache-%d", seed))
	h, err := npu.CreateShm(path, l, npu.HostOptions{NoLock: true, NoHugePages: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	fill(h.Data(), seed)
	tb, err := CreateTable(path+".grants", shape.NumBlocks, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tb.Close(false) })
	c, err := MakeClaim(path, tb)
	if err != nil {
		t.Fatal(err)
	}
	return &prefill{host: h, table: tb, claim: c, seed: seed}
}

func fill(b []byte, seed int) {
	for i := range b {
		b[i] = pattern(seed, i)
	}
}

// decodeMem is a decode rank's cache memory.
func decodeMem(t testing.TB, shape npu.Shape) *npu.Host {
	t.Helper()
	l, err := npu.NewLayout(shape)
	if err != nil {
		t.Fatal(err)
	}
	h, err := npu.NewHost(l, npu.HostOptions{NoLock: true, NoHugePages: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

func caches(h *npu.Host) [][]byte {
	l := h.Layout()
	var out [][]byte
	for k := range l.NumCaches() {
		layer, part := l.CacheOf(k)
		out = append(out, h.Bytes(layer, part))
	}
	return out
}

func open(t testing.TB, p *prefill, local *npu.Host) *Reader {
	t.Helper()
	r, err := Open(p.claim, Options{BaseAddrs: p.host.BaseAddrs(), Local: caches(local)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// blockOps reads remote blocks src[i] into local blocks dst[i] of every
// cache, merging runs contiguous on both sides (as the planner does).
func blockOps(p, d *npu.Host, src, dst []int) []Op {
	l := p.Layout()
	var ops []Op
	for k, rb := range p.BaseAddrs() {
		lb := d.BaseAddrs()[k]
		_, part := l.CacheOf(k)
		bl := uint64(l.BlockLen(part))
		for i := 0; i < len(src); {
			j := i + 1
			for j < len(src) && src[j] == src[j-1]+1 && dst[j] == dst[j-1]+1 {
				j++
			}
			ops = append(ops, Op{Local: lb + uint64(dst[i])*bl, Remote: rb + uint64(src[i])*bl, Len: uint64(j-i) * bl})
			i = j
		}
	}
	return ops
}

// checkBlocks verifies every byte of every cache of d: listed blocks equal
// the prefill's, all others are untouched (zero).
func checkBlocks(t *testing.T, p, d *npu.Host, src, dst []int) {
	t.Helper()
	l := d.Layout()
	want := map[int]int{}
	for i := range dst {
		want[dst[i]] = src[i]
	}
	for k := range l.NumCaches() {
		layer, part := l.CacheOf(k)
		for b := range l.Shape().NumBlocks {
			got := d.Block(layer, part, b)
			exp := make([]byte, len(got))
			if s, ok := want[b]; ok {
				exp = p.Block(layer, part, s)
			}
			if !bytes.Equal(got, exp) {
				t.Fatalf("cache %d block %d differs", k, b)
			}
		}
	}
}

func TestReadEveryByte(t *testing.T) {
	dir := t.TempDir()
	p := newPrefill(t, dir, testShape, 1)
	for _, tc := range []struct {
		name     string
		src, dst []int
	}{
		{"one block", []int{3}, []int{0}},
		{"contiguous run", []int{4, 5, 6, 7}, []int{8, 9, 10, 11}},
		{"scattered", []int{15, 0, 7, 2, 3}, []int{1, 5, 2, 14, 15}},
		{"every block", seq(0, 16), seq(0, 16)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := p.table.Grant(tc.src); err != nil {
				t.Fatal(err)
			}
			defer p.table.Revoke(tc.src)
			d := decodeMem(t, testShape)
			r := open(t, p, d)
			if err := r.Read(t.Context(), "", blockOps(p.host, d, tc.src, tc.dst), Stride{}); err != nil {
				t.Fatal(err)
			}
			checkBlocks(t, p.host, d, tc.src, tc.dst)
		})
	}
}

func seq(a, b int) []int {
	var s []int
	for i := a; i < b; i++ {
		s = append(s, i)
	}
	return s
}

// TestReadStrided: a decode rank with P = 2 prefill ranks, each slice
// landing in its place in the token rows (the fused head transpose): the
// result equals reading the slices side by side and running the stitch
// kernel, byte for byte.
func TestReadStrided(t *testing.T) {
	dir := t.TempDir()
	const P = 2
	ps := []*prefill{newPrefill(t, dir, testShape, 1), newPrefill(t, dir, testShape, 2)}
	dshape := testShape
	dshape.NumKVHeads *= P
	fused, ref := decodeMem(t, dshape), decodeMem(t, dshape)
	src, dst := []int{2, 3, 9}, []int{0, 1, 7}
	dl := fused.Layout()
	for q, p := range ps {
		if err := p.table.Grant(src); err != nil {
			t.Fatal(err)
		}
		rowRemote := uint64(testShape.NumKVHeads * testShape.HeadDim * testShape.DType.Size())
		var ops, refOps []Op
		for k, rb := range p.host.BaseAddrs() {
			_, part := dl.CacheOf(k)
			rbl, lbl := uint64(p.host.Layout().BlockLen(part)), uint64(dl.BlockLen(part))
			for i := range src {
				remote := rb + uint64(src[i])*rbl
				ops = append(ops, Op{Local: fused.BaseAddrs()[k] + uint64(dst[i])*lbl + uint64(q)*rowRemote, Remote: remote, Len: rbl})
				refOps = append(refOps, Op{Local: ref.BaseAddrs()[k] + uint64(dst[i])*lbl + uint64(q)*rbl, Remote: remote, Len: rbl})
			}
		}
		rf, rr := open(t, p, fused), open(t, p, ref)
		if err := rf.Read(t.Context(), "", ops, Stride{Row: rowRemote, Pitch: P * rowRemote}); err != nil {
			t.Fatal(err)
		}
		if err := rr.Read(t.Context(), "", refOps, Stride{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := ref.Stitch(context.Background(), dst, P); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(fused.Data(), ref.Data()) {
		t.Fatal("fused strided read differs from read + stitch kernel")
	}
	if bytes.Equal(fused.Data(), make([]byte, len(fused.Data()))) {
		t.Fatal("nothing read")
	}
}

// TestOpenRefusesMismatch: a claim that does not describe the file at its
// path (or names another host, or a stale table) is refused, and nothing
// is mapped.
func TestOpenRefusesMismatch(t *testing.T) {
	dir := t.TempDir()
	p := newPrefill(t, dir, testShape, 1)
	other := newPrefill(t, dir, testShape, 2)
	d := decodeMem(t, testShape)
	base := p.host.BaseAddrs()
	for _, tc := range []struct {
		name  string
		edit  func(c *Claim, o *Options)
		setup func(t *testing.T) // changes the files
		want  error
	}{
		{"other host", func(c *Claim, _ *Options) { c.HostID = "boot:elsewhere" }, nil, ErrNotSameHost},
		{"no host", func(c *Claim, _ *Options) { c.HostID = "" }, nil, ErrNotSameHost},
		{"other inode", func(c *Claim, _ *Options) { c.Ino++ }, nil, ErrMismatch},
		{"other device", func(c *Claim, _ *Options) { c.Dev++ }, nil, ErrMismatch},
		{"other size", func(c *Claim, _ *Options) { c.Size += 4096 }, nil, ErrMismatch},
		{"other header", func(c *Claim, _ *Options) { c.Header = bytes.Clone(c.Header); c.Header[40]++ }, nil, ErrMismatch},
		{"short header", func(c *Claim, _ *Options) { c.Header = c.Header[:10] }, nil, ErrMismatch},
		{"other file's identity", func(c *Claim, _ *Options) {
			c.Dev, c.Ino, c.Size, c.Header = other.claim.Dev, other.claim.Ino, other.claim.Size, other.claim.Header
		}, nil, ErrMismatch},
		{"missing file", func(c *Claim, _ *Options) { c.Path = filepath.Join(dir, "nope") }, nil, ErrMismatch},
		{"symlink to the file", func(c *Claim, _ *Options) { c.Path = filepath.Join(dir, "link") }, func(t *testing.T) {
			if err := os.Symlink(p.claim.Path, filepath.Join(dir, "link")); err != nil {
				t.Fatal(err)
			}
		}, ErrMismatch},
		// Not the cache file's own table (TestOpenRefusesForeignCache).
		{"other table", func(c *Claim, _ *Options) {
			c.Grants, c.GrantsDev, c.GrantsIno = other.claim.Grants, other.claim.GrantsDev, other.claim.GrantsIno
		}, nil, ErrMismatch},
		{"table inode", func(c *Claim, _ *Options) { c.GrantsIno++ }, nil, ErrMismatch},
		{"table is the cache file", func(c *Claim, _ *Options) { c.Grants, c.GrantsDev, c.GrantsIno = c.Path, c.Dev, c.Ino }, nil, ErrMismatch},
		{"table of another size", func(c *Claim, _ *Options) {
			c.Grants, c.GrantsDev, c.GrantsIno = filepath.Join(dir, "foreign"), 0, 0
		}, nil, ErrMismatch},
		{"old epoch", func(c *Claim, _ *Options) { c.Epoch++ }, nil, ErrOwnerGone},
		{"zero epoch", func(c *Claim, _ *Options) { c.Epoch = 0 }, nil, ErrOwnerGone},
		{"base addresses short", func(_ *Claim, o *Options) { o.BaseAddrs = base[:1] }, nil, ErrMismatch},
		{"base addresses overlap", func(_ *Claim, o *Options) { o.BaseAddrs = []uint64{1 << 20, 1 << 20, 2 << 20, 3 << 20} }, nil, ErrMismatch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.setup != nil {
				tc.setup(t)
			}
			c := p.claim
			o := Options{BaseAddrs: base, Local: caches(d)}
			tc.edit(&c, &o)
			r, err := Open(c, o)
			if !errors.Is(err, tc.want) || r != nil {
				t.Fatalf("Open: %v (reader %v), want %v", err, r != nil, tc.want)
			}
		})
	}
	// The path now names another file (replaced by rename, as a
	// reconfigured prefill's new cache would): refused.
	t.Run("replaced file", func(t *testing.T) {
		if err := os.Link(other.claim.Path, filepath.Join(dir, "x")); err != nil {
			t.Fatal(err)
		}
		c := p.claim
		c.Path = filepath.Join(dir, "x")
		if _, err := Open(c, Options{BaseAddrs: base}); !errors.Is(err, ErrMismatch) {
			t.Fatalf("Open: %v", err)
		}
	})
}

// TestGrantChecks: in-process grant table checks, a revoke during the copy
// included.
func TestGrantChecks(t *testing.T) {
	dir := t.TempDir()
	p := newPrefill(t, dir, testShape, 1)
	d := decodeMem(t, testShape)
	r := open(t, p, d)
	src := []int{1, 2}
	ops := blockOps(p.host, d, src, src)
	read := func() error { return r.Read(t.Context(), "", ops, Stride{}) }
	if err := read(); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("ungranted: %v", err)
	}
	must(t, p.table.Grant(src))
	must(t, read())
	must(t, p.table.Grant(src[:1])) // a second holder of block 1
	must(t, p.table.Revoke(src[:1]))
	must(t, read()) // still held
	must(t, p.table.Revoke(src))
	if err := read(); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("after revoke: %v", err)
	}
	if err := p.table.Revoke(src); err == nil {
		t.Fatal("revoke of an ungranted block succeeded")
	}
	if err := p.table.Grant([]int{16}); err == nil {
		t.Fatal("grant out of range succeeded")
	}

	// Freed and re-granted (reused) while the copy ran: refused.
	must(t, p.table.Grant(src))
	n := 0
	r.testAfterCopy = func() {
		if n++; n == 1 {
			must(t, p.table.Revoke(src))
			must(t, p.table.Grant(src))
		}
	}
	if err := read(); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("reused during the copy: %v", err)
	}
	r.testAfterCopy = nil
	must(t, read())
	must(t, p.table.Revoke(src))

	// GrantAll opens every block; its end during a copy fails the read.
	must(t, p.table.GrantAll())
	must(t, read())
	r.testAfterCopy = func() { p.table.RevokeAll(); p.table.GrantAll() }
	if err := read(); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("grant-all ended during the copy: %v", err)
	}
	r.testAfterCopy = nil
	must(t, p.table.RevokeAll())
	if err := read(); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("after RevokeAll: %v", err)
	}

	// Out of range ops are refused before anything is copied.
	for _, op := range []Op{
		{Local: ops[0].Local, Remote: p.host.BaseAddrs()[0] - 1, Len: 16},
		{Local: ops[0].Local, Remote: ops[0].Remote, Len: 1 << 30},
		{Local: 8, Remote: ops[0].Remote, Len: 16},
		{Local: ops[0].Local, Remote: ops[0].Remote, Len: 0},
	} {
		if err := r.Read(t.Context(), "", []Op{op}, Stride{}); !errors.Is(err, ErrRange) {
			t.Errorf("op %+v: %v", op, err)
		}
	}

	// The table taken over by a new run (a restart): the old claim fails.
	must(t, p.table.Grant(src))
	t2, err := CreateTable(p.claim.Grants, testShape.NumBlocks, 0)
	must(t, err)
	defer t2.Close(false)
	must(t, t2.Grant(src))
	if err := read(); !errors.Is(err, ErrOwnerGone) {
		t.Fatalf("after a takeover: %v", err)
	}
	c, err := MakeClaim(p.claim.Path, t2)
	must(t, err)
	r2, err := Open(c, Options{BaseAddrs: p.host.BaseAddrs(), Local: caches(d)})
	must(t, err)
	defer r2.Close()
	must(t, r2.Read(t.Context(), "", ops, Stride{}))
	must(t, t2.Close(false))
	if err := r2.Read(t.Context(), "", ops, Stride{}); !errors.Is(err, ErrOwnerGone) {
		t.Fatalf("after Close: %v", err)
	}
	must(t, r2.Close())
	if err := r2.Read(t.Context(), "", ops, Stride{}); !errors.Is(err, ErrClosed) {
		t.Fatalf("closed reader: %v", err)
	}
}

// TestTruncatedFileFaults: a cache file truncated under the mapping fails
// the read instead of crashing the process.
func TestTruncatedFileFaults(t *testing.T) {
	dir := t.TempDir()
	p := newPrefill(t, dir, testShape, 1)
	d := decodeMem(t, testShape)
	r := open(t, p, d)
	must(t, p.table.Grant([]int{15}))
	must(t, os.Truncate(p.claim.Path, 4096))
	if err := r.Read(t.Context(), "", blockOps(p.host, d, []int{15}, []int{15}), Stride{}); !errors.Is(err, ErrFault) {
		t.Fatalf("read of a truncated file: %v", err)
	}
}

func TestCreateTableRefusesForeignFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "x")
	must(t, os.WriteFile(path, []byte("someone else's file"), 0o600))
	if _, err := CreateTable(path, 4, 0); err == nil {
		t.Fatal("CreateTable replaced a foreign file")
	}
	if b, _ := os.ReadFile(path); string(b) != "someone else's file" {
		t.Fatalf("foreign file changed: %q", b)
	}
	must(t, os.Symlink(path, path+".link"))
	if _, err := CreateTable(path+".link", 4, 0); err == nil {
		t.Fatal("CreateTable followed a symlink")
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestReadGather: a decode rank with half a prefill rank's heads reads one
// head slice of every token row (rows strided on the peer's side): every
// byte equals a row-by-row reference.
func TestReadGather(t *testing.T) {
	dir := t.TempDir()
	const split = 2
	p := newPrefill(t, dir, testShape, 3)
	dshape := testShape
	dshape.NumKVHeads /= split
	d := decodeMem(t, dshape)
	src, dst := []int{5, 6}, []int{1, 2}
	must(t, p.table.Grant(src))
	rowRemote := uint64(testShape.NumKVHeads * testShape.HeadDim * testShape.DType.Size())
	row := rowRemote / split
	const slice = 1 // the second half of each row
	var ops []Op
	for k, rb := range p.host.BaseAddrs() {
		_, part := d.Layout().CacheOf(k)
		rbl, lbl := uint64(p.host.Layout().BlockLen(part)), uint64(d.Layout().BlockLen(part))
		ops = append(ops, Op{Local: d.BaseAddrs()[k] + uint64(dst[0])*lbl, Remote: rb + uint64(src[0])*rbl + slice*row, Len: uint64(len(src)) * lbl})
	}
	r := open(t, p, d)
	must(t, r.Read(t.Context(), "", ops, Stride{Row: row, Pitch: rowRemote, Gather: true}))
	l := d.Layout()
	for k := range l.NumCaches() {
		layer, part := l.CacheOf(k)
		for i, b := range dst {
			got, from := d.Block(layer, part, b), p.host.Block(layer, part, src[i])
			for tok := range testShape.BlockSize {
				want := from[uint64(tok)*rowRemote+slice*row : uint64(tok)*rowRemote+(slice+1)*row]
				if !bytes.Equal(got[uint64(tok)*row:uint64(tok+1)*row], want) {
					t.Fatalf("cache %d block %d token %d differs", k, b, tok)
				}
			}
		}
		for b := range l.Shape().NumBlocks {
			if b != dst[0] && b != dst[1] && !bytes.Equal(d.Block(layer, part, b), make([]byte, l.BlockLen(part))) {
				t.Fatalf("cache %d block %d written", k, b)
			}
		}
	}
	// A gather whose last row would leave the peer's cache is refused.
	last := p.host.BaseAddrs()[len(p.host.BaseAddrs())-1]
	_, part := l.CacheOf(l.NumCaches() - 1)
	end := last + uint64(p.host.Layout().CacheLen(part))
	if err := r.Read(t.Context(), "", []Op{{Local: d.BaseAddrs()[0], Remote: end - rowRemote, Len: 2 * row}}, Stride{Row: row, Pitch: rowRemote, Gather: true}); !errors.Is(err, ErrRange) {
		t.Fatalf("gather past the end: %v", err)
	}
}

// TestRequestGrants: a read that names its request is refused unless that
// request holds the blocks, so blocks freed and already granted to
// another request are never read as the first one's; slots of freed
// requests are reused, and a full table refuses a grant.
func TestRequestGrants(t *testing.T) {
	dir := t.TempDir()
	p := newPrefill(t, dir, testShape, 1)
	d := decodeMem(t, testShape)
	r := open(t, p, d)
	src := []int{4, 5}
	ops := blockOps(p.host, d, src, src)
	read := func(req string) error { return r.Read(t.Context(), req, ops, Stride{}) }
	must(t, p.table.GrantRequest("a", src))
	must(t, read("a"))
	checkBlocks(t, p.host, d, src, src)
	for _, req := range []string{"b", "A", "a "} {
		if err := read(req); !errors.Is(err, ErrNotGranted) {
			t.Errorf("read as %q: %v", req, err)
		}
	}
	must(t, p.table.RevokeRequest("a", src))
	must(t, p.table.GrantRequest("b", src)) // reused by b
	if err := read("a"); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("read of freed a's blocks, now b's: %v", err)
	}
	must(t, read("b"))
	if err := p.table.RevokeRequest("a", src); err == nil {
		t.Error("revoke of a request not held succeeded")
	}
	// A second grant of b (counted), one revoke: still held.
	must(t, p.table.GrantRequest("b", src))
	must(t, p.table.RevokeRequest("b", src))
	must(t, read("b"))
	must(t, p.table.RevokeRequest("b", src))
	if err := read("b"); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("read of revoked b: %v", err)
	}
	// GrantAll (a send without block ids) opens every block to a
	// request with no record, not to one that was freed.
	must(t, p.table.GrantAll())
	must(t, read("never-sent"))
	if err := read("b"); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("freed b under GrantAll: %v", err)
	}
	must(t, p.table.RevokeAll())

	// Every slot held: the next grant fails and grants nothing; a freed
	// slot is taken again.
	slots := numSlots(testShape.NumBlocks)
	for i := range slots {
		must(t, p.table.GrantRequest(fmt.Sprint("r", i), []int{i % testShape.NumBlocks}))
	}
	if err := p.table.GrantRequest("one-more", []int{0}); err == nil {
		t.Fatal("grant with every slot held succeeded")
	}
	if err := read("one-more"); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("read of a request whose grant failed: %v", err)
	}
	must(t, p.table.RevokeRequest("r7", []int{7 % testShape.NumBlocks}))
	must(t, p.table.GrantRequest("one-more", src))
	must(t, read("one-more"))
	for i := range slots {
		if i != 7 {
			must(t, p.table.RevokeRequest(fmt.Sprint("r", i), []int{i % testShape.NumBlocks}))
		}
	}
	must(t, p.table.RevokeRequest("one-more", src))
	if err := read("one-more"); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("after the last revoke: %v", err)
	}
}

// TestOpenNeverBlocksOnAFIFO: a claim naming a FIFO is refused at once
// (never opened, which would wait for a writer).
func TestOpenNeverBlocksOnAFIFO(t *testing.T) {
	dir := t.TempDir()
	p := newPrefill(t, dir, testShape, 1)
	fifo := filepath.Join(dir, "fifo")
	must(t, syscall.Mkfifo(fifo, 0o600))
	st, err := os.Stat(fifo)
	must(t, err)
	sys := st.Sys().(*syscall.Stat_t)
	for _, table := range []bool{false, true} {
		c := p.claim
		if table {
			c.Grants, c.GrantsDev, c.GrantsIno = fifo, uint64(sys.Dev), uint64(sys.Ino)
		} else {
			c.Path, c.Dev, c.Ino = fifo, uint64(sys.Dev), uint64(sys.Ino)
		}
		if _, err := Open(c, Options{BaseAddrs: p.host.BaseAddrs()}); !errors.Is(err, ErrMismatch) {
			t.Errorf("table %v: %v", table, err)
		}
	}
}

// TestTableOpChecks: what every grant operation does before it touches a
// word — an empty request is a no-op, even on a closed table; a block id
// out of range fails the whole call and grants or revokes nothing (no
// slot taken either); a closed table refuses everything else with
// ErrClosed.
func TestTableOpChecks(t *testing.T) {
	n := testShape.NumBlocks
	for _, tc := range []struct {
		name   string
		closed bool
		op     func(tb *Table) error
		want   string // "" no error, "closed": ErrClosed, else a substring
	}{
		{"grant out of range", false, func(tb *Table) error { return tb.Grant([]int{0, n}) }, fmt.Sprintf("block id %d out of range [0, %d)", n, n)},
		{"revoke out of range", false, func(tb *Table) error { return tb.Revoke([]int{-1}) }, "block id -1 out of range"},
		{"grant request out of range", false, func(tb *Table) error { return tb.GrantRequest("x", []int{1, n}) }, "out of range"},
		{"revoke request out of range", false, func(tb *Table) error { return tb.RevokeRequest("x", []int{n}) }, "out of range"},
		{"revoke request not held", false, func(tb *Table) error { return tb.RevokeRequest("x", []int{1}) }, `shm: revoke request "x": request not granted`},
		{"empty grant request", false, func(tb *Table) error { return tb.GrantRequest("x", nil) }, ""},
		{"empty grant request, closed", true, func(tb *Table) error { return tb.GrantRequest("x", nil) }, ""},
		{"empty revoke request, closed", true, func(tb *Table) error { return tb.RevokeRequest("x", []int{}) }, ""},
		{"grant, closed", true, func(tb *Table) error { return tb.Grant([]int{1}) }, "closed"},
		{"empty grant, closed", true, func(tb *Table) error { return tb.Grant(nil) }, "closed"},
		{"revoke, closed", true, func(tb *Table) error { return tb.Revoke([]int{1}) }, "closed"},
		{"grant all, closed", true, (*Table).GrantAll, "closed"},
		{"revoke all, closed", true, (*Table).RevokeAll, "closed"},
		{"revoke all not granted", false, (*Table).RevokeAll, "not granted"},
		{"grant request, closed", true, func(tb *Table) error { return tb.GrantRequest("x", []int{1}) }, "closed"},
		{"grant request out of range, closed", true, func(tb *Table) error { return tb.GrantRequest("x", []int{n}) }, "closed"},
		{"revoke request, closed", true, func(tb *Table) error { return tb.RevokeRequest("x", []int{1}) }, "closed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tb, err := CreateTable(filepath.Join(t.TempDir(), "grants"), n, 0)
			must(t, err)
			defer tb.Close(false)
			if tc.closed {
				must(t, tb.Close(false))
			}
			err = tc.op(tb)
			switch {
			case tc.want == "" && err != nil, tc.want == "closed" && !errors.Is(err, ErrClosed),
				tc.want != "" && tc.want != "closed" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("err %v, want %q", err, tc.want)
			}
			if tc.closed {
				return
			}
			// Nothing was granted: every block and request is free.
			for _, b := range []int{0, 1} {
				if err := tb.Revoke([]int{b}); err == nil {
					t.Errorf("block %d was left granted", b)
				}
			}
			if err := tb.RevokeRequest("x", []int{0}); err == nil {
				t.Error("request x was left granted")
			}
		})
	}
}
