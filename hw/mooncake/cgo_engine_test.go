//go:build mooncake && cgo

package mooncake

import (
	"bytes"
	"context"
	"errors"
	"testing"
)

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
		if err := e.Register(AddrOf(m), uint64(len(m)), ""); err != nil {
			t.Fatal(err)
		}
	}
	ops := []Op{{AddrOf(b), AddrOf(a[4096:]), 65536}, {AddrOf(b[65536:]), AddrOf(a), 4096}}
	if err := e.BatchRead(context.Background(), e.SessionID(), ops); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b[:65536], a[4096:4096+65536]) || !bytes.Equal(b[65536:65536+4096], a[:4096]) {
		t.Fatal("read: bytes differ")
	}
	for i := range b {
		b[i] = byte(i * 7)
	}
	if err := e.BatchWrite(context.Background(), e.SessionID(), []Op{{AddrOf(b), AddrOf(a[8192:]), 1000}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a[8192:9192], b[:1000]) {
		t.Fatal("write: bytes differ")
	}
	unreg := mmap(t, 4096)
	if err := e.BatchRead(context.Background(), e.SessionID(), []Op{{AddrOf(unreg), AddrOf(a), 8}}); !errors.Is(err, ErrNotRegistered) {
		t.Fatalf("unregistered local: %v", err)
	}
	if err := e.Unregister(AddrOf(b)); err != nil {
		t.Fatal(err)
	}
}
