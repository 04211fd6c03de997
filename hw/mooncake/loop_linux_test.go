//go:build linux && !386

package mooncake

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// readHeader is a READ header of n bytes at addr.
func readHeader(addr, n uint64, v2 bool) []byte {
	var hb [HeaderSize]byte
	PutHeader(&hb, Header{Size: n, Addr: addr, Opcode: OpcodeRead, V2: v2})
	return hb[:]
}

// statusBytes is a v2 status frame.
func statusBytes(s uint64) []byte {
	var b [StatusSize]byte
	PutStatus(&b, s)
	return b[:]
}

// untilEOF sends in on a fresh connection, half-closes it and returns
// everything the target sends until it closes (err: how it closed).
func untilEOF(t *testing.T, addr string, in []byte) ([]byte, error) {
	t.Helper()
	c := dialFrom(t, "127.0.0.1", addr)
	if len(in) > 0 {
		if _, err := c.Write(in); err != nil {
			t.Fatalf("write: %v", err)
		}
	}
	c.(*net.TCPConn).CloseWrite()
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	out, err := io.ReadAll(c)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("target did not close the connection (read %d bytes)", len(out))
	}
	return out, err
}

// TestEventLoopServesOneAtATime: Mooncake's initiator pattern, pool off
// (a connection per request) and on (requests one after another on one
// connection), v1 and v2 framing, answers from 1 byte to several chunks
// (partial writes: the socket takes less than the answer): every byte
// comes back, and the event loop serves all of it without handing a
// connection to a goroutine.
func TestEventLoopServesOneAtATime(t *testing.T) {
	cfg := testConfig()
	cfg.ChunkSize = 1 << 20
	srv, _ := newEngine(t, cfg)
	if srv.loop == nil {
		t.Fatal("the data port has no event loop")
	}
	mem := register(t, srv, 8<<20, 3)
	base := AddrOf(mem)
	ops := 0.0
	for _, v2 := range []bool{false, true} {
		for _, size := range []int{1, 4096, 65536, 3<<20 + 17} {
			for _, perConn := range []int{1, 3} {
				t.Run(fmt.Sprintf("v2=%v/%dB/%d per conn", v2, size, perConn), func(t *testing.T) {
					c := dialFrom(t, "127.0.0.1", dataAddr(srv))
					c.SetDeadline(time.Now().Add(20 * time.Second))
					for i := range perConn {
						off := (i*4099 + size) % (len(mem) - size)
						if _, err := c.Write(readHeader(base+uint64(off), uint64(size), v2)); err != nil {
							t.Fatal(err)
						}
						if v2 {
							st := make([]byte, StatusSize)
							if _, err := io.ReadFull(c, st); err != nil || !bytes.Equal(st, statusBytes(StatusOK)) {
								t.Fatalf("request %d: status %x, %v", i, st, err)
							}
						}
						got := make([]byte, size)
						if _, err := io.ReadFull(c, got); err != nil {
							t.Fatalf("request %d: %v", i, err)
						}
						if !bytes.Equal(got, mem[off:off+size]) {
							t.Fatalf("request %d: bytes differ", i)
						}
						ops++
					}
					c.Close()
				})
			}
		}
	}
	waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 0 })
	if n := testutil.ToFloat64(srv.m.serveReadOps); n != ops {
		t.Errorf("served %v reads, want %v", n, ops)
	}
	if n := testutil.ToFloat64(srv.m.loopHandoffs); n != 0 {
		t.Errorf("%v connections handed to goroutines, want 0", n)
	}
	if g := testutil.ToFloat64(srv.m.targetConns); g != 0 {
		t.Errorf("target connections gauge %v after every connection closed", g)
	}
}

// TestEventLoopHandsOver: whatever the event loop does not serve itself
// (pipelined headers, writes, requests to refuse, a header split over
// several segments then more) gets exactly the answer the goroutine path
// gives, byte for byte, with the event loop on and off.
func TestEventLoopHandsOver(t *testing.T) {
	type engine struct {
		name string
		srv  *TCPEngine
		mem  []byte
	}
	var engines []engine
	for _, noLoop := range []bool{false, true} {
		cfg := testConfig()
		cfg.NoEventLoop = noLoop
		srv, _ := newEngine(t, cfg)
		if (srv.loop == nil) != noLoop {
			t.Fatalf("NoEventLoop %v: loop %v", noLoop, srv.loop != nil)
		}
		engines = append(engines, engine{map[bool]string{false: "loop", true: "goroutines"}[noLoop], srv, register(t, srv, 1<<20, 9)})
	}
	var wh [HeaderSize]byte
	PutHeader(&wh, Header{Size: 5, Opcode: OpcodeWrite, V2: true}) // address patched per engine
	cases := []struct {
		name    string
		in      func(base uint64) [][]byte // written in this many segments
		handoff bool                       // the loop hands the connection over
	}{
		{"two pipelined v2 reads", func(b uint64) [][]byte {
			return [][]byte{append(readHeader(b+8, 100, true), readHeader(b+1000, 3000, true)...)}
		}, true},
		{"three pipelined v1 reads", func(b uint64) [][]byte {
			return [][]byte{bytes.Repeat(readHeader(b+1, 7, false), 3)}
		}, true},
		{"served then pipelined", func(b uint64) [][]byte {
			return [][]byte{readHeader(b+64, 64, true), append(readHeader(b, 10, true), readHeader(b+5, 5, true)...)}
		}, true},
		{"header in three segments", func(b uint64) [][]byte {
			h := readHeader(b+77, 4096, true)
			return [][]byte{h[:3], h[3:10], h[10:]}
		}, false},
		{"v2 write then read back", func(b uint64) [][]byte {
			h := wh
			PutHeader(&h, Header{Size: 5, Addr: b + 500, Opcode: OpcodeWrite, V2: true})
			return [][]byte{append(h[:], "hello"...), readHeader(b+500, 5, true)}
		}, true},
		{"unregistered v2", func(b uint64) [][]byte { return [][]byte{readHeader(b+(2<<20), 10, true)} }, true},
		{"past the region v1", func(b uint64) [][]byte { return [][]byte{readHeader(b+(1<<20)-4, 10, false)} }, true},
		{"zero length v2", func(b uint64) [][]byte { return [][]byte{readHeader(b, 0, true)} }, true},
		{"unknown opcode", func(b uint64) [][]byte {
			h := readHeader(b, 10, true)
			h[16] = 0x7f
			return [][]byte{h}
		}, true},
		{"header then garbage", func(b uint64) [][]byte { return [][]byte{append(readHeader(b, 10, true), 1, 2, 3)} }, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var outs [2][]byte
			for i, en := range engines {
				before := testutil.ToFloat64(en.srv.m.loopHandoffs)
				base := AddrOf(en.mem)
				c := dialFrom(t, "127.0.0.1", dataAddr(en.srv))
				for _, seg := range tc.in(base) {
					if _, err := c.Write(seg); err != nil {
						t.Fatal(err)
					}
					time.Sleep(5 * time.Millisecond) // separate segments (not asserted on)
				}
				c.(*net.TCPConn).CloseWrite()
				c.SetReadDeadline(time.Now().Add(20 * time.Second))
				out, err := io.ReadAll(c)
				if errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatalf("%s: not closed", en.name)
				}
				// Addresses differ between the engines: compare the
				// answers with each engine's memory replaced by offsets.
				outs[i] = out
				if en.srv.loop != nil {
					handed := testutil.ToFloat64(en.srv.m.loopHandoffs) - before
					if (handed == 1) != tc.handoff {
						t.Errorf("%s: %v handoffs, want handoff %v", en.name, handed, tc.handoff)
					}
				}
			}
			if !bytes.Equal(outs[0], outs[1]) {
				t.Errorf("answers differ: loop %d bytes %x…, goroutines %d bytes %x…", len(outs[0]), head(outs[0]), len(outs[1]), head(outs[1]))
			}
		})
	}
	for _, en := range engines {
		waitFor(t, func() bool { return en.srv.portOpen(en.srv.dataConns) == 0 })
	}
}

func head(b []byte) []byte { return b[:min(len(b), 24)] }

// TestEventLoopStalledReader: a peer that stops reading a large answer is
// cut after IOTimeout without progress; the region it pinned is free
// again (Unregister returns).
func TestEventLoopStalledReader(t *testing.T) {
	cfg := testConfig()
	cfg.IOTimeout = 200 * time.Millisecond
	srv, _ := newEngine(t, cfg)
	mem := register(t, srv, 16<<20, 1)
	c := dialFrom(t, "127.0.0.1", dataAddr(srv))
	c.(*net.TCPConn).SetReadBuffer(4096)
	if _, err := c.Write(readHeader(AddrOf(mem), uint64(len(mem)), true)); err != nil {
		t.Fatal(err)
	}
	// The answer has started (without this, the wait below could see the
	// connection not yet accepted, and Unregister refuse its request).
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, StatusSize)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 0 })
	unregistered := make(chan error, 1)
	go func() { unregistered <- srv.Unregister(AddrOf(mem)) }()
	select {
	case err := <-unregistered:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Unregister still waits: the stalled answer's pin was not released")
	}
	if g := testutil.ToFloat64(srv.m.targetConns); g != 0 {
		t.Errorf("target connections gauge %v", g)
	}
}

// TestEventLoopGrantCut: with read grants, a peer stalled in the middle of
// a granted range is reset once a revoke's grace ends; the revoke
// completes, the cut is counted and the peer never gets a clean end of
// stream after a short answer.
func TestEventLoopGrantCut(t *testing.T) {
	cfg := testConfig()
	cfg.ReadGrants = true
	cfg.RevokeGrace = 100 * time.Millisecond
	cfg.IOTimeout = time.Minute // the cut, not the timeout, ends it
	srv, _ := newEngine(t, cfg)
	mem := register(t, srv, 16<<20, 1)
	rg := Range{Addr: AddrOf(mem), Length: uint64(len(mem))}
	if err := srv.Grant(rg); err != nil {
		t.Fatal(err)
	}
	c := dialFrom(t, "127.0.0.1", dataAddr(srv))
	c.(*net.TCPConn).SetReadBuffer(4096)
	if _, err := c.Write(readHeader(rg.Addr, rg.Length, true)); err != nil {
		t.Fatal(err)
	}
	// The answer has started: its status frame arrives.
	st := make([]byte, StatusSize)
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.ReadFull(c, st); err != nil {
		t.Fatal(err)
	}
	if err := srv.Revoke(rg); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 0 })
	if n := testutil.ToFloat64(srv.m.grantCuts); n != 1 {
		t.Errorf("%v grant cuts, want 1", n)
	}
	n, err := io.Copy(io.Discard, c)
	if err == nil || uint64(n)+StatusSize >= rg.Length {
		t.Errorf("peer read %d bytes then %v: want a reset before the end", n, err)
	}
}

// TestEventLoopClose: Close ends connections in every state (silent,
// half a header, an answer stalled, idle after an answer) and returns;
// no goroutine is left.
func TestEventLoopClose(t *testing.T) {
	base := runtime.NumGoroutine()
	cfg := testConfig()
	srv, err := NewTCPEngine(cfg, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	mem := mmap(t, 16<<20)
	if err := srv.Register(AddrOf(mem), uint64(len(mem)), ""); err != nil {
		t.Fatal(err)
	}
	var conns []net.Conn
	dial := func(in []byte) net.Conn {
		c := dialFrom(t, "127.0.0.1", dataAddr(srv))
		if len(in) > 0 {
			if _, err := c.Write(in); err != nil {
				t.Fatal(err)
			}
		}
		conns = append(conns, c)
		return c
	}
	dial(nil)
	dial(readHeader(AddrOf(mem), 10, true)[:9])
	// 16 MiB: more than both sockets' buffers hold. (Not a tiny receive
	// buffer: the kernel then leaves the closed target's orphan socket
	// stuck on a zero window, on both paths.)
	dial(readHeader(AddrOf(mem), uint64(len(mem)), true))
	idle := dial(readHeader(AddrOf(mem), 100, false))
	idle.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.ReadFull(idle, make([]byte, 100)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 4 })
	closed := make(chan error, 1)
	go func() { closed <- srv.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Close did not return")
	}
	for i, c := range conns {
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		if n, err := io.Copy(io.Discard, c); errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("connection %d from %s still open after Close (read %d bytes)", i, c.LocalAddr(), n)
		}
	}
	for _, c := range conns {
		c.Close()
	}
	checkGoroutines(t, base)
}

// TestEventLoopHostileFirstBytes: whatever a peer sends first (nothing,
// part of a header, garbage, absurd sizes, a reset right after a
// header), the target answers or closes, keeps its counts, and serves
// the next peer.
func TestEventLoopHostileFirstBytes(t *testing.T) {
	cfg := testConfig()
	cfg.FirstByteTimeout, cfg.IOTimeout = 300*time.Millisecond, 300*time.Millisecond
	srv, _ := newEngine(t, cfg)
	mem := register(t, srv, 1<<20, 5)
	b := AddrOf(mem)
	rnd := rand.New(rand.NewPCG(1, 2))
	garbage := func(n int) []byte {
		g := make([]byte, n)
		for i := range g {
			g[i] = byte(rnd.Uint32())
		}
		return g
	}
	cases := map[string][]byte{
		"nothing":           nil,
		"one byte":          {0},
		"16 bytes":          make([]byte, 16),
		"zero header":       make([]byte, HeaderSize),
		"huge size":         readHeader(b, 1<<62, true),
		"wrapping address":  readHeader(^uint64(0)-4, 10, true),
		"garbage 64":        garbage(64),
		"garbage 1000":      garbage(1000),
		"header of garbage": garbage(HeaderSize),
	}
	for name, in := range cases {
		t.Run(name, func(t *testing.T) { untilEOF(t, dataAddr(srv), in) })
	}
	// A reset right after a header that asks for more than the socket takes.
	c := dialFrom(t, "127.0.0.1", dataAddr(srv))
	c.Write(readHeader(b, 1<<20, true))
	c.(*net.TCPConn).SetLinger(0)
	c.Close()
	waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 0 })
	out, err := untilEOF(t, dataAddr(srv), readHeader(b+3, 50, true))
	if err != nil || !bytes.Equal(out, append(statusBytes(StatusOK), mem[3:53]...)) {
		t.Fatalf("a good request after the hostile ones: %d bytes, %v", len(out), err)
	}
	waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 0 })
	if g := testutil.ToFloat64(srv.m.targetConns); g != 0 {
		t.Errorf("target connections gauge %v", g)
	}
}

// TestEventLoopIPv6: the loop reads IPv6 peer addresses from accept4.
func TestEventLoopIPv6(t *testing.T) {
	if ln, err := net.Listen("tcp", "[::1]:0"); err != nil {
		t.Skipf("no IPv6 loopback: %v", err)
	} else {
		ln.Close()
	}
	cfg := testConfig()
	cfg.Host = "::1"
	srv, _ := newEngine(t, cfg)
	mem := register(t, srv, 1<<16, 2)
	c := dialFrom(t, "::1", net.JoinHostPort("::1", itoa(srv.DataPort())))
	c.Write(readHeader(AddrOf(mem), 100, false))
	got := make([]byte, 100)
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, mem[:100]) {
		t.Fatalf("read over IPv6: %v", err)
	}
}

func TestSockaddrAddrPort(t *testing.T) {
	var rsa syscall.RawSockaddrAny
	p4 := (*syscall.RawSockaddrInet4)(unsafe.Pointer(&rsa))
	p4.Family, p4.Addr = syscall.AF_INET, [4]byte{10, 1, 2, 3}
	*(*[2]byte)(unsafe.Pointer(&p4.Port)) = [2]byte{0x30, 0x39}
	if got := sockaddrAddrPort(&rsa).String(); got != "10.1.2.3:12345" {
		t.Errorf("v4: %s", got)
	}
	rsa = syscall.RawSockaddrAny{}
	p6 := (*syscall.RawSockaddrInet6)(unsafe.Pointer(&rsa))
	p6.Family = syscall.AF_INET6
	p6.Addr[15] = 1
	*(*[2]byte)(unsafe.Pointer(&p6.Port)) = [2]byte{0x00, 0x50}
	if got := sockaddrAddrPort(&rsa).String(); got != "[::1]:80" {
		t.Errorf("v6: %s", got)
	}
	rsa = syscall.RawSockaddrAny{}
	if got := sockaddrAddrPort(&rsa); got.IsValid() {
		t.Errorf("unknown family: %s", got)
	}
}
