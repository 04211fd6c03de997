//go:build mooncake && cgo

package mooncakec

import (
	"bytes"
	"context"
	"errors"
	"syscall"
	"testing"

	"github.com/kvflow/kvflow/hw/mooncake"
)

// op is one Op from b (local) to r (remote), n bytes.
func op(b, r []byte, n uint64) mooncake.Op {
	return mooncake.Op{Local: mooncake.AddrOf(b), Remote: mooncake.AddrOf(r), Length: n}
}

// mmap returns n bytes of anonymous memory (never Go-managed: Mooncake
// keeps the pointers), unmapped at test end.
func mmap(tb testing.TB, n int) []byte {
	tb.Helper()
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		tb.Fatalf("mmap %d: %v", n, err)
	}
	tb.Cleanup(func() { syscall.Munmap(b) })
	return b
}

// TestCgoEngineLoopback reads and writes between two regions of one
// engine through its own segment (Mooncake serves a segment to itself).
func TestCgoEngineLoopback(t *testing.T) {
	cfg := DefaultCgoConfig()
	cfg.Protocol = "tcp"
	e, err := NewCgoEngine(cfg, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	a, b := mmap(t, 1<<20), mmap(t, 1<<20)
	for i := range a {
		a[i] = byte(i * 13)
	}
	for _, m := range [][]byte{a, b} {
		if err := e.Register(mooncake.AddrOf(m), uint64(len(m)), ""); err != nil {
			t.Fatal(err)
		}
	}
	ops := []mooncake.Op{op(b, a[4096:], 65536), op(b[65536:], a, 4096)}
	if err := e.BatchRead(context.Background(), e.SessionID(), ops); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b[:65536], a[4096:4096+65536]) || !bytes.Equal(b[65536:65536+4096], a[:4096]) {
		t.Fatal("read: bytes differ")
	}
	for i := range b {
		b[i] = byte(i * 7)
	}
	if err := e.BatchWrite(context.Background(), e.SessionID(), []mooncake.Op{op(b, a[8192:], 1000)}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a[8192:9192], b[:1000]) {
		t.Fatal("write: bytes differ")
	}
	unreg := mmap(t, 4096)
	if err := e.BatchRead(context.Background(), e.SessionID(), []mooncake.Op{op(unreg, a, 8)}); !errors.Is(err, mooncake.ErrNotRegistered) {
		t.Fatalf("unregistered local: %v", err)
	}
	if err := e.Unregister(mooncake.AddrOf(b)); err != nil {
		t.Fatal(err)
	}
}
