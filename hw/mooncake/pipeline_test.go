package mooncake

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// pipelineConfig: one lane with a deep window, so requests of concurrent
// batches are outstanding on the same connection together.
func pipelineConfig() TCPConfig {
	c := testConfig()
	c.Lanes, c.Pipeline = 1, 8
	return c
}

// TestPipelinedReject runs a good batch and a batch with one refused op
// concurrently on one pipelined lane, against v1 and v2 targets. The
// target closes the connection after the refusal with other requests
// outstanding behind it: the good batch must still complete with the
// right bytes (its requests are sent again), the bad one must fail on the
// refused op, never report it done, and nothing hangs or leaks.
func TestPipelinedReject(t *testing.T) {
	for _, proto := range []int{1, 2} {
		t.Run("v"+string(rune('0'+proto)), func(t *testing.T) {
			base := runtime.NumGoroutine()
			func() {
				scfg := testConfig()
				scfg.ProtoVersion = proto
				srv, _ := newEngine(t, scfg)
				cli, _ := newEngine(t, pipelineConfig())
				defer srv.Close()
				defer cli.Close()
				const n, size = 64, 32 << 10
				rem := register(t, srv, n*size, 1)
				unreg := mmap(t, size)
				loc := register(t, cli, 2*n*size, 2)
				for iter := range 10 {
					clear(loc)
					var good, bad []Op
					for i := range n {
						good = append(good, Op{Local: AddrOf(loc[i*size:]), Remote: AddrOf(rem[i*size:]), Length: size})
					}
					for i := range 8 {
						r := AddrOf(rem[i*size:])
						if i == 3 {
							r = AddrOf(unreg)
						}
						bad = append(bad, Op{Local: AddrOf(loc[(n+i)*size:]), Remote: r, Length: size})
					}
					var wg sync.WaitGroup
					var gerr, berr error
					wg.Go(func() { gerr = cli.BatchRead(context.Background(), srv.SessionID(), good) })
					wg.Go(func() { berr = cli.BatchRead(context.Background(), srv.SessionID(), bad) })
					wg.Wait()
					if gerr != nil {
						t.Fatalf("iter %d: good batch: %v", iter, gerr)
					}
					if !bytes.Equal(loc[:n*size], rem) {
						t.Fatalf("iter %d: good batch: data mismatch", iter)
					}
					var be *BatchError
					if !errors.As(berr, &be) {
						t.Fatalf("iter %d: bad batch: got %v, want a BatchError", iter, berr)
					}
					if be.Errs[3] == nil || errors.Is(be.Errs[3], ErrNotAttempted) {
						t.Fatalf("iter %d: refused op: %v", iter, be.Errs[3])
					}
					want := ErrRejected
					if proto == 1 {
						want = ErrPeerClosed
					}
					if !errors.Is(be.Errs[3], want) {
						t.Fatalf("iter %d: refused op: %v, want %v", iter, be.Errs[3], want)
					}
				}
			}()
			checkGoroutines(t, base)
		})
	}
}

// TestPipelinedCancel cancels a batch whose requests share a pipelined
// lane with another batch's: the cancelled one reports its context error,
// the other completes with the right bytes (its aborted requests are sent
// again), and no goroutine is left behind.
func TestPipelinedCancel(t *testing.T) {
	base := runtime.NumGoroutine()
	func() {
		srv, _ := newEngine(t, testConfig())
		cli, _ := newEngine(t, pipelineConfig())
		defer srv.Close()
		defer cli.Close()
		const n, size = 64, 128 << 10
		rem := register(t, srv, n*size, 1)
		loc := register(t, cli, 2*n*size, 2)
		for iter := range 10 {
			clear(loc)
			var a, b []Op
			for i := range n {
				a = append(a, Op{Local: AddrOf(loc[i*size:]), Remote: AddrOf(rem[i*size:]), Length: size})
				b = append(b, Op{Local: AddrOf(loc[(n+i)*size:]), Remote: AddrOf(rem[i*size:]), Length: size})
			}
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			var aerr, berr error
			wg.Go(func() { aerr = cli.BatchRead(context.Background(), srv.SessionID(), a) })
			wg.Go(func() { berr = cli.BatchRead(ctx, srv.SessionID(), b) })
			time.Sleep(time.Duration(iter) * 200 * time.Microsecond)
			cancel()
			wg.Wait()
			if aerr != nil {
				t.Fatalf("iter %d: batch sharing the lane: %v", iter, aerr)
			}
			if !bytes.Equal(loc[:n*size], rem) {
				t.Fatalf("iter %d: data mismatch", iter)
			}
			if berr != nil && !errors.Is(berr, context.Canceled) {
				t.Fatalf("iter %d: cancelled batch: %v, want nil or context.Canceled", iter, berr)
			}
		}
	}()
	checkGoroutines(t, base)
}

// TestServerCoalesced sends, in one socket write, small READ headers, a
// WRITE with its payload, more READs, a large READ and a refused READ, to
// a v2 target: the answers come back in order with the right bytes (the
// small ones gathered into shared writes), the WRITE lands, and the
// refusal comes after every answer before it.
func TestServerCoalesced(t *testing.T) {
	srv, _ := newEngine(t, testConfig())
	defer srv.Close()
	rem := register(t, srv, 4<<20, 9)
	var req, want []byte
	hdr := func(op uint8, addr, size uint64) {
		var hb [HeaderSize]byte
		PutHeader(&hb, Header{Size: size, Addr: addr, Opcode: op, V2: true})
		req = append(req, hb[:]...)
	}
	var ok, rej [StatusSize]byte
	PutStatus(&ok, StatusOK)
	PutStatus(&rej, StatusRejected)
	read := func(off, size int) {
		hdr(OpcodeRead, AddrOf(rem[off:]), uint64(size))
		want = append(append(want, ok[:]...), rem[off:off+size]...)
	}
	for i := range 70 { // more than one gathered write
		read(i*4096, 100+i*37)
	}
	payload := bytes.Repeat([]byte{0x5a}, 8192)
	hdr(OpcodeWrite, AddrOf(rem[3<<20:]), uint64(len(payload)))
	req = append(req, payload...)
	want = append(want, ok[:]...)
	hdr(OpcodeRead, AddrOf(rem[3<<20:]), 8192) // reads the WRITE's bytes back
	want = append(append(want, ok[:]...), payload...)
	read(1<<20, 1<<20)
	read(5, 3)
	hdr(OpcodeRead, AddrOf(rem)+8<<20, 4096) // outside the region
	want = append(want, rej[:]...)
	read(0, 64) // behind the refusal: never served

	c := dial(t, srv.DataPort())
	defer c.Close()
	if _, err := c.Write(req); err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	got, _ := io.ReadAll(c)
	if !bytes.Equal(got, want[:len(want)-StatusSize-64]) {
		t.Fatalf("got %d bytes, want %d; first difference at %d", len(got), len(want)-StatusSize-64, firstDiff(got, want))
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// newHeaderPeer is a raw peer whose data connection reads headers as they
// arrive, on a goroutine of its own, counting them in got (at most n
// queued) and handing them to serve, which answers them on c.
func newHeaderPeer(t *testing.T, n int, got *atomic.Int64, serve func(c net.Conn, hdrs <-chan Header)) *fakePeer {
	t.Helper()
	return newRawPeer(t, func(c net.Conn) {
		hdrs := make(chan Header, n)
		var wg sync.WaitGroup
		wg.Go(func() {
			defer close(hdrs)
			var hb [HeaderSize]byte
			for {
				if _, err := io.ReadFull(c, hb[:]); err != nil {
					return
				}
				h, _ := ParseHeader(&hb)
				got.Add(1)
				hdrs <- h
			}
		})
		serve(c, hdrs)
		c.Close()
		wg.Wait()
	})
}

// TestWindowRefillsAtHalf checks that a lane refills its READ window in
// batches, once half of it has been answered (by count here; by bytes
// alike), not one header per response. The target answers all but half of
// the first window plus one, then pauses: the client must not write any
// header meanwhile. After one more response it refills the window.
func TestWindowRefillsAtHalf(t *testing.T) {
	const window, n, size = 8, 64, 4 << 10
	var got atomic.Int64          // headers the target has read
	paused := make(chan int64, 1) // headers seen during the pause
	f := newHeaderPeer(t, n, &got, func(c net.Conn, hdrs <-chan Header) {
		k := 0
		for h := range hdrs {
			if k == window/2-1 {
				// Window/2 + 1 requests are outstanding now.
				time.Sleep(100 * time.Millisecond)
				paused <- got.Load()
			}
			if !serveOK(c, h) {
				break
			}
			k++
		}
	})
	cfg := testConfig()
	cfg.Lanes, cfg.Pipeline, cfg.PipelineBytes = 1, window, 0
	cli, _ := newEngine(t, cfg)
	defer cli.Close()
	loc := register(t, cli, n*size, 1)
	if err := cli.BatchRead(context.Background(), f.session(), readOps(loc, n, size)); err != nil {
		t.Fatal(err)
	}
	if h := <-paused; h != window {
		t.Fatalf("with %d of %d requests answered, the target had read %d headers, want %d (the window refilled one slot at a time)",
			window/2-1, window, h, window)
	}
	if got.Load() != n {
		t.Fatalf("target read %d headers, want %d", got.Load(), n)
	}
}

// TestWindowRefillsWhileStreaming: an answer partly buffered must not
// keep the lane from refilling its window once half of it is answered
// (draining "while anything is buffered" would empty the window first and
// idle the target for a round trip). The target answers two of four
// requests and half of the third, then pauses: by then the client must
// have sent two more headers.
func TestWindowRefillsWhileStreaming(t *testing.T) {
	const window, n, size = 4, 16, 64 << 10
	var got atomic.Int64
	paused := make(chan int64, 1)
	f := newHeaderPeer(t, n, &got, func(c net.Conn, hdrs <-chan Header) {
		k := 0
		for h := range hdrs {
			if k == window/2 {
				var st [StatusSize]byte
				PutStatus(&st, StatusOK)
				c.Write(st[:])
				c.Write(make([]byte, h.Size/2))
				time.Sleep(100 * time.Millisecond)
				paused <- got.Load()
				if _, err := c.Write(make([]byte, h.Size-h.Size/2)); err != nil {
					break
				}
			} else if !serveOK(c, h) {
				break
			}
			k++
		}
	})
	cfg := testConfig()
	cfg.Lanes, cfg.Pipeline, cfg.PipelineBytes = 1, window, 0
	cli, _ := newEngine(t, cfg)
	defer cli.Close()
	loc := register(t, cli, n*size, 1)
	if err := cli.BatchRead(context.Background(), f.session(), readOps(loc, n, size)); err != nil {
		t.Fatal(err)
	}
	if h := <-paused; h < window+window/2 {
		t.Fatalf("with %d answers and a half in, the target had read %d headers, want >= %d", window/2, h, window+window/2)
	}
}
