package mooncake

import (
	"io"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// bareTarget is the floor for a Go target serving one-shot connections:
// accept, one goroutine per connection, a 24-byte header read into the
// stack, the v2 status and the block in one writev, then wait for the
// peer's close. No admission, deadlines, buffers or metrics.
func bareTarget(tb testing.TB, mem []byte) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				var hb [HeaderSize]byte
				if _, err := io.ReadFull(c, hb[:]); err != nil {
					return
				}
				h, err := ParseHeader(&hb)
				if err != nil || h.Addr < AddrOf(mem) || h.Addr+h.Size > AddrOf(mem)+uint64(len(mem)) {
					return
				}
				var st [StatusSize]byte
				PutStatus(&st, StatusOK)
				bufs := net.Buffers{st[:], bytesAt(h.Addr, h.Size)}
				if _, err := bufs.WriteTo(c); err != nil {
					return
				}
				io.Copy(io.Discard, c)
			}()
		}
	}()
	tb.Cleanup(func() { ln.Close(); <-done })
	return ln.Addr().String()
}

// oneShotBatch reads count blocks of size bytes the way Mooncake's
// initiator does with its connection pool off (its default): per request
// a new connection, dialled and sent its header by the submitting
// goroutine, its answer read by another, then closed.
func oneShotBatch(tb testing.TB, addr string, src, dst []byte, count, size int) {
	conns := make(chan net.Conn, count)
	errc := make(chan error, 1)
	go func() {
		var st [StatusSize]byte
		for i := range count {
			c := <-conns
			if c == nil {
				errc <- nil
				return
			}
			_, err := io.ReadFull(c, st[:])
			if err == nil {
				_, err = io.ReadFull(c, dst[i*size:(i+1)*size])
			}
			c.Close()
			if err != nil {
				for c := range conns {
					if c == nil {
						break
					}
					c.Close()
				}
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	for i := range count {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			conns <- nil
			<-errc
			tb.Fatal(err)
		}
		var hb [HeaderSize]byte
		PutHeader(&hb, Header{Size: uint64(size), Addr: AddrOf(src) + uint64(i*size), Opcode: OpcodeRead, V2: true})
		if _, err := c.Write(hb[:]); err != nil {
			c.Close()
			conns <- nil
			<-errc
			tb.Fatal(err)
		}
		conns <- c
	}
	if err := <-errc; err != nil {
		tb.Fatal(err)
	}
}

// BenchmarkOneShotRead measures the target's cost of a new connection:
// batches of 128 one-shot READs (a connection each, Mooncake's default
// initiator) against kvflow's target and against bareTarget, interleaved
// batch by batch in the same run. Reports kvflow_GB/s, bare_GB/s and
// ratio (kvflow/bare). ns/op is one kvflow batch plus one bare batch.
//
//	go test -run '^$' -bench OneShotRead -benchtime 30x -count 5 ./hw/mooncake/
func BenchmarkOneShotRead(b *testing.B) {
	const count = 128
	for _, size := range []int{4 << 10, 64 << 10, 256 << 10, 1 << 20} {
		b.Run(sizeName(size), func(b *testing.B) {
			target, _ := newEngine(b, testConfig())
			src := register(b, target, count*size, 3)
			kv := net.JoinHostPort("127.0.0.1", strconv.Itoa(target.DataPort()))
			bare := bareTarget(b, src)
			dst := mmap(b, count*size)
			var tk, tbare time.Duration
			b.SetBytes(int64(2 * count * size))
			for b.Loop() {
				t0 := time.Now()
				oneShotBatch(b, kv, src, dst, count, size)
				t1 := time.Now()
				oneShotBatch(b, bare, src, dst, count, size)
				tk, tbare = tk+t1.Sub(t0), tbare+time.Since(t1)
			}
			if string(dst[:size]) != string(src[:size]) {
				b.Fatal("bytes differ")
			}
			bytes := float64(b.N) * count * float64(size)
			b.ReportMetric(bytes/tk.Seconds()/1e9, "kvflow_GB/s")
			b.ReportMetric(bytes/tbare.Seconds()/1e9, "bare_GB/s")
			b.ReportMetric(tbare.Seconds()/tk.Seconds(), "ratio")
		})
	}
}

// TestOneShotConnections: a hundred connections, each one or a few READs
// (v1 and v2, small ones coalesced and large ones streamed), then closed,
// as Mooncake's default initiator does: every byte is right on every
// connection although the target reuses its per-connection buffers, and
// once all are closed no connection is counted and no region is pinned.
func TestOneShotConnections(t *testing.T) {
	srv, _ := newEngine(t, testConfig())
	src := register(t, srv, 4<<20, 9)
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(srv.DataPort()))
	sizes := []int{1, 100, 4096, 64 << 10, 256 << 10, 256<<10 + 1, 1 << 20, 3<<20 + 5}
	for i := range 120 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		v2 := i%3 != 0
		n := 1 + i%4 // requests pipelined on this connection
		var hdrs []byte
		var want []byte
		for k := range n {
			size := sizes[(i+k)%len(sizes)]
			off := (i*7919 + k*104729) % (len(src) - size)
			var hb [HeaderSize]byte
			PutHeader(&hb, Header{Size: uint64(size), Addr: AddrOf(src) + uint64(off), Opcode: OpcodeRead, V2: v2})
			hdrs = append(hdrs, hb[:]...)
			if v2 {
				var st [StatusSize]byte
				PutStatus(&st, StatusOK)
				want = append(want, st[:]...)
			}
			want = append(want, src[off:off+size]...)
		}
		if _, err := c.Write(hdrs); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(want))
		if _, err := io.ReadFull(c, got); err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		if string(got) != string(want) {
			t.Fatalf("connection %d (%d requests, v2 %v): bytes differ", i, n, v2)
		}
		c.Close()
	}
	waitFor(t, func() bool { return testutil.ToFloat64(srv.m.targetConns) == 0 })
	if err := srv.Unregister(AddrOf(src)); err != nil { // waits for pins
		t.Fatal(err)
	}
}
