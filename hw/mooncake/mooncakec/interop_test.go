//go:build mooncake && cgo

package mooncakec

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvflow/kvflow/hw/mooncake"
)

// These tests need the real Mooncake library (make test-mooncake runs them
// inside a network namespace of their own, loopback only: Mooncake's
// listeners bind every address).

// newCgo starts a CgoEngine over Mooncake's TCP transport on loopback.
func newCgo(tb testing.TB) mooncake.Engine {
	tb.Helper()
	cfg := DefaultCgoConfig()
	cfg.Protocol = "tcp"
	e, err := NewCgoEngine(cfg, nil, nil)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { e.Close() })
	return e
}

// newTCP starts kvflow's pure-Go engine on loopback (writes accepted, so a
// Mooncake peer's WRITE can be checked too).
func newTCP(tb testing.TB) mooncake.Engine {
	tb.Helper()
	cfg := mooncake.DefaultTCPConfig()
	cfg.IOTimeout = 10 * time.Second
	cfg.AcceptWrites = true
	e, err := mooncake.NewTCPEngine(cfg, nil, nil)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { e.Close() })
	return e
}

// fill writes a pattern only (seed, offset) produces.
func fill(b []byte, seed uint64) {
	x := seed*0x9E3779B97F4A7C15 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[i] = byte(x)
	}
}

// interopSizes run from one byte to more than the TCP engine's 4 MiB
// chunk, odd sizes and offsets included.
var interopSizes = []uint64{1, 7, 4096, 65536 + 3, 256 << 10, 1 << 20, 5<<20 + 3}

// layout places one op per size at odd offsets in a region of n bytes:
// local and remote offsets differ, so a swapped address shows.
func layout(local, remote []byte) []mooncake.Op {
	var ops []mooncake.Op
	lo, ro := uint64(13), uint64(4099)
	for _, n := range interopSizes {
		ops = append(ops, op(local[lo:], remote[ro:], n))
		lo += n + 17
		ro += n + 4096*3 + 1
	}
	return ops
}

const interopRegion = 16 << 20

// TestInterop: kvflow's cgo engine (Mooncake's C API and TCP transport) and
// kvflow's pure-Go TCP engine read from and write to each other, and two
// cgo engines in one process do too; every byte of every op is compared,
// and the bytes around each op are checked untouched.
func TestInterop(t *testing.T) {
	cases := []struct {
		name              string
		initiator, target func(testing.TB) mooncake.Engine
		write             bool
	}{
		{"cgo reads tcp", newCgo, newTCP, false},
		{"tcp reads cgo", newTCP, newCgo, false},
		{"cgo reads cgo", newCgo, newCgo, false},
		{"cgo writes tcp", newCgo, newTCP, true},
		{"tcp writes cgo", newTCP, newCgo, true},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ini, tgt := tc.initiator(t), tc.target(t)
			local, remote := mmap(t, interopRegion), mmap(t, interopRegion)
			if err := ini.Register(mooncake.AddrOf(local), interopRegion, ""); err != nil {
				t.Fatal(err)
			}
			if err := tgt.Register(mooncake.AddrOf(remote), interopRegion, ""); err != nil {
				t.Fatal(err)
			}
			src, dst := remote, local // read: remote -> local
			if tc.write {
				src, dst = local, remote
			}
			fill(src, uint64(i)+1)
			fill(dst, uint64(i)+100)
			before := bytes.Clone(dst)
			ops := layout(local, remote)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var err error
			if tc.write {
				err = ini.BatchWrite(ctx, tgt.SessionID(), ops)
			} else {
				err = ini.BatchRead(ctx, tgt.SessionID(), ops)
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := checkOps(ops, local, remote, before, tc.write); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// checkOps compares every op's destination with its source and every byte
// of the destination region no op covers with its value before.
func checkOps(ops []mooncake.Op, local, remote, before []byte, write bool) error {
	dst := local
	if write {
		dst = remote
	}
	covered := make([]bool, len(dst))
	for k, o := range ops {
		l := o.Local - mooncake.AddrOf(local)
		r := o.Remote - mooncake.AddrOf(remote)
		gotL, gotR := local[l:l+o.Length], remote[r:r+o.Length]
		if !bytes.Equal(gotL, gotR) {
			return fmt.Errorf("op %d (%d bytes): destination differs from source", k, o.Length)
		}
		d := l
		if write {
			d = r
		}
		for j := d; j < d+o.Length; j++ {
			covered[j] = true
		}
	}
	for j := range dst {
		if !covered[j] && dst[j] != before[j] {
			return fmt.Errorf("byte %d outside every op changed", j)
		}
	}
	return nil
}

// TestInteropRefused: a read that runs past the target's registered memory
// fails its op with a *BatchError (Mooncake's target and kvflow's both
// refuse it), and the next read between the same engines works.
func TestInteropRefused(t *testing.T) {
	cases := []struct {
		name              string
		initiator, target func(testing.TB) mooncake.Engine
	}{
		{"cgo reads tcp", newCgo, newTCP},
		{"tcp reads cgo", newTCP, newCgo},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ini, tgt := tc.initiator(t), tc.target(t)
			local, remote := mmap(t, 1<<20), mmap(t, 1<<20)
			if err := ini.Register(mooncake.AddrOf(local), 1<<20, ""); err != nil {
				t.Fatal(err)
			}
			if err := tgt.Register(mooncake.AddrOf(remote), 1<<20, ""); err != nil {
				t.Fatal(err)
			}
			fill(remote, 7)
			fill(local, 8)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			bad := mooncake.Op{Local: mooncake.AddrOf(local), Remote: mooncake.AddrOf(remote) + 1<<20 - 100, Length: 4096}
			err := ini.BatchRead(ctx, tgt.SessionID(), []mooncake.Op{bad})
			var be *mooncake.BatchError
			if !errors.As(err, &be) {
				t.Fatalf("read past the registered memory: %v, want a *BatchError", err)
			}
			good := op(local, remote[100:], 64<<10)
			if err := ini.BatchRead(ctx, tgt.SessionID(), []mooncake.Op{good}); err != nil {
				t.Fatalf("read after a refusal: %v", err)
			}
			if !bytes.Equal(local[:64<<10], remote[100:100+64<<10]) {
				t.Fatal("read after a refusal: bytes differ")
			}
		})
	}
}
