//go:build linux

package npu

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

var shmShape = Shape{NumLayers: 3, NumBlocks: 5, BlockSize: 16, NumKVHeads: 4, HeadDim: 8, DType: BF16}

func TestHostAnonymous(t *testing.T) {
	for _, noHuge := range []bool{false, true} {
		t.Run(fmt.Sprint("nohuge=", noHuge), func(t *testing.T) {
			l, _ := NewLayout(shmShape)
			h, err := NewHost(l, HostOptions{NoHugePages: noHuge})
			if err != nil {
				t.Fatal(err)
			}
			if h.Path() != "" || (noHuge && h.HugeTLB()) {
				t.Errorf("path %q hugetlb %v", h.Path(), h.HugeTLB())
			}
			if len(h.Data()) != int(l.Size()) || h.Layout().Shape() != shmShape {
				t.Fatalf("data %d bytes, layout %d", len(h.Data()), l.Size())
			}
			if !bytes.Equal(h.Data(), make([]byte, l.Size())) {
				t.Error("fresh memory not zeroed")
			}
			addrs := h.BaseAddrs()
			for k, a := range addrs {
				layer, part := l.CacheOf(k)
				b := h.Bytes(layer, part)
				if addrOf(b) != a || len(b) != int(l.CacheLen(part)) || cap(b) != len(b) {
					t.Errorf("cache %d: Bytes at %#x len %d, base %#x", k, addrOf(b), len(b), a)
				}
				blk := h.Block(layer, part, 2)
				if addrOf(blk) != a+uint64(2*l.BlockLen(part)) || len(blk) != l.BlockLen(part) {
					t.Errorf("cache %d: block 2 at %#x", k, addrOf(blk))
				}
			}
			for _, bad := range [][3]int{{-1, 0, 0}, {3, 0, 0}, {0, 2, 0}, {0, -1, 0}, {0, 0, 5}, {0, 0, -1}} {
				if h.Block(bad[0], bad[1], bad[2]) != nil {
					t.Errorf("Block%v not nil", bad)
				}
			}
			var got []Region
			reg := RegistrarFunc(func(addr, n uint64, name string) error {
				got = append(got, Region{addr, n, name})
				return nil
			})
			if err := RegisterAll(reg, h); err != nil || !slices.Equal(got, h.Regions()) {
				t.Errorf("RegisterAll: %v, %v", err, got)
			}
			boom := errors.New("boom")
			n := 0
			err = RegisterAll(RegistrarFunc(func(uint64, uint64, string) error {
				if n++; n == 3 {
					return boom
				}
				return nil
			}), h)
			if !errors.Is(err, boom) || !strings.Contains(err.Error(), "layer.1.k") {
				t.Errorf("RegisterAll failure: %v", err)
			}
			if err := h.Close(); err != nil {
				t.Fatal(err)
			}
			if err := h.Close(); err != nil {
				t.Errorf("second Close: %v", err)
			}
			if h.Bytes(0, 0) != nil || h.BaseAddrs() != nil || h.Regions() != nil || h.Data() != nil || h.Block(0, 0, 0) != nil {
				t.Error("accessors after Close not nil")
			}
		})
	}
}

func fileSum(t *testing.T, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

func pattern(layer, part, block int) byte { return byte(1 + layer*31 + part*7 + block*3) }

const helperEnv = "KVFLOW_NPU_SHM_HELPER"

// TestShmHelperProcess is the second process of TestShmSecondProcess: it
// attaches to the file, checks what the first process wrote, stitches block
// 1 and writes its own marks into block 3.
func TestShmHelperProcess(t *testing.T) {
	path := os.Getenv(helperEnv)
	if path == "" {
		t.Skip("helper for TestShmSecondProcess")
	}
	want := shmShape
	h, err := OpenShm(path, HostOptions{Expect: &want})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	l := h.Layout()
	if l.Shape() != shmShape || !slices.Equal(l.BlockLens(), []int{16 * 4 * 8 * 2}) {
		t.Fatalf("layout %+v", l.Shape())
	}
	for k := range l.NumCaches() {
		layer, part := l.CacheOf(k)
		if !bytes.Equal(h.Block(layer, part, 0), bytes.Repeat([]byte{pattern(layer, part, 0)}, l.BlockLen(part))) {
			t.Fatalf("layer %d part %d block 0 does not hold the first process's data", layer, part)
		}
		b := h.Block(layer, part, 3)
		for i := range b {
			b[i] = ^pattern(layer, part, 3)
		}
	}
	if err := h.Stitch(context.Background(), []int{1}, 2); err != nil {
		t.Fatal(err)
	}
	fmt.Printf("helper ok: %d caches, base %#x\n", l.NumCaches(), h.BaseAddrs()[0])
}

// TestShmSecondProcess: a file created here is reopened by another process
// with the same layout, and both see each other's writes.
func TestShmSecondProcess(t *testing.T) {
	dir := t.TempDir()
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		d, err := os.MkdirTemp("/dev/shm", "kvflow-npu-test-")
		if err == nil {
			dir = d
			t.Cleanup(func() { os.RemoveAll(d) })
		}
	}
	path := filepath.Join(dir, "kv")
	l, _ := NewLayout(shmShape)
	h, err := CreateShm(path, l, HostOptions{RemoveOnClose: true})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if h.Path() != path {
		t.Errorf("Path %q", h.Path())
	}
	if m, _ := filepath.Glob(path + ".tmp*"); len(m) != 0 {
		t.Errorf("temporary files left: %v", m)
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 || st.Size() != int64(shmDataOffset)+l.Size() {
		t.Fatalf("file: %v %v", st, err)
	}
	block1 := map[int][]byte{}
	for k := range l.NumCaches() {
		layer, part := l.CacheOf(k)
		for b := range shmShape.NumBlocks {
			blk := h.Block(layer, part, b)
			for i := range blk {
				blk[i] = pattern(layer, part, b)
			}
			if b == 1 {
				for i := range blk {
					blk[i] = byte(i)
				}
				block1[k] = naiveStitch(blk, shmShape.BlockSize, 2)
			}
		}
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestShmHelperProcess$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), helperEnv+"="+path)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "helper ok") {
		t.Fatalf("second process: %v\n%s", err, out)
	}
	for k := range l.NumCaches() {
		layer, part := l.CacheOf(k)
		if !bytes.Equal(h.Block(layer, part, 3), bytes.Repeat([]byte{^pattern(layer, part, 3)}, l.BlockLen(part))) {
			t.Errorf("layer %d part %d: the second process's write is not visible", layer, part)
		}
		if !bytes.Equal(h.Block(layer, part, 1), block1[k]) {
			t.Errorf("layer %d part %d: the second process's stitch is not visible", layer, part)
		}
		if !bytes.Equal(h.Block(layer, part, 4), bytes.Repeat([]byte{pattern(layer, part, 4)}, l.BlockLen(part))) {
			t.Errorf("layer %d part %d: block 4 changed", layer, part)
		}
	}

	// Attach in this process too: same memory through another mapping.
	h2, err := OpenShm(path, HostOptions{})
	if err != nil {
		t.Fatal(err)
	}
	h2.Block(2, 1, 0)[5] = 0xAB
	if h.Block(2, 1, 0)[5] != 0xAB {
		t.Error("second mapping not shared")
	}
	if err := h2.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("closing an attached Host removed the file: %v", err)
	}

	// A name owned by a live Host is never replaced; the error names the
	// file and the owner.
	sum := fileSum(t, path)
	if _, err := CreateShm(path, l, HostOptions{}); !errors.Is(err, ErrInUse) ||
		!strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), fmt.Sprintf("pid %d", os.Getpid())) {
		t.Errorf("CreateShm over a live owner's file = %v", err)
	}
	if fileSum(t, path) != sum {
		t.Error("CreateShm changed the existing file")
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("RemoveOnClose left the file: %v", err)
	}
}

// TestShmBadFiles: foreign, corrupted, truncated, grown and mismatched files
// are rejected with a clear error, and not modified.
func TestShmBadFiles(t *testing.T) {
	dir := t.TempDir()
	l, _ := NewLayout(shmShape)
	good := filepath.Join(dir, "good")
	h, err := CreateShm(good, l, HostOptions{Mode: 0o640})
	if err != nil {
		t.Fatal(err)
	}
	h.Block(0, 0, 0)[0] = 42
	h.Close()
	if st, _ := os.Stat(good); st.Mode().Perm() != 0o640 {
		t.Errorf("mode %v", st.Mode())
	}
	if _, err := os.Stat(good); err != nil {
		t.Fatal("Close without RemoveOnClose removed the file")
	}
	raw, _ := os.ReadFile(good)
	hdr := raw[:headerSize]

	withHeader := func(mod func(b []byte), fixCRC bool) []byte {
		b := bytes.Clone(raw)
		mod(b)
		if fixCRC {
			binary.LittleEndian.PutUint32(b[headerLen:], crc32.Checksum(b[:headerLen], castagnoli))
		}
		return b
	}
	other := shmShape
	other.NumBlocks = 6
	for _, c := range []struct {
		name    string
		content []byte
		expect  *Shape
		is      error
		want    string
	}{
		{"empty", nil, nil, ErrBadMagic, "bad magic"},
		{"foreign", []byte("#!/bin/sh\necho this is not a cache\n"), nil, ErrBadMagic, "not a kvflow cache file"},
		{"magic only", []byte(shmMagic), nil, ErrBadSize, "shorter than a header"},
		{"wrong version", withHeader(func(b []byte) { b[8] = 2 }, true), nil, ErrBadVersion, "version 2"},
		{"wrong version bad crc", withHeader(func(b []byte) { b[8] = 9 }, false), nil, ErrBadVersion, "version 9"},
		{"corrupt header", withHeader(func(b []byte) { b[40]++ }, false), nil, ErrBadChecksum, "checksum"},
		{"unknown flags", withHeader(func(b []byte) { b[20] |= 0x80 }, true), nil, ErrBadVersion, "flags"},
		{"bad dtype", withHeader(func(b []byte) { b[16] = 77 }, true), nil, ErrInvalidShape, "dtype"},
		{"zero layers", withHeader(func(b []byte) { binary.LittleEndian.PutUint64(b[32:], 0) }, true), nil, ErrInvalidShape, "num_layers"},
		{"shape disagrees with sizes", withHeader(func(b []byte) { binary.LittleEndian.PutUint64(b[32:], 4) }, true), nil, ErrBadSize, "the shape needs"},
		{"bad data offset", withHeader(func(b []byte) { binary.LittleEndian.PutUint64(b[104:], 100) }, true), nil, ErrBadVersion, "data offset"},
		{"truncated", raw[:len(raw)-4096], nil, ErrBadSize, "file is"},
		{"header only", hdr, nil, ErrBadSize, "file is"},
		{"grown", append(bytes.Clone(raw), make([]byte, 4096)...), nil, ErrBadSize, "file is"},
		{"other shape", raw, &other, ErrBadFile, "expected"},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(dir, strings.ReplaceAll(c.name, " ", "_"))
			if err := os.WriteFile(path, c.content, 0o600); err != nil {
				t.Fatal(err)
			}
			sum := fileSum(t, path)
			h, err := OpenShm(path, HostOptions{Expect: c.expect})
			if err == nil {
				h.Close()
				t.Fatal("OpenShm accepted it")
			}
			if !errors.Is(err, ErrBadFile) || !errors.Is(err, c.is) || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), path) {
				t.Errorf("error %q; want %v / %q and the path", err, c.is, c.want)
			}
			if fileSum(t, path) != sum {
				t.Error("file modified")
			}
		})
	}
	if _, err := OpenShm(filepath.Join(dir, "missing"), HostOptions{}); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
	if _, err := OpenShm(dir, HostOptions{}); err == nil {
		t.Error("a directory was accepted")
	}
	if _, err := CreateShm("", l, HostOptions{}); err == nil {
		t.Error("empty path accepted")
	}
	if _, err := CreateShm(filepath.Join(dir, "nodir", "x"), l, HostOptions{}); err == nil {
		t.Error("missing directory accepted")
	}
	if _, err := CreateShm(filepath.Join(dir, "z"), Layout{}, HostOptions{}); !errors.Is(err, ErrInvalidShape) {
		t.Errorf("zero layout: %v", err)
	}
	// The good file still opens, with its data.
	h, err = OpenShm(good, HostOptions{Expect: &shmShape})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if h.Block(0, 0, 0)[0] != 42 {
		t.Error("data lost")
	}
}

func TestShmKinds(t *testing.T) {
	dir := t.TempDir()
	for i, c := range layoutCases {
		c.shape.NumBlocks = min(c.shape.NumBlocks, 3)
		l, err := NewLayout(c.shape)
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, fmt.Sprint(i))
		h, err := CreateShm(path, l, HostOptions{NoHugePages: i%2 == 0, RemoveOnClose: true})
		if err != nil {
			t.Fatal(err)
		}
		h2, err := OpenShm(path, HostOptions{})
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if h2.Layout().Shape() != c.shape || !slices.Equal(h2.Layout().BlockLens(), c.blockLens) {
			t.Errorf("%s: reopened as %+v", c.name, h2.Layout().Shape())
		}
		h2.Close()
		h.Close()
	}
}

func FuzzDecodeHeader(f *testing.F) {
	l, _ := NewLayout(shmShape)
	good := newHeader(l).encode()
	f.Add(good, int64(newHeader(l).fileSize))
	f.Add([]byte(shmMagic), int64(0))
	f.Add([]byte{}, int64(10))
	f.Fuzz(func(t *testing.T, b []byte, size int64) {
		h, l, err := decodeHeader("fuzz", b, size)
		if err != nil {
			if !errors.Is(err, ErrBadFile) {
				t.Fatalf("error %v does not wrap ErrBadFile", err)
			}
			return
		}
		if !bytes.Equal(h.encode(), b[:headerSize]) || int64(h.fileSize) != size || uint64(l.Size()) != h.dataSize {
			t.Fatal("accepted header does not round-trip")
		}
		if h.fileSize < h.dataOffset || int64(h.dataOffset) < 0 || h.shape.NumLayers > maxFileLayers {
			t.Fatalf("accepted header sizes nothing safely: data at %d, file %d, %d layers", h.dataOffset, h.fileSize, h.shape.NumLayers)
		}
	})
}

// TestLock: caches are locked in memory unless NoLock; a refused lock
// (an unprivileged RLIMIT_MEMLOCK) says why and leaves a working Host.
func TestLock(t *testing.T) {
	s := Shape{NumLayers: 2, NumBlocks: 8, BlockSize: 16, DType: BF16, NumKVHeads: 2, HeadDim: 64}
	l, err := NewLayout(s)
	if err != nil {
		t.Fatal(err)
	}
	for _, noLock := range []bool{false, true} {
		h, err := NewHost(l, HostOptions{NoHugePages: true, NoLock: noLock})
		if err != nil {
			t.Fatal(err)
		}
		locked, lerr := h.Locked()
		switch {
		case noLock && (locked || lerr != nil):
			t.Errorf("NoLock: locked %v, err %v", locked, lerr)
		case !noLock && !locked && lerr == nil:
			t.Error("not locked and no reason given")
		case !noLock && !locked:
			t.Logf("lock refused here: %v", lerr)
		}
		h.Bytes(0, 0)[0] = 1 // usable either way
		if err := h.Close(); err != nil {
			t.Fatal(err)
		}
	}
}
