//go:build linux && !386

package mooncake

import (
	"bytes"
	"context"
	"encoding/binary"

	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"runtime"
	"syscall"

	"strings"
	"sync"
	"sync/atomic"

	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// An adversarial review of the data port's event loop (loop_linux.go):
// every test runs over real loopback sockets, most of them against the
// event loop and the goroutine path (NoEventLoop) alike, and checks that
// the engine's counts come back to zero afterwards.

// loopEngines starts one engine with the event loop and one without, with
// the same configuration, and registers n bytes of the same pattern in
// each (the answers then compare byte for byte).
type loopPair struct {
	name string
	srv  *TCPEngine
	mem  []byte
}

func loopEngines(t *testing.T, cfg TCPConfig, n int) []loopPair {
	t.Helper()
	var out []loopPair
	for _, noLoop := range []bool{false, true} {
		c := cfg
		c.NoEventLoop = noLoop
		srv, _ := newEngine(t, c)
		if (srv.loop == nil) != noLoop {
			t.Fatalf("NoEventLoop %v: loop %v", noLoop, srv.loop != nil)
		}
		name := "loop"
		if noLoop {
			name = "goroutines"
		}
		out = append(out, loopPair{name, srv, register(t, srv, n, 11)})
	}
	return out
}

// settled waits until the engine holds no data connection in any count:
// the port total and pending map, the engine's open count, the target
// connections gauge.
func settled(t *testing.T, srv *TCPEngine) {
	t.Helper()
	state := func() string {
		srv.mu.Lock()
		total, pending := srv.dataConns.total, len(srv.dataConns.pending)
		srv.mu.Unlock()
		return fmt.Sprintf("port total %d, pending addresses %d, open %d, target gauge %v",
			total, pending, srv.open.Load(), testutil.ToFloat64(srv.m.targetConns))
	}
	const zero = "port total 0, pending addresses 0, open 0, target gauge 0"
	for deadline := time.Now().Add(10 * time.Second); state() != zero; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("counts not back to zero: %s", state())
		}
	}
}

// exchange writes segs on a fresh connection (pausing after each segment
// when pause is set, so they arrive apart), half-closes it and returns
// what the target sent until it closed.
func exchange(t *testing.T, addr string, segs [][]byte, pause bool) []byte {
	t.Helper()
	c := dialFrom(t, "127.0.0.1", addr)
	c.SetDeadline(time.Now().Add(30 * time.Second))
	got := make(chan []byte, 1)
	go func() {
		out, _ := io.ReadAll(c)
		got <- out
	}()
	for _, s := range segs {
		if _, err := c.Write(s); err != nil {
			break // refused: the target may reset what follows
		}
		if pause {
			time.Sleep(time.Millisecond) // separate segments (not asserted on)
		}
	}
	c.(*net.TCPConn).CloseWrite()
	out := <-got
	c.Close()
	return out
}

// answer is what a served READ sends back.
func answer(mem []byte, off, n int, v2 bool) []byte {
	var out []byte
	if v2 {
		out = statusBytes(StatusOK)
	}
	return append(out, mem[off:off+n]...)
}

// TestEventLoopSplitAtEveryByte: two requests, sent in two segments split
// at every byte of them (both in one segment, a header in pieces, a header
// and part of the next), v1 and v2: both paths answer every byte, in order.
func TestEventLoopSplitAtEveryByte(t *testing.T) {
	engines := loopEngines(t, testConfig(), 1<<20)
	for _, v2 := range []bool{false, true} {
		for k := 1; k < 2*HeaderSize; k++ {
			for _, en := range engines {
				b := AddrOf(en.mem)
				in := append(readHeader(b+3, 100, v2), readHeader(b+5000, 70000, v2)...)
				want := append(answer(en.mem, 3, 100, v2), answer(en.mem, 5000, 70000, v2)...)
				out := exchange(t, dataAddr(en.srv), [][]byte{in[:k], in[k:]}, true)
				if !bytes.Equal(out, want) {
					t.Fatalf("%s v2=%v split at %d: %d bytes %x…, want %d", en.name, v2, k, len(out), head(out), len(want))
				}
			}
		}
	}
	for _, en := range engines {
		settled(t, en.srv)
	}
}

// TestEventLoopRandomSequences: random sequences of reads (v1 and v2, one
// byte to a few chunks, sometimes a refused request last), cut into random
// segments, some sent one request at a time and waiting for each answer:
// the event loop answers exactly as the goroutine path does.
func TestEventLoopRandomSequences(t *testing.T) {
	cfg := testConfig()
	cfg.ChunkSize = 64 << 10 // answers of several chunks
	const size = 4 << 20
	engines := loopEngines(t, cfg, size)
	rnd := rand.New(rand.NewPCG(7, 9))
	for iter := range 200 {
		type req struct{ off, n int }
		var reqs []req
		var hdrs [][]byte
		v2 := rnd.IntN(2) == 0
		for range 1 + rnd.IntN(6) {
			n := 1 + rnd.IntN(1<<rnd.IntN(19))
			off := rnd.IntN(size - n)
			reqs = append(reqs, req{off, n})
		}
		bad := rnd.IntN(4) // 0: an unregistered read last; 1: garbage last
		garbage := bytes.Repeat([]byte{0xa5}, 1+rnd.IntN(40))
		oneByOne := rnd.IntN(3) == 0
		cuts := rnd.Perm(64)[:rnd.IntN(4)]
		var outs [2][]byte
		for i, en := range engines {
			b := AddrOf(en.mem)
			hdrs = hdrs[:0]
			for _, r := range reqs {
				hdrs = append(hdrs, readHeader(b+uint64(r.off), uint64(r.n), v2))
			}
			switch bad {
			case 0:
				hdrs = append(hdrs, readHeader(b+size+4096, 10, v2))
			case 1:
				hdrs = append(hdrs, garbage)
			}
			if oneByOne {
				// Mooncake's initiator with its pool on: a request, its
				// whole answer, the next request on the same connection.
				c := dialFrom(t, "127.0.0.1", dataAddr(en.srv))
				c.SetDeadline(time.Now().Add(30 * time.Second))
				var out []byte
				for j, r := range reqs {
					if _, err := c.Write(hdrs[j]); err != nil {
						t.Fatal(err)
					}
					got := make([]byte, len(answer(en.mem, r.off, r.n, v2)))
					if _, err := io.ReadFull(c, got); err != nil {
						t.Fatalf("%s iter %d request %d: %v", en.name, iter, j, err)
					}
					out = append(out, got...)
				}
				if bad < 2 {
					c.Write(hdrs[len(hdrs)-1])
				}
				c.(*net.TCPConn).CloseWrite()
				rest, _ := io.ReadAll(c)
				c.Close()
				outs[i] = append(out, rest...)
				continue
			}
			all := bytes.Join(hdrs, nil)
			var segs [][]byte
			prev := 0
			for _, k := range cuts {
				if k > prev && k < len(all) {
					segs = append(segs, all[prev:k])
					prev = k
				}
			}
			segs = append(segs, all[prev:])
			outs[i] = exchange(t, dataAddr(en.srv), segs, true)
		}
		if !bytes.Equal(outs[0], outs[1]) {
			t.Fatalf("iter %d (v2 %v, %d requests, bad %d, one by one %v): loop %d bytes %x…, goroutines %d bytes %x…",
				iter, v2, len(reqs), bad, oneByOne, len(outs[0]), head(outs[0]), len(outs[1]), head(outs[1]))
		}
		if bad >= 2 {
			var want []byte
			for _, r := range reqs {
				want = append(want, answer(engines[0].mem, r.off, r.n, v2)...)
			}
			if !bytes.Equal(outs[0], want) {
				t.Fatalf("iter %d: %d bytes, want %d", iter, len(outs[0]), len(want))
			}
		}
	}
	for _, en := range engines {
		settled(t, en.srv)
	}
}

// TestEventLoopHeaderTrickle: once a header starts, the rest of it must
// arrive within IOTimeout (serveData sets one deadline for the whole
// rest). A peer that trickles a header a byte at a time, each byte well
// within IOTimeout of the last but the whole far beyond it, is closed
// before the header is whole, on both paths.
func TestEventLoopHeaderTrickle(t *testing.T) {
	cfg := testConfig()
	cfg.IOTimeout = 300 * time.Millisecond
	cfg.FirstByteTimeout = time.Minute
	cfg.IdleTimeout = time.Second // a served answer, then the target closes
	for _, en := range loopEngines(t, cfg, 1<<16) {
		t.Run(en.name, func(t *testing.T) {
			c := dialFrom(t, "127.0.0.1", dataAddr(en.srv))
			c.SetReadDeadline(time.Now().Add(30 * time.Second))
			got := make(chan []byte, 1)
			go func() {
				out, _ := io.ReadAll(c)
				got <- out
			}()
			h := readHeader(AddrOf(en.mem), 100, true)
			var out []byte
		trickle:
			for i := range h {
				if _, err := c.Write(h[i : i+1]); err != nil {
					break
				}
				// A third of IOTimeout between bytes: 8 IOTimeouts in all.
				select {
				case out = <-got:
					break trickle
				case <-time.After(cfg.IOTimeout / 3):
				}
			}
			if out == nil {
				out = <-got
			}
			if len(out) > 0 {
				t.Fatalf("a header trickled over %v (IOTimeout %v) was served: %d bytes", time.Duration(HeaderSize)*cfg.IOTimeout/3, cfg.IOTimeout, len(out))
			}
			settled(t, en.srv)
		})
	}
}

// stalledRead sends a v2 READ of n bytes at addr on a fresh connection
// with a small receive buffer (64 KiB: a tiny one makes the kernel crawl
// on zero windows once the test reads) and reads its status frame: the
// answer has started, and stays in flight while the test does not read
// (when n is well over the target's send buffer, at most 4 MiB).
func stalledRead(t *testing.T, srv *TCPEngine, addr, n uint64) net.Conn {
	t.Helper()
	c := dialFrom(t, "127.0.0.1", dataAddr(srv))
	c.(*net.TCPConn).SetReadBuffer(64 << 10)
	c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := c.Write(readHeader(addr, n, true)); err != nil {
		t.Fatal(err)
	}
	st := make([]byte, StatusSize)
	if _, err := io.ReadFull(c, st); err != nil || !bytes.Equal(st, statusBytes(StatusOK)) {
		t.Fatalf("status %x, %v", st, err)
	}
	return c
}

// TestEventLoopUnregisterWaitsForPin: Unregister of a region a v2 READ is
// still answering from waits until the answer is written (the region may
// be unmapped as soon as Unregister returns), on both paths; the answer
// is whole and right.
func TestEventLoopUnregisterWaitsForPin(t *testing.T) {
	const size = 64 << 20 // far more than both sockets' buffers hold
	for _, en := range loopEngines(t, testConfig(), size) {
		t.Run(en.name, func(t *testing.T) {
			c := stalledRead(t, en.srv, AddrOf(en.mem), size)
			unregistered := make(chan error, 1)
			go func() { unregistered <- en.srv.Unregister(AddrOf(en.mem)) }()
			got := make([]byte, size)
			if _, err := io.ReadFull(c, got[:8<<20]); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-unregistered:
				t.Fatalf("Unregister returned (%v) with at least %d MiB of the answer unwritten", err, (size-8<<20-8<<20)>>20)
			default:
			}
			if _, err := io.ReadFull(c, got[8<<20:]); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, en.mem) {
				t.Fatal("answer differs from the region")
			}
			select {
			case err := <-unregistered:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("Unregister still waits after the whole answer was read")
			}
			c.Close()
			settled(t, en.srv)
		})
	}
}

// TestEventLoopUnregisterRace: one-shot reads race with Unregister; once
// Unregister returns the test overwrites the region. Every answer is
// either refused or the region's bytes from before: never a byte written
// after Unregister returned.
func TestEventLoopUnregisterRace(t *testing.T) {
	const size = 256 << 10
	for _, en := range loopEngines(t, testConfig(), 1<<12) {
		t.Run(en.name, func(t *testing.T) {
			for round := range 30 {
				mem := mmap(t, size)
				for i := range mem {
					mem[i] = byte(i*13) ^ byte(round)
				}
				orig := append([]byte(nil), mem...)
				if err := en.srv.Register(AddrOf(mem), size, ""); err != nil {
					t.Fatal(err)
				}
				var wg sync.WaitGroup
				stop := make(chan struct{})
				errs := make(chan error, 8)
				for w := range 4 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						rnd := rand.New(rand.NewPCG(uint64(round), uint64(w)))
						for {
							select {
							case <-stop:
								return
							default:
							}
							n := 1 + rnd.IntN(size/2)
							off := rnd.IntN(size - n)
							c, err := net.Dial("tcp", dataAddr(en.srv))
							if err != nil {
								errs <- err
								return
							}
							c.SetDeadline(time.Now().Add(20 * time.Second))
							c.Write(readHeader(AddrOf(mem)+uint64(off), uint64(n), true))
							c.(*net.TCPConn).CloseWrite()
							out, _ := io.ReadAll(c)
							c.Close()
							switch {
							case len(out) == StatusSize+n && bytes.Equal(out[:StatusSize], statusBytes(StatusOK)):
								if !bytes.Equal(out[StatusSize:], orig[off:off+n]) {
									errs <- fmt.Errorf("round %d: an answer of %d bytes at %d carries bytes written after Unregister returned", round, n, off)
									return
								}
							case bytes.Equal(out, statusBytes(StatusRejected)):
							default:
								errs <- fmt.Errorf("round %d: %d bytes back for a read of %d: %x…", round, len(out), n, head(out))
								return
							}
						}
					}()
				}
				time.Sleep(time.Duration(round%5) * time.Millisecond) // (not asserted on)
				if err := en.srv.Unregister(AddrOf(mem)); err != nil {
					t.Fatal(err)
				}
				for i := range mem {
					mem[i] = 0xee
				}
				time.Sleep(2 * time.Millisecond) // let requests in flight meet the new bytes (not asserted on)
				close(stop)
				wg.Wait()
				select {
				case err := <-errs:
					t.Fatal(err)
				default:
				}
			}
			settled(t, en.srv)
		})
	}
}

// holdCuts returns the cut functions of the grant holds in flight, by
// hold id.
func holdCuts(srv *TCPEngine) map[uint64]func() {
	srv.grants.mu.Lock()
	defer srv.grants.mu.Unlock()
	cuts := map[uint64]func(){}
	for id, h := range srv.grants.holds {
		cuts[id] = h.cut
	}
	return cuts
}

// TestEventLoopStaleCut: a grant cut that arrives after the answer it was
// for finished (the revoke's timer fired as the answer ended) must not
// reset the next answer on the same connection, nor an answer on a later
// connection the loop serves with the same bookkeeping (its lconn reused)
// or the same descriptor number; the cut of the answer in flight resets
// it.
func TestEventLoopStaleCut(t *testing.T) {
	cfg := testConfig()
	cfg.ReadGrants = true
	cfg.IOTimeout = time.Minute
	srv, _ := newEngine(t, cfg)
	const size = 16 << 20
	mem := register(t, srv, size, 3)
	base := AddrOf(mem)
	if err := srv.Grant(Range{Addr: base, Length: size}); err != nil {
		t.Fatal(err)
	}
	oneCut := func() func() {
		t.Helper()
		var cut func()
		waitFor(t, func() bool {
			cuts := holdCuts(srv)
			for _, c := range cuts {
				cut = c
			}
			return len(cuts) == 1
		})
		return cut
	}
	readAll := func(c net.Conn, want []byte) {
		t.Helper()
		got := make([]byte, len(want))
		if _, err := io.ReadFull(c, got); err != nil {
			t.Fatalf("answer after a stale cut: %v", err)
		}
		if !bytes.Equal(got, want) {
			t.Fatal("answer differs")
		}
	}
	// applied waits until the loop has applied every cut asked so far: a
	// sentinel connection's own (live) cut, asked after them, reset it.
	applied := func() {
		t.Helper()
		before := holdCuts(srv)
		s := stalledRead(t, srv, base, size)
		var cut func()
		waitFor(t, func() bool {
			for id, c := range holdCuts(srv) {
				if before[id] == nil {
					cut = c
				}
			}
			return cut != nil
		})
		cut()
		if _, err := io.Copy(io.Discard, s); err == nil {
			t.Fatal("sentinel: a live cut did not reset its connection")
		}
		s.Close()
	}

	c := stalledRead(t, srv, base, size)
	cut1 := oneCut()
	readAll(c, mem)
	waitFor(t, func() bool { return len(holdCuts(srv)) == 0 })
	// The next request on the same connection; then the first one's cut.
	if _, err := c.Write(readHeader(base+1, size-1, true)); err != nil {
		t.Fatal(err)
	}
	readAll(c, statusBytes(StatusOK))
	cut2 := oneCut()
	cut1()
	applied()
	readAll(c, mem[1:])
	c.Close()
	waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 0 })
	// A later connection: stale cuts of both earlier answers.
	d := stalledRead(t, srv, base+2, size-2)
	live := oneCut()
	cut1()
	cut2()
	applied()
	readAll(d, mem[2:])
	// And the cut of an answer in flight resets it.
	if _, err := d.Write(readHeader(base, size, true)); err != nil {
		t.Fatal(err)
	}
	readAll(d, statusBytes(StatusOK))
	live() // stale too: d's previous answer
	oneCut()()
	if n, err := io.Copy(io.Discard, d); err == nil || n >= size {
		t.Fatalf("live cut: read %d then %v, want a reset", n, err)
	}
	settled(t, srv)
}

// canaries holds descriptors the test opened (pipes) while an engine opens
// and closes sockets: a descriptor number closed twice, or used after it
// was closed, by the engine shows as a canary closed or replaced under
// the test.
type canaries struct {
	fds  []int
	inos []uint64
}

func (k *canaries) check() error {
	for i, fd := range k.fds {
		var st syscall.Stat_t
		if err := syscall.Fstat(fd, &st); err != nil || st.Ino != k.inos[i] {
			return fmt.Errorf("canary descriptor %d (inode %d) closed or replaced under the test: %v, inode %d", fd, k.inos[i], err, st.Ino)
		}
	}
	return nil
}

// churn opens a pipe, checks every canary, and keeps at most 16 of them.
func (k *canaries) churn() error {
	if err := k.check(); err != nil {
		return err
	}
	var p [2]int
	if err := syscall.Pipe2(p[:], syscall.O_CLOEXEC); err != nil {
		return nil // EMFILE and the like: nothing to watch this turn
	}
	for _, fd := range p {
		var st syscall.Stat_t
		if err := syscall.Fstat(fd, &st); err != nil {
			return fmt.Errorf("fstat of a fresh pipe: %w", err)
		}
		k.fds, k.inos = append(k.fds, fd), append(k.inos, st.Ino)
	}
	for len(k.fds) > 16 {
		syscall.Close(k.fds[0])
		k.fds, k.inos = k.fds[1:], k.inos[1:]
	}
	return nil
}

func (k *canaries) close() {
	for _, fd := range k.fds {
		syscall.Close(fd)
	}
	k.fds, k.inos = nil, nil
}

// hostileClient plays one random peer against addr until stop: one-shot
// reads, pipelined ones (handed over), silent and half-header connections,
// answers abandoned with a reset, idle connections. Errors are expected
// (the engine closes under it) and ignored.
func hostileClient(addr string, base, size uint64, seed uint64, stop <-chan struct{}) {
	rnd := rand.New(rand.NewPCG(seed, 99))
	var idle []net.Conn
	defer func() {
		for _, c := range idle {
			c.Close()
		}
	}()
	for {
		select {
		case <-stop:
			return
		default:
		}
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			time.Sleep(time.Millisecond)
			continue
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		n := 1 + uint64(rnd.IntN(1<<rnd.IntN(23)))
		off := uint64(rnd.Int64N(int64(size - n)))
		v2 := rnd.IntN(2) == 0
		switch rnd.IntN(7) {
		case 0, 1: // one-shot read
			c.Write(readHeader(base+off, n, v2))
			c.(*net.TCPConn).CloseWrite()
			io.Copy(io.Discard, c)
		case 2: // pipelined: handed over
			c.Write(append(readHeader(base+off, n, v2), readHeader(base, 10, v2)...))
			c.(*net.TCPConn).CloseWrite()
			io.Copy(io.Discard, c)
		case 3: // silent, then gone
			time.Sleep(time.Duration(rnd.IntN(3)) * time.Millisecond)
		case 4: // half a header, then gone
			c.Write(readHeader(base+off, n, v2)[:1+rnd.IntN(HeaderSize-1)])
		case 5: // a large answer abandoned with a reset
			c.(*net.TCPConn).SetReadBuffer(64 << 10)
			c.Write(readHeader(base, size, true))
			io.CopyN(io.Discard, c, int64(rnd.IntN(1<<20)))
			c.(*net.TCPConn).SetLinger(0)
		case 6: // served, then idle until the end
			c.Write(readHeader(base+off, n, v2))
			if v2 {
				n += StatusSize
			}
			io.CopyN(io.Discard, c, int64(n))
			idle = append(idle, c)
			continue
		}
		c.Close()
	}
}

// TestEventLoopCloseRace: Close while peers connect, get answers, are
// handed over, abandon answers, idle, and while revokes cut answers in
// flight. Close returns, every count is back to zero, no goroutine and no
// descriptor is left, and no descriptor the test itself holds is closed
// or replaced under it.
func TestEventLoopCloseRace(t *testing.T) {
	fds0, err := countFDs()
	if err != nil {
		t.Skipf("cannot count descriptors: %v", err)
	}
	base := runtime.NumGoroutine()
	const size = 8 << 20
	mem := mmap(t, size)
	for i := range mem {
		mem[i] = byte(i)
	}
	var k canaries
	defer k.close()
	var reads, handoffs, cuts float64
	for round := range 12 {
		cfg := testConfig()
		cfg.FirstByteTimeout, cfg.IOTimeout, cfg.IdleTimeout = 30*time.Millisecond, 60*time.Millisecond, 60*time.Millisecond
		cfg.ReadGrants = true
		cfg.RevokeGrace = time.Millisecond
		cfg.NoEventLoop = round%4 == 3 // the goroutine path, for comparison
		srv, err := NewTCPEngine(cfg, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := srv.Register(AddrOf(mem), size, ""); err != nil {
			t.Fatal(err)
		}
		// The upper half stays granted; the lower half is granted and
		// revoked over and over (revokes cut the answers still on it).
		lower, upper := Range{Addr: AddrOf(mem), Length: size / 2}, Range{Addr: AddrOf(mem) + size/2, Length: size / 2}
		srv.Grant(upper)
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for w := range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				hostileClient(dataAddr(srv), AddrOf(mem), size, uint64(round*10+w), stop)
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				srv.Grant(lower)
				time.Sleep(time.Millisecond)
				srv.RevokeAsync(lower)
			}
		}()
		canaryErr := make(chan error, 1)
		canaryStop := make(chan struct{})
		go func() {
			for {
				select {
				case <-canaryStop:
					canaryErr <- k.check()
					return
				default:
				}
				if err := k.churn(); err != nil {
					canaryErr <- err
					return
				}
				runtime.Gosched()
			}
		}()
		time.Sleep(time.Duration(20+round*7) * time.Millisecond) // (not asserted on)
		closed := make(chan struct{})
		go func() { srv.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(30 * time.Second):
			t.Fatalf("round %d: Close did not return", round)
		}
		close(stop)
		wg.Wait()
		close(canaryStop)
		if err := <-canaryErr; err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		settled(t, srv)
		reads += testutil.ToFloat64(srv.m.serveReadOps)
		handoffs += testutil.ToFloat64(srv.m.loopHandoffs)
		cuts += testutil.ToFloat64(srv.m.grantCuts)
		if n := srv.grants.pendingRevokes(); n != 0 {
			t.Errorf("round %d: %d revokes still wait for answers after Close", round, n)
		}
	}
	t.Logf("%v reads served, %v connections handed over, %v answers cut", reads, handoffs, cuts)
	k.close()
	checkGoroutines(t, base)
	var fds int
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if fds, _ = countFDs(); fds <= fds0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d descriptors open after every engine closed, %d before", fds, fds0)
		}
	}
}

// TestEventLoopAccounting: after each way a connection can end (timeouts
// for a first byte, idleness, a partial header and a stalled answer; peer
// resets; refusals by the caps and the descriptor reserve), every count is
// back to zero and the outcome is counted as on the goroutine path.
func TestEventLoopAccounting(t *testing.T) {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	timedOut := func(why string) func(*TCPEngine) float64 {
		return func(srv *TCPEngine) float64 {
			return testutil.ToFloat64(srv.m.connTimedOut.WithLabelValues(portData, why))
		}
	}
	refused := func(why string) func(*TCPEngine) float64 {
		return func(srv *TCPEngine) float64 {
			return testutil.ToFloat64(srv.m.connRefused.WithLabelValues(portData, why))
		}
	}
	reset := func(c net.Conn) {
		c.(*net.TCPConn).SetLinger(0)
		c.Close()
	}
	cases := []struct {
		name    string
		cfg     func(*TCPConfig)
		run     func(t *testing.T, srv *TCPEngine, mem []byte)
		counter func(*TCPEngine) float64 // counts the outcome once (nil: none)
	}{
		{"first byte timeout", nil, func(t *testing.T, srv *TCPEngine, _ []byte) {
			closedByServer(t, dialFrom(t, "127.0.0.1", dataAddr(srv)))
		}, timedOut(timeoutFirstByte)},
		{"idle timeout", nil, func(t *testing.T, srv *TCPEngine, mem []byte) {
			c := dialFrom(t, "127.0.0.1", dataAddr(srv))
			c.Write(readHeader(AddrOf(mem), 4096, true))
			c.SetReadDeadline(time.Now().Add(20 * time.Second))
			if _, err := io.ReadFull(c, make([]byte, StatusSize+4096)); err != nil {
				t.Fatal(err)
			}
			closedByServer(t, c)
		}, timedOut(timeoutIdle)},
		{"partial header timeout", nil, func(t *testing.T, srv *TCPEngine, mem []byte) {
			c := dialFrom(t, "127.0.0.1", dataAddr(srv))
			c.Write(readHeader(AddrOf(mem), 4096, true)[:10])
			closedByServer(t, c)
		}, nil},
		{"partial second header timeout", nil, func(t *testing.T, srv *TCPEngine, mem []byte) {
			c := dialFrom(t, "127.0.0.1", dataAddr(srv))
			c.Write(readHeader(AddrOf(mem), 4096, false))
			c.SetReadDeadline(time.Now().Add(20 * time.Second))
			if _, err := io.ReadFull(c, make([]byte, 4096)); err != nil {
				t.Fatal(err)
			}
			c.Write(readHeader(AddrOf(mem), 4096, false)[:23])
			closedByServer(t, c)
		}, nil},
		{"stalled answer timeout", nil, func(t *testing.T, srv *TCPEngine, mem []byte) {
			stalledRead(t, srv, AddrOf(mem), uint64(len(mem)))
			waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 0 })
		}, nil},
		{"reset before a header", nil, func(t *testing.T, srv *TCPEngine, _ []byte) {
			c := dialFrom(t, "127.0.0.1", dataAddr(srv))
			waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 1 })
			reset(c)
		}, nil},
		{"reset in a header", nil, func(t *testing.T, srv *TCPEngine, mem []byte) {
			c := dialFrom(t, "127.0.0.1", dataAddr(srv))
			c.Write(readHeader(AddrOf(mem), 10, true)[:7])
			waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 1 })
			reset(c)
		}, nil},
		{"reset in an answer", nil, func(t *testing.T, srv *TCPEngine, mem []byte) {
			reset(stalledRead(t, srv, AddrOf(mem), uint64(len(mem))))
		}, nil},
		{"reset after a handover", nil, func(t *testing.T, srv *TCPEngine, mem []byte) {
			c := stalledRead(t, srv, AddrOf(mem), uint64(len(mem)))
			c.Write(append(readHeader(AddrOf(mem), 10, true), readHeader(AddrOf(mem), 10, true)...))
			reset(c)
		}, nil},
		{"total cap", func(c *TCPConfig) { c.MaxConns, c.MaxConnsPerPeer = 2, 2 }, func(t *testing.T, srv *TCPEngine, _ []byte) {
			dialFrom(t, "127.0.0.1", dataAddr(srv))
			dialFrom(t, "127.0.0.2", dataAddr(srv))
			waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 2 })
			refusedAt(t, "127.0.0.3", dataAddr(srv))
		}, refused(refusedTotalCap)},
		{"peer cap", func(c *TCPConfig) { c.MaxConns, c.MaxConnsPerPeer = 4, 1 }, func(t *testing.T, srv *TCPEngine, _ []byte) {
			dialFrom(t, "127.0.0.1", dataAddr(srv))
			dialFrom(t, "127.0.0.1", dataAddr(srv))
			waitFor(t, func() bool { return srv.portOpen(srv.dataConns) == 2 })
			refusedAt(t, "127.0.0.1", dataAddr(srv))
		}, refused(refusedPeerCap)},
		{"descriptor reserve", func(c *TCPConfig) {
			c.FDReserve = int(min(rl.Cur, 1<<30)) // never room: whatever else opens or closes meanwhile
		}, func(t *testing.T, srv *TCPEngine, _ []byte) {
			refusedAt(t, "127.0.0.1", dataAddr(srv))
		}, refused(refusedFDReserve)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig()
			cfg.FirstByteTimeout, cfg.IdleTimeout, cfg.IOTimeout = 100*time.Millisecond, 100*time.Millisecond, 200*time.Millisecond
			if tc.cfg != nil {
				tc.cfg(&cfg)
			}
			for _, en := range loopEngines(t, cfg, 16<<20) {
				tc.run(t, en.srv, en.mem)
				settled(t, en.srv)
				if tc.counter != nil {
					// Counted just after the close the peer sees (both
					// paths): poll.
					for deadline := time.Now().Add(10 * time.Second); tc.counter(en.srv) != 1; time.Sleep(5 * time.Millisecond) {
						if time.Now().After(deadline) {
							t.Fatalf("%s: counted %v times, want 1", en.name, tc.counter(en.srv))
						}
					}
				}
				en.srv.Close()
				settled(t, en.srv)
			}
		})
	}
}

// TestEventLoopFastReaderShares: a peer reading a 1 GiB answer as fast as
// it can does not hold the event loop while others wait: a connection
// whose header is already in the kernel is accepted while the big answer
// moves on by a few chunks (the socket buffers and a turn or two of the
// loop), not by hundreds of MiB. A bound in bytes, not in time, measured
// from the small read's header written to the loop accepting its
// connection (loopAcceptHook): every delay of the test's own goroutines
// only shrinks it. On the goroutine path, to the small answer's arrival.
func TestEventLoopFastReaderShares(t *testing.T) {
	const big = 1 << 30
	var got atomic.Int64        // the big answer's bytes read so far
	var acceptedAt atomic.Int64 // got when the loop last accepted
	loopAcceptHook = func(int) { acceptedAt.Store(got.Load()) }
	t.Cleanup(func() { loopAcceptHook = nil })
	cfg := testConfig()
	cfg.IOTimeout = 30 * time.Second
	for _, en := range loopEngines(t, cfg, 1<<16) {
		t.Run(en.name, func(t *testing.T) {
			got.Store(0)
			mem := mmap(t, big) // never written: the kernel reads zero pages
			if err := en.srv.Register(AddrOf(mem), big, ""); err != nil {
				t.Fatal(err)
			}
			a := dialFrom(t, "127.0.0.1", dataAddr(en.srv))
			// A fixed receive buffer (no autotuning to 32 MiB): what a
			// reader drains while the target writes nothing stays small.
			a.(*net.TCPConn).SetReadBuffer(1 << 20)
			a.SetDeadline(time.Now().Add(60 * time.Second))
			if _, err := a.Write(readHeader(AddrOf(mem), big, true)); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() {
				buf := make([]byte, 4<<20)
				for got.Load() < big+StatusSize {
					n, err := a.Read(buf)
					got.Add(int64(n))
					if err != nil {
						done <- err
						return
					}
				}
				done <- nil
			}()
			waitFor(t, func() bool { return got.Load() > 0 })
			const bound = 64 << 20
			worst, reads := int64(0), 0
			for got.Load() < big-bound {
				b := dialFrom(t, "127.0.0.1", dataAddr(en.srv))
				b.SetDeadline(time.Now().Add(60 * time.Second))
				acceptedAt.Store(-1)
				if _, err := b.Write(readHeader(AddrOf(en.mem)+5, 100, true)); err != nil {
					t.Fatal(err)
				}
				before := got.Load()
				ans := make([]byte, StatusSize+100)
				if _, err := io.ReadFull(b, ans); err != nil || !bytes.Equal(ans, answer(en.mem, 5, 100, true)) {
					t.Fatalf("small read %d: %v", reads, err)
				}
				at := got.Load()
				if en.srv.loop != nil {
					at = acceptedAt.Load()
				}
				worst = max(worst, at-before)
				reads++
				b.Close()
			}
			if err := <-done; err != nil {
				t.Fatalf("the big answer: %v after %d bytes", err, got.Load())
			}
			t.Logf("%d small reads while 1 GiB streamed; the big answer moved by at most %d MiB during one", reads, worst>>20)
			if worst > bound {
				t.Errorf("a small read waited while the big answer moved by %d MiB (bound %d MiB): the loop wrote it without letting others in", worst>>20, bound>>20)
			}
			a.Close()
			settled(t, en.srv)
		})
	}
}

// TestEventLoopHostileNeighbours: a peer with a tiny receive window that
// asks for 1 GiB and never reads, and a flood of silent connections up to
// the total cap from many addresses, do not keep another peer's small
// one-shot reads from being answered; the connection beyond the cap is
// refused; everything is counted back to zero once they go.
func TestEventLoopHostileNeighbours(t *testing.T) {
	const big = 1 << 30
	cfg := testConfig()
	cfg.MaxConns, cfg.MaxConnsPerPeer = 64, 8
	cfg.FirstByteTimeout, cfg.IOTimeout = time.Minute, time.Minute // the test ends them
	for _, en := range loopEngines(t, cfg, 1<<20) {
		t.Run(en.name, func(t *testing.T) {
			mem := mmap(t, big)
			if err := en.srv.Register(AddrOf(mem), big, ""); err != nil {
				t.Fatal(err)
			}
			hog := dialFrom(t, "127.0.0.1", dataAddr(en.srv))
			hog.(*net.TCPConn).SetReadBuffer(4096)
			if _, err := hog.Write(readHeader(AddrOf(mem), big, true)); err != nil {
				t.Fatal(err)
			}
			var silent []net.Conn
			for i := range 62 { // the hog, these, and one slot for the reader
				silent = append(silent, dialFrom(t, fmt.Sprintf("127.0.1.%d", 1+i/4), dataAddr(en.srv)))
			}
			waitFor(t, func() bool { return en.srv.portOpen(en.srv.dataConns) == 63 })
			for i := range 100 {
				off := i * 977
				c := dialFrom(t, "127.0.0.1", dataAddr(en.srv))
				c.SetDeadline(time.Now().Add(20 * time.Second))
				if _, err := c.Write(readHeader(AddrOf(en.mem)+uint64(off), 4096, i%2 == 0)); err != nil {
					t.Fatal(err)
				}
				want := answer(en.mem, off, 4096, i%2 == 0)
				got := make([]byte, len(want))
				if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, want) {
					t.Fatalf("read %d among hostile neighbours: %v", i, err)
				}
				c.Close()
				waitFor(t, func() bool { return en.srv.portOpen(en.srv.dataConns) == 63 })
			}
			dialFrom(t, "127.0.0.1", dataAddr(en.srv))
			waitFor(t, func() bool { return en.srv.portOpen(en.srv.dataConns) == 64 })
			refusedAt(t, "127.0.0.2", dataAddr(en.srv))
			if n := testutil.ToFloat64(en.srv.m.connRefused.WithLabelValues(portData, refusedTotalCap)); n != 1 {
				t.Errorf("total_cap refusals %v, want 1", n)
			}
			hog.(*net.TCPConn).SetLinger(0)
			hog.Close()
			for _, c := range silent {
				c.Close()
			}
			en.srv.Close()
			settled(t, en.srv)
		})
	}
}

// acceptLog records the engine's "accept failed" lines of its data port
// (data: its address as the goroutine path logs it).
type acceptLog struct {
	mu       sync.Mutex
	data     string
	backoffs []time.Duration
	errs     []string
}

func (h *acceptLog) Enabled(context.Context, slog.Level) bool { return true }
func (h *acceptLog) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *acceptLog) WithGroup(string) slog.Handler            { return h }
func (h *acceptLog) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "accept failed" {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	var data bool
	var backoff time.Duration
	var err string
	r.Attrs(func(a slog.Attr) bool {
		switch a.Key {
		case "port":
			data = a.Value.String() == portData
		case "addr":
			data = a.Value.String() == h.data
		case "backoff":
			backoff = a.Value.Duration()
		case "err":
			err = fmt.Sprint(a.Value.Any())
		}
		return true
	})
	if data {
		h.backoffs, h.errs = append(h.backoffs, backoff), append(h.errs, err)
	}
	return nil
}

func (h *acceptLog) failures() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.backoffs)
}

// TestEventLoopEMFILE: with no descriptor left under RLIMIT_NOFILE, accept
// fails (EMFILE) with the connection left in the backlog: the engine
// stops trying for a backoff that doubles each time (it does not spin on
// a listener that stays readable), and once descriptors are free again
// it accepts the waiting connection and serves it.
func TestEventLoopEMFILE(t *testing.T) {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	for _, noLoop := range []bool{false, true} {
		t.Run(map[bool]string{false: "loop", true: "goroutines"}[noLoop], func(t *testing.T) {
			h := &acceptLog{}
			cfg := testConfig()
			cfg.NoEventLoop, cfg.FDReserve = noLoop, 0 // the reserve would refuse first
			srv, err := NewTCPEngine(cfg, nil, slog.New(h))
			if err != nil {
				t.Fatal(err)
			}
			defer srv.Close()
			h.mu.Lock()
			h.data = dataAddr(srv)
			h.mu.Unlock()
			mem := register(t, srv, 1<<16, 4)
			// The peer's socket is made before the limit is lowered.
			fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer syscall.Close(fd)
			tv := syscall.Timeval{Sec: 20}
			syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_RCVTIMEO, &tv)
			// The lowest free descriptor is the next one accept takes:
			// with the soft limit there, accept fails.
			free, err := syscall.Dup(0)
			if err != nil {
				t.Fatal(err)
			}
			syscall.Close(free)
			low := rl
			low.Cur = uint64(free)
			if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
				t.Skipf("cannot lower RLIMIT_NOFILE: %v", err)
			}
			restored := false
			restore := func() {
				if !restored {
					if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
						t.Fatalf("restore RLIMIT_NOFILE: %v", err)
					}
					restored = true
				}
			}
			defer restore()
			if err := syscall.Connect(fd, &syscall.SockaddrInet4{Port: srv.DataPort(), Addr: [4]byte{127, 0, 0, 1}}); err != nil {
				restore()
				t.Fatalf("connect: %v", err)
			}
			for deadline := time.Now().Add(10 * time.Second); h.failures() < 3; time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					restore()
					t.Fatalf("%d accept failures logged in 10 s under EMFILE, want 3", h.failures())
				}
			}
			restore()
			if _, err := syscall.Write(fd, readHeader(AddrOf(mem)+7, 100, true)); err != nil {
				t.Fatal(err)
			}
			want := answer(mem, 7, 100, true)
			var got []byte
			buf := make([]byte, 256)
			for len(got) < len(want) {
				n, err := syscall.Read(fd, buf)
				if err != nil || n == 0 {
					t.Fatalf("answer after EMFILE: %d bytes, then %d, %v", len(got), n, err)
				}
				got = append(got, buf[:n]...)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("answer after EMFILE differs: %x", got)
			}
			h.mu.Lock()
			backoffs, errs := h.backoffs, h.errs
			h.mu.Unlock()
			for i := 1; i < 3; i++ {
				if backoffs[i] <= backoffs[i-1] {
					t.Errorf("backoffs %v: not growing (errors %q)", backoffs, errs)
				}
			}
			if !strings.Contains(errs[0], "too many open files") {
				t.Errorf("accept failed with %q, want EMFILE", errs[0])
			}
			syscall.Close(fd)
			settled(t, srv)
		})
	}
}

// FuzzEventLoopStream: any stream of requests (reads in and out of the
// region, v1 and v2, garbage) in any segmentation gets the same answer
// from the event loop as from the goroutine path, and panics neither.
// Each 6 bytes of input is one step: kind (a read in the region, one
// past it, garbage, a segment boundary), flags, offset, size.
func FuzzEventLoopStream(f *testing.F) {
	const size = 128 << 10
	var engines [2]*TCPEngine
	var bases [2]uint64
	for i, noLoop := range []bool{false, true} {
		cfg := testConfig()
		cfg.NoEventLoop = noLoop
		cfg.FirstByteTimeout, cfg.IdleTimeout = 2*time.Second, 2*time.Second
		engines[i], _ = newEngine(f, cfg)
		bases[i] = AddrOf(register(f, engines[i], size, 5))
	}
	f.Add([]byte{0, 1, 0, 0, 0, 99})
	f.Add([]byte{0, 0, 1, 0, 16, 0, 7, 0, 0, 0, 0, 0, 1, 1, 0, 2, 0, 2})
	f.Add([]byte{0, 1, 0, 0, 255, 255, 5, 1, 0, 0, 0, 9, 6, 0, 0, 0, 30, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		var outs [2][]byte
		for i, srv := range engines {
			var segs [][]byte
			var cur []byte
		steps:
			for d := data; len(d) >= 6; d = d[6:] {
				v2 := d[1]&1 == 1
				off := uint64(binary.LittleEndian.Uint16(d[2:]))
				n := 1 + uint64(binary.LittleEndian.Uint16(d[4:]))
				switch k := d[0] % 8; {
				case k <= 4:
					cur = append(cur, readHeader(bases[i]+off, min(n, size-off), v2)...)
				case k == 5:
					cur = append(cur, readHeader(bases[i]+size+off, n, v2)...)
				case k == 6:
					// Garbage ends the stream: a header read across it
					// would hold the region's address, which differs
					// between the two engines.
					cur = append(cur, bytes.Repeat([]byte{d[1]}, int(n%40))...)
					break steps
				default:
					if len(cur) > 0 {
						segs, cur = append(segs, cur), nil
					}
				}
			}
			if len(cur) > 0 {
				segs = append(segs, cur)
			}
			c, err := net.DialTimeout("tcp", dataAddr(srv), 5*time.Second)
			if err != nil {
				t.Fatalf("engine %d: %v", i, err)
			}
			c.SetDeadline(time.Now().Add(30 * time.Second))
			got := make(chan []byte, 1)
			go func() {
				out, _ := io.ReadAll(c)
				got <- out
			}()
			for _, s := range segs {
				if _, err := c.Write(s); err != nil {
					break
				}
				time.Sleep(100 * time.Microsecond) // separate segments (not asserted on)
			}
			c.(*net.TCPConn).CloseWrite()
			select {
			case outs[i] = <-got:
			case <-time.After(10 * time.Second):
				t.Fatalf("engine %d: not closed in 10 s (segments %d, %x)", i, len(segs), head(bytes.Join(segs, nil)))
			}
			c.Close()
		}
		if !bytes.Equal(outs[0], outs[1]) {
			t.Fatalf("loop %d bytes %x…, goroutines %d bytes %x…", len(outs[0]), head(outs[0]), len(outs[1]), head(outs[1]))
		}
	})
}
