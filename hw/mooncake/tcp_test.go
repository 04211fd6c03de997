package mooncake

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// span is a byte range inside one of a set of buffers.
type span struct{ buf, off, n int }

// pickSpans draws count random spans over bufs, pairwise disjoint.
func pickSpans(rng *rand.Rand, bufs [][]byte, count, maxLen int) []span {
	var out []span
	for tries := 0; len(out) < count && tries < 100*count; tries++ {
		s := span{buf: rng.IntN(len(bufs))}
		s.n = 1 + rng.IntN(min(len(bufs[s.buf]), maxLen))
		s.off = rng.IntN(len(bufs[s.buf]) - s.n + 1)
		ok := true
		for _, o := range out {
			if o.buf == s.buf && s.off < o.off+o.n && o.off < s.off+s.n {
				ok = false
				break
			}
		}
		if ok {
			out = append(out, s)
		}
	}
	return out
}

func (s span) of(bufs [][]byte) []byte { return bufs[s.buf][s.off : s.off+s.n] }

// TestBatchRandom reads and writes random sizes at random offsets across
// many regions on both sides, with both framings, and checks every byte.
func TestBatchRandom(t *testing.T) {
	for _, proto := range []int{2, 1} {
		t.Run("v"+strconv.Itoa(proto), func(t *testing.T) {
			scfg := testConfig()
			scfg.ProtoVersion = proto
			scfg.ChunkSize = 64 << 10 // the server's chunking
			ccfg := testConfig()
			ccfg.ChunkSize = 128 << 10 // the client splits large ops
			srv, _ := newEngine(t, scfg)
			cli, _ := newEngine(t, ccfg)
			rng := rand.New(rand.NewPCG(1, uint64(proto)))

			const nreg = 12
			var remote, local [][]byte
			for i := range nreg {
				remote = append(remote, register(t, srv, 64<<10+rng.IntN(512<<10), byte(i)))
				local = append(local, register(t, cli, 64<<10+rng.IntN(512<<10), byte(100+i)))
			}
			for round, dir := range []string{"read", "write", "read", "write"} {
				n := 50
				ls := pickSpans(rng, local, n, 300<<10)
				rs := pickSpans(rng, remote, n, 300<<10)
				var ops []Op
				var pairs [][2]span
				for i := range min(len(ls), len(rs)) {
					l, r := ls[i], rs[i]
					l.n = min(l.n, r.n)
					r.n = l.n
					ops = append(ops, Op{Local: AddrOf(l.of(local)), Remote: AddrOf(r.of(remote)), Length: uint64(l.n)})
					pairs = append(pairs, [2]span{l, r})
				}
				var err error
				var total int
				if dir == "read" {
					err = cli.BatchRead(context.Background(), srv.SessionID(), ops)
				} else {
					for _, b := range local {
						for i := range b {
							b[i] = byte(rng.Uint32())
						}
					}
					err = cli.BatchWrite(context.Background(), srv.SessionID(), ops)
				}
				if err != nil {
					t.Fatalf("round %d %s: %v", round, dir, err)
				}
				if dir == "write" && proto == 1 {
					// Legacy framing has no acknowledgement: completion only
					// means the payload left this engine (Mooncake #2086).
					waitFor(t, func() bool {
						return testutil.ToFloat64(srv.m.ops.WithLabelValues(dirServeWrite)) >= testutil.ToFloat64(cli.m.ops.WithLabelValues(dirWrite))
					})
				}
				for i, p := range pairs {
					if !bytes.Equal(p[0].of(local), p[1].of(remote)) {
						t.Fatalf("round %d %s op %d (%d bytes): bytes differ", round, dir, i, p[0].n)
					}
					total += p[0].n
				}
				t.Logf("round %d %s: %d ops, %d bytes", round, dir, len(ops), total)
			}
			// The server counts after its last write: let it catch up.
			for _, d := range [][2]string{{dirRead, dirServeRead}, {dirWrite, dirServeWrite}} {
				waitFor(t, func() bool {
					c := testutil.ToFloat64(cli.m.bytes.WithLabelValues(d[0]))
					return c > 0 && c == testutil.ToFloat64(srv.m.bytes.WithLabelValues(d[1]))
				})
			}
		})
	}
}

// TestRejectOutsideRegistered: ranges not fully inside one registered
// region are refused by the server, counted, never served, and the server
// keeps serving.
func TestRejectOutsideRegistered(t *testing.T) {
	srv, _ := newEngine(t, testConfig())
	cli, _ := newEngine(t, testConfig())
	rem := register(t, srv, 1<<20, 1)
	rem2 := register(t, srv, 1<<20, 2)
	unreg := mmap(t, 1<<16) // never registered
	loc := register(t, cli, 4<<20, 3)
	before := append([]byte(nil), loc[:1<<16]...)

	cases := []struct {
		name   string
		remote uint64
		length uint64
	}{
		{"unregistered", AddrOf(unreg), 4096},
		{"past the end", AddrOf(rem[len(rem)-100:]), 200},
		{"straddles two regions", AddrOf(rem[len(rem)-100:]), uint64(100 + len(rem2))},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, proto := range []string{"read", "write"} {
				ops := []Op{{Local: AddrOf(loc), Remote: tc.remote, Length: tc.length}}
				var err error
				if proto == "read" {
					err = cli.BatchRead(context.Background(), srv.SessionID(), ops)
				} else {
					err = cli.BatchWrite(context.Background(), srv.SessionID(), ops)
				}
				var be *BatchError
				if !errors.As(err, &be) || !errors.Is(err, ErrRejected) {
					t.Fatalf("%s: got %v, want a BatchError wrapping ErrRejected", proto, err)
				}
				if be.Failed() != 1 {
					t.Fatalf("failed = %d", be.Failed())
				}
			}
			if got := testutil.ToFloat64(srv.m.rejected.WithLabelValues(reasonUnregistered)); got != float64(2*(i+1)) {
				t.Fatalf("rejected = %v, want %d", got, 2*(i+1))
			}
		})
	}
	if !bytes.Equal(loc[:1<<16], before) {
		t.Fatal("rejected read wrote local memory")
	}
	if n := testutil.ToFloat64(srv.m.ops.WithLabelValues(dirServeRead)); n != 0 {
		t.Fatalf("served %v reads", n)
	}
	// Still serving, on fresh lanes.
	if err := cli.BatchRead(context.Background(), srv.SessionID(), []Op{{AddrOf(loc), AddrOf(rem2), 1 << 20}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(loc[:1<<20], rem2) {
		t.Fatal("bytes differ")
	}
}

// TestReadGrants: with grants on, only granted ranges are served; a
// transfer may span adjacent grants; revoked ranges are refused again.
func TestReadGrants(t *testing.T) {
	cfg := testConfig()
	cfg.ReadGrants = true
	srv, _ := newEngine(t, cfg)
	cli, _ := newEngine(t, testConfig())
	rem := register(t, srv, 1<<20, 1)
	loc := register(t, cli, 1<<20, 2)
	base := AddrOf(rem)
	read := func(off, n uint64) error {
		return cli.BatchRead(context.Background(), srv.SessionID(), []Op{{AddrOf(loc), base + off, n}})
	}
	rejected := func() float64 { return testutil.ToFloat64(srv.m.rejected.WithLabelValues(reasonNotGranted)) }

	if err := read(0, 4096); !errors.Is(err, ErrRejected) {
		t.Fatalf("ungranted read: %v", err)
	}
	if rejected() != 1 {
		t.Fatalf("rejected = %v", rejected())
	}
	// Two adjacent blocks granted separately, read as one op.
	if err := srv.Grant(Range{base, 4096}, Range{base + 4096, 4096}); err != nil {
		t.Fatal(err)
	}
	if err := read(0, 8192); err != nil {
		t.Fatalf("granted read: %v", err)
	}
	if !bytes.Equal(loc[:8192], rem[:8192]) {
		t.Fatal("bytes differ")
	}
	if err := read(4096, 8192); !errors.Is(err, ErrRejected) {
		t.Fatalf("read past the grant: %v", err)
	}
	// Granted twice, revoked once: still granted.
	srv.Grant(Range{base, 4096})
	srv.Revoke(Range{base, 4096})
	if err := read(0, 4096); err != nil {
		t.Fatalf("after one of two revokes: %v", err)
	}
	if err := srv.Revoke(Range{base, 4096}, Range{base + 4096, 4096}); err != nil {
		t.Fatal(err)
	}
	if err := srv.Revoke(Range{base, 4096}); err == nil {
		t.Fatal("revoking an ungranted range: no error")
	}
	if err := read(0, 4096); !errors.Is(err, ErrRejected) {
		t.Fatalf("revoked read: %v", err)
	}
	if rejected() != 3 {
		t.Fatalf("rejected = %v, want 3", rejected())
	}
}

// TestWritesRefusedByDefault: a target with the default configuration
// refuses a peer's WRITE (reject status, counted, its memory untouched)
// and keeps serving reads on a new connection.
func TestWritesRefusedByDefault(t *testing.T) {
	cfg := testConfig()
	cfg.AcceptWrites = DefaultTCPConfig().AcceptWrites
	srv, _ := newEngine(t, cfg)
	cli, _ := newEngine(t, testConfig())
	rem := register(t, srv, 1<<16, 1)
	loc := register(t, cli, 1<<16, 2)
	orig := bytes.Clone(rem)
	refused := func() float64 { return testutil.ToFloat64(srv.m.rejected.WithLabelValues(reasonWriteRefused)) }
	for _, size := range []uint64{4096, 1 << 16} { // within and past one request's payload drain
		err := cli.BatchWrite(context.Background(), srv.SessionID(), []Op{{AddrOf(loc), AddrOf(rem), size}})
		if !errors.Is(err, ErrRejected) {
			t.Fatalf("write of %d bytes: %v, want ErrRejected", size, err)
		}
	}
	if refused() != 2 {
		t.Fatalf("write_refused = %v, want 2", refused())
	}
	if !bytes.Equal(rem, orig) {
		t.Fatal("a refused write changed the target's memory")
	}
	if err := cli.BatchRead(context.Background(), srv.SessionID(), []Op{{AddrOf(loc), AddrOf(rem), 1 << 16}}); err != nil {
		t.Fatalf("read after refused writes: %v", err)
	}
	if !bytes.Equal(loc, rem) {
		t.Fatal("read bytes differ")
	}
}

// TestLocalValidation: bad local input fails before any I/O, with the
// reason on the op and the rest marked not attempted.
func TestLocalValidation(t *testing.T) {
	cli, _ := newEngine(t, testConfig())
	loc := register(t, cli, 1<<16, 0)
	other := mmap(t, 1<<16)
	// No server at all: validation must not need one.
	session := "127.0.0.1:1"
	cases := []struct {
		name string
		op   Op
		want error
	}{
		{"zero length", Op{AddrOf(loc), 0x1000, 0}, ErrZeroLength},
		{"local unregistered", Op{AddrOf(other), 0x1000, 16}, ErrNotRegistered},
		{"local past end", Op{AddrOf(loc[len(loc)-8:]), 0x1000, 16}, ErrNotRegistered},
		{"remote wraps", Op{AddrOf(loc), ^uint64(0) - 4, 16}, ErrRange},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ops := []Op{{AddrOf(loc), 0x1000, 8}, tc.op}
			err := cli.BatchRead(context.Background(), session, ops)
			var be *BatchError
			if !errors.As(err, &be) {
				t.Fatalf("got %v", err)
			}
			if !errors.Is(be.Errs[1], tc.want) || !errors.Is(be.Errs[0], ErrNotAttempted) {
				t.Fatalf("errs = %v", be.Errs)
			}
			t.Log(err)
		})
	}
	if err := cli.BatchRead(context.Background(), "no-port", []Op{{AddrOf(loc), 0x1000, 8}}); !errors.Is(err, ErrSession) {
		t.Fatalf("bad session: %v", err)
	}
	if err := cli.BatchRead(context.Background(), session, nil); err != nil {
		t.Fatalf("empty batch: %v", err)
	}
}

// TestRevokeStalledReader (real sockets): a peer that asks for a granted
// range and never reads the answer does not hold up a revoke of it. The
// revoke returns at once and refuses new reads of the range; other
// peers' reads go on; its channel closes only after the stalled reader's
// connection is cut at the grace, never while the serve is in flight.
func TestRevokeStalledReader(t *testing.T) {
	cfg := testConfig()
	cfg.ReadGrants = true
	cfg.IOTimeout = time.Minute // only the revoke's grace may end the stall
	cfg.RevokeGrace = 300 * time.Millisecond
	srv, _ := newEngine(t, cfg)
	cli, _ := newEngine(t, testConfig())
	const n = 64 << 20
	rem := register(t, srv, n, 1)
	loc := register(t, cli, 1<<20, 2)
	base := AddrOf(rem)
	stalled, other := Range{base, n / 2}, Range{base + n/2, 4096}
	if err := srv.Grant(stalled, other); err != nil {
		t.Fatal(err)
	}
	conn, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(srv.DataPort())))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.(*net.TCPConn).SetReadBuffer(4096)
	var hb [HeaderSize]byte
	PutHeader(&hb, Header{Size: n / 2, Addr: base, Opcode: OpcodeRead, V2: true})
	if _, err := conn.Write(hb[:]); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { srv.grants.mu.Lock(); defer srv.grants.mu.Unlock(); return len(srv.grants.holds) == 1 })

	done, err := srv.RevokeAsync(stalled)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
		t.Fatal("revoke reported done while its range was still being served")
	default:
	}
	// Another peer's read of a range still granted is served meanwhile;
	// the revoked range is refused.
	if err := cli.BatchRead(context.Background(), srv.SessionID(), []Op{{AddrOf(loc), other.Addr, 4096}}); err != nil {
		t.Fatalf("read of another grant during the stall: %v", err)
	}
	if err := cli.BatchRead(context.Background(), srv.SessionID(), []Op{{AddrOf(loc), base, 4096}}); !errors.Is(err, ErrRejected) {
		t.Fatalf("read of the revoked range: %v", err)
	}
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("revoke never completed: the stalled reader was not cut")
	}
	if got := testutil.ToFloat64(srv.m.grantCuts); got != 1 {
		t.Fatalf("connections cut = %v, want 1", got)
	}
	// The stalled reader's connection is closed: draining it ends.
	conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	if got, err := io.Copy(io.Discard, conn); err != nil && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("stalled reader's connection after %d bytes: %v", got, err)
	}
}
