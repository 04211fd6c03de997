package mooncake

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// fakePeer is a scripted Mooncake-like target: a real handshake on its RPC
// port, and a data port whose behaviour per request the test chooses.
type fakePeer struct {
	rpc, data net.Listener
	wg        sync.WaitGroup
	mu        sync.Mutex
	conns     []net.Conn
	served    int
	// serve handles request number n (0-based, across connections); false
	// ends the connection.
	serve func(c net.Conn, h Header, n int) bool
	reply func(t FrameType) []byte // nil: a valid TCP segment
}

func newFakePeer(t *testing.T, serve func(c net.Conn, h Header, n int) bool) *fakePeer {
	t.Helper()
	f := &fakePeer{serve: serve}
	return f.start(t, f.dataConn)
}

// newRawPeer is a fakePeer whose data connections are handled whole by h.
func newRawPeer(t *testing.T, h func(net.Conn)) *fakePeer {
	t.Helper()
	return (&fakePeer{}).start(t, h)
}

func (f *fakePeer) start(t *testing.T, data func(net.Conn)) *fakePeer {
	t.Helper()
	var err error
	if f.rpc, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	if f.data, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	f.wg.Add(2)
	go f.accept(f.rpc, f.handshake)
	go f.accept(f.data, data)
	t.Cleanup(f.kill)
	return f
}

func (f *fakePeer) session() string {
	return "127.0.0.1:" + strconv.Itoa(f.rpc.Addr().(*net.TCPAddr).Port)
}

func (f *fakePeer) accept(ln net.Listener, h func(net.Conn)) {
	defer f.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		f.mu.Lock()
		f.conns = append(f.conns, c)
		f.mu.Unlock()
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			defer c.Close()
			h(c)
		}()
	}
}

func (f *fakePeer) handshake(c net.Conn) {
	t, _, err := ReadFrame(c, DefaultMaxFrame)
	if err != nil {
		return
	}
	var reply []byte
	if f.reply != nil {
		reply = f.reply(t)
	} else {
		reply = AppendFrame(nil, FrameMetadata, EncodeSegment(&SegmentDesc{
			Name: f.session(), Protocol: "tcp", TCPDataPort: f.data.Addr().(*net.TCPAddr).Port, TCPProtoVersion: 2,
		}))
	}
	c.Write(reply)
}

func (f *fakePeer) dataConn(c net.Conn) {
	var hb [HeaderSize]byte
	for {
		if _, err := io.ReadFull(c, hb[:]); err != nil {
			return
		}
		h, _ := ParseHeader(&hb)
		f.mu.Lock()
		n := f.served
		f.served++
		f.mu.Unlock()
		if !f.serve(c, h, n) {
			return
		}
	}
}

// kill closes every socket at once, like a killed process.
func (f *fakePeer) kill() {
	f.rpc.Close()
	f.data.Close()
	f.mu.Lock()
	for _, c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
}

// serveOK answers a v2 READ with zero bytes.
func serveOK(c net.Conn, h Header) bool {
	var st [StatusSize]byte
	PutStatus(&st, StatusOK)
	c.Write(st[:])
	_, err := c.Write(make([]byte, h.Size))
	return err == nil
}

func readOps(loc []byte, n int, size int) []Op {
	ops := make([]Op, n)
	for i := range ops {
		ops[i] = Op{Local: AddrOf(loc[i*size:]), Remote: 0x10000 + uint64(i*size), Length: uint64(size)}
	}
	return ops
}

// TestPeerDies covers a peer that is killed, stops mid-frame, or stalls in
// the middle of a batch: the batch fails within the timeout with a clear
// error, no goroutine leaks, and the engine serves the next batch.
func TestPeerDies(t *testing.T) {
	cases := []struct {
		name  string
		serve func(f *fakePeer) func(c net.Conn, h Header, n int) bool
		want  error
	}{
		{"killed", func(f *fakePeer) func(net.Conn, Header, int) bool {
			return func(c net.Conn, h Header, n int) bool {
				if n == 5 {
					go f.kill()
					return false
				}
				return serveOK(c, h)
			}
		}, ErrPeerClosed},
		{"stops mid-payload", func(f *fakePeer) func(net.Conn, Header, int) bool {
			return func(c net.Conn, h Header, n int) bool {
				if n == 3 {
					var st [StatusSize]byte
					PutStatus(&st, StatusOK)
					c.Write(st[:])
					c.Write(make([]byte, h.Size/2))
					return false
				}
				return serveOK(c, h)
			}
		}, ErrPeerClosed},
		{"stops mid-status", func(f *fakePeer) func(net.Conn, Header, int) bool {
			return func(c net.Conn, h Header, n int) bool {
				if n == 2 {
					c.Write([]byte{0, 0, 0})
					return false
				}
				return serveOK(c, h)
			}
		}, ErrPeerClosed},
		{"stalls", func(f *fakePeer) func(net.Conn, Header, int) bool {
			return func(c net.Conn, h Header, n int) bool {
				if n == 4 {
					var st [StatusSize]byte
					PutStatus(&st, StatusOK)
					c.Write(st[:])
					c.Write(make([]byte, 100))
					time.Sleep(time.Second) // longer than IOTimeout
					return false
				}
				return serveOK(c, h)
			}
		}, os.ErrDeadlineExceeded},
		{"legacy framing", func(f *fakePeer) func(net.Conn, Header, int) bool {
			return func(c net.Conn, h Header, n int) bool {
				_, err := c.Write(make([]byte, h.Size)) // no status frame
				return err == nil
			}
		}, ErrBadStatus},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			base := runtime.NumGoroutine()
			cfg := testConfig()
			cfg.IOTimeout = 500 * time.Millisecond
			cli, _ := newEngine(t, cfg)
			loc := register(t, cli, 64*65536, 0)
			var f *fakePeer
			f = newFakePeer(t, func(c net.Conn, h Header, n int) bool { return tc.serve(f)(c, h, n) })
			start := time.Now()
			err := cli.BatchRead(context.Background(), f.session(), readOps(loc, 64, 65536))
			elapsed := time.Since(start)
			var be *BatchError
			if !errors.As(err, &be) || !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want a BatchError wrapping %v", err, tc.want)
			}
			if elapsed > 2*time.Second {
				t.Fatalf("took %v", elapsed)
			}
			t.Logf("%v after %v", err, elapsed)

			// The same engine keeps working with a healthy peer.
			srv, _ := newEngine(t, testConfig())
			rem := register(t, srv, 1<<20, 9)
			if err := cli.BatchRead(context.Background(), srv.SessionID(), []Op{{AddrOf(loc), AddrOf(rem), 1 << 20}}); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(loc[:1<<20], rem) {
				t.Fatal("bytes differ")
			}
			f.kill()
			cli.Close()
			srv.Close()
			checkGoroutines(t, base)
		})
	}
}

// TestEngineKilledMidBatch closes a real serving engine while a client's
// batch is in flight, and a client engine while the server serves it: the
// batch ends within the timeout, the server keeps serving its other peer.
func TestEngineKilledMidBatch(t *testing.T) {
	base := runtime.NumGoroutine()
	cfg := testConfig()
	cfg.IOTimeout = time.Second
	srv, _ := newEngine(t, cfg)
	victim, _ := newEngine(t, cfg) // a second server, killed mid-batch
	cli, _ := newEngine(t, cfg)
	other, _ := newEngine(t, cfg)
	const size, n = 1 << 20, 32
	for _, s := range []*TCPEngine{srv, victim} {
		register(t, s, size*n, 1)
	}
	rem, _ := srv.Slice(srv.Segment().Buffers[0].Addr, size*n)
	vrem := victim.Segment().Buffers[0].Addr
	loc := register(t, cli, size*n, 2)
	oloc := register(t, other, size*n, 3)

	ops := func(loc []byte, remote uint64) []Op {
		out := make([]Op, n)
		for i := range out {
			out[i] = Op{AddrOf(loc[i*size:]), remote + uint64(i*size), size}
		}
		return out
	}
	// Server killed mid-batch.
	done := make(chan error, 1)
	go func() { done <- cli.BatchRead(context.Background(), victim.SessionID(), ops(loc, vrem)) }()
	waitFor(t, func() bool { return testutil.ToFloat64(victim.m.ops.WithLabelValues(dirServeRead)) >= 1 })
	victim.Close()
	select {
	case err := <-done:
		t.Logf("batch against a killed server: %v", err) // may have finished first
	case <-time.After(3 * time.Second):
		t.Fatal("batch against a killed server did not end")
	}

	// Client killed mid-batch; the server keeps serving the other client.
	go func() { done <- cli.BatchRead(context.Background(), srv.SessionID(), ops(loc, AddrOf(rem))) }()
	waitFor(t, func() bool { return testutil.ToFloat64(srv.m.ops.WithLabelValues(dirServeRead)) >= 1 })
	cli.Close()
	select {
	case err := <-done:
		t.Logf("batch of a closed client: %v", err)
		if err != nil && !errors.Is(err, ErrClosed) {
			t.Fatalf("want ErrClosed, got %v", err)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("batch of a closed client did not end")
	}
	if err := other.BatchRead(context.Background(), srv.SessionID(), ops(oloc, AddrOf(rem))); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(oloc, rem) {
		t.Fatal("bytes differ")
	}
	if err := cli.BatchRead(context.Background(), srv.SessionID(), ops(loc, AddrOf(rem))); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: %v", err)
	}
	for _, e := range []*TCPEngine{srv, other, cli, victim} {
		e.Close()
	}
	checkGoroutines(t, base)
}

// TestCancel: a cancelled context ends a batch stuck on a silent peer
// promptly, and Unregister of its local region waits for it; Close ends
// one too.
func TestCancel(t *testing.T) {
	base := runtime.NumGoroutine()
	cfg := testConfig()
	cfg.IOTimeout = 10 * time.Second
	cli, _ := newEngine(t, cfg)
	loc := register(t, cli, 1<<20, 0)
	stall := make(chan struct{})
	f := newFakePeer(t, func(c net.Conn, h Header, n int) bool {
		<-stall
		return false
	})

	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	unregistered := make(chan time.Duration)
	start := time.Now()
	go func() {
		time.Sleep(50 * time.Millisecond)
		cli.Unregister(AddrOf(loc)) // the stuck batch pins the region
		unregistered <- time.Since(start)
	}()
	err := cli.BatchRead(ctx, f.session(), readOps(loc, 4, 4096))
	if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > time.Second {
		t.Fatalf("got %v after %v", err, time.Since(start))
	}
	if d := <-unregistered; d < 140*time.Millisecond {
		t.Fatalf("Unregister returned after %v, before the batch let go of the region", d)
	}

	loc = register(t, cli, 1<<20, 0)
	go func() { time.Sleep(100 * time.Millisecond); cli.Close() }()
	err = cli.BatchRead(context.Background(), f.session(), readOps(loc, 4, 4096))
	if !errors.Is(err, ErrClosed) {
		t.Fatalf("batch during Close: %v", err)
	}
	close(stall)
	f.kill()
	checkGoroutines(t, base)
}

// TestBadHandshakeReply: a peer whose handshake answer is wrong fails the
// batch with a handshake error.
func TestBadHandshakeReply(t *testing.T) {
	cli, _ := newEngine(t, testConfig())
	loc := register(t, cli, 4096, 0)
	cases := []struct {
		name  string
		reply func(FrameType) []byte
		want  error
	}{
		{"wrong type", func(FrameType) []byte { return AppendFrame(nil, FrameProbe, []byte(`{"status":"success"}`)) }, ErrFrameType},
		{"oversized", func(FrameType) []byte { return binary.LittleEndian.AppendUint64(nil, 2<<20) }, ErrFrameTooLarge},
		{"not json", func(FrameType) []byte { return AppendFrame(nil, FrameMetadata, []byte(`{"name":`)) }, ErrBadSegment},
		{"rdma segment", func(FrameType) []byte {
			return AppendFrame(nil, FrameMetadata, []byte(`{"name":"x","protocol":"rdma","tcp_data_port":0}`))
		}, ErrBadSegment},
		{"truncated", func(FrameType) []byte { return AppendFrame(nil, FrameMetadata, []byte(`{}`))[:9] }, io.ErrUnexpectedEOF},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakePeer(t, func(net.Conn, Header, int) bool { return false })
			f.reply = tc.reply
			err := cli.BatchRead(context.Background(), f.session(), []Op{{AddrOf(loc), 0x1000, 8}})
			if !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
			t.Log(err)
		})
	}
	// Nobody listening.
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	if err := cli.BatchRead(context.Background(), addr, []Op{{AddrOf(loc), 0x1000, 8}}); err == nil {
		t.Fatal("no error from a closed port")
	}
}

// dial opens a raw connection for bad-input tests.
func dial(t *testing.T, port int) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(3 * time.Second))
	t.Cleanup(func() { c.Close() })
	return c
}

func header(h Header) []byte {
	var b [HeaderSize]byte
	PutHeader(&b, h)
	return b[:]
}

// TestServerBadInput throws malformed data-port requests and handshake
// frames at a serving engine: each gets a clear refusal (or a close), no
// panic, and the engine keeps serving.
func TestServerBadInput(t *testing.T) {
	cfg := testConfig()
	cfg.IOTimeout = 300 * time.Millisecond
	srv, _ := newEngine(t, cfg)
	rem := register(t, srv, 1<<20, 5)
	good := AddrOf(rem)

	rejectedStatus := func(t *testing.T, c net.Conn) {
		t.Helper()
		var st [StatusSize]byte
		if _, err := io.ReadFull(c, st[:]); err != nil {
			t.Fatalf("no status: %v", err)
		}
		if err := ParseStatus(&st); !errors.Is(err, ErrRejected) {
			t.Fatalf("status: %v", err)
		}
		if _, err := c.Read(st[:]); err == nil {
			t.Fatal("connection left open after a refusal")
		}
	}
	closed := func(t *testing.T, c net.Conn) {
		t.Helper()
		b, err := io.ReadAll(c) // a reset is a close too
		if errors.Is(err, os.ErrDeadlineExceeded) || len(b) != 0 {
			t.Fatalf("got %d bytes, %v; want the connection closed", len(b), err)
		}
	}
	data := []struct {
		name  string
		send  []byte
		check func(*testing.T, net.Conn)
	}{
		{"unknown opcode v2", append(header(Header{Size: 8, Addr: good}), 0)[:HeaderSize], nil},
		{"zero length v2", header(Header{Size: 0, Addr: good, V2: true}), rejectedStatus},
		{"unregistered v2 read", header(Header{Size: 8, Addr: 0x1000, V2: true}), rejectedStatus},
		{"unregistered v1 read", header(Header{Size: 8, Addr: 0x1000}), closed},
		{"unregistered v2 write with payload", append(header(Header{Size: 1 << 16, Addr: 0x1000, Opcode: OpcodeWrite, V2: true}), make([]byte, 1<<16)...), rejectedStatus},
		{"partial header", []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, closed},
		{"write stops mid-payload", append(header(Header{Size: 1 << 16, Addr: good, Opcode: OpcodeWrite, V2: true}), make([]byte, 1000)...), closed},
	}
	// Unknown opcodes, with and without the v2 bit.
	unk := header(Header{Size: 8, Addr: good})
	unk[16] = 0x85
	data[0].send, data[0].check = unk, rejectedStatus
	unk1 := header(Header{Size: 8, Addr: good})
	unk1[16] = 0x07
	data = append(data, struct {
		name  string
		send  []byte
		check func(*testing.T, net.Conn)
	}{"unknown opcode v1", unk1, closed})

	for _, tc := range data {
		t.Run("data/"+tc.name, func(t *testing.T) {
			c := dial(t, srv.DataPort())
			c.Write(tc.send)
			tc.check(t, c)
		})
	}
	if got := testutil.ToFloat64(srv.m.rejected.WithLabelValues(reasonBadOpcode)); got != 2 {
		t.Errorf("bad_opcode rejections = %v", got)
	}
	if got := testutil.ToFloat64(srv.m.rejected.WithLabelValues(reasonZeroLength)); got != 1 {
		t.Errorf("zero_length rejections = %v", got)
	}

	frames := []struct {
		name      string
		send      []byte
		wantType  FrameType
		wantReply string // "" = connection closed without a reply
	}{
		{"probe", AppendFrame(nil, FrameProbe, []byte(`{}`)), FrameProbe, string(replyProbe)},
		{"notify", AppendFrame(nil, FrameNotify, []byte(`{"name":"x","notify_msg":"hi"}`)), FrameNotify, string(replyNotify)},
		{"connection", AppendFrame(nil, FrameConnection, []byte(`{"local_nic_path":""}`)), FrameConnection, string(replyConnection)},
		{"legacy", AppendFrame(nil, FrameLegacy, []byte(`{"local_nic_path":""}`)), FrameLegacy, string(replyConnection)},
		{"oversized", binary.LittleEndian.AppendUint64(nil, 1<<40), 0, ""},
		{"zero length", binary.LittleEndian.AppendUint64(nil, 0), 0, ""},
		{"unknown type", AppendFrame(nil, FrameType(0x90), []byte(`{}`)), 0, ""},
		{"malformed json", AppendFrame(nil, FrameMetadata, []byte(`{"name":`)), 0, ""},
		{"stops mid-frame", AppendFrame(nil, FrameMetadata, []byte(`{"name":"abc"}`))[:12], 0, ""},
	}
	for _, tc := range frames {
		t.Run("rpc/"+tc.name, func(t *testing.T) {
			c := dial(t, srv.RPCPort())
			c.Write(tc.send)
			if tc.wantReply == "" {
				if tc.name == "stops mid-frame" {
					c.(*net.TCPConn).CloseWrite()
				}
				b, err := io.ReadAll(c)
				if err != nil || len(b) != 0 {
					t.Fatalf("got %q, %v; want a silent close", b, err)
				}
				return
			}
			var got FrameType
			var payload []byte
			var err error
			if tc.wantType == FrameLegacy {
				var all []byte
				all, err = io.ReadAll(c)
				if err == nil && len(all) >= 8 {
					got, payload = FrameLegacy, all[8:]
				}
			} else {
				got, payload, err = ReadFrame(c, DefaultMaxFrame)
			}
			if err != nil || got != tc.wantType || string(payload) != tc.wantReply {
				t.Fatalf("got %v %q %v", got, payload, err)
			}
		})
	}

	// Still serving.
	cli, _ := newEngine(t, testConfig())
	loc := register(t, cli, 1<<20, 0)
	if err := cli.BatchRead(context.Background(), srv.SessionID(), []Op{{AddrOf(loc), good, 1 << 20}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(loc, rem) {
		t.Fatal("bytes differ")
	}
}
