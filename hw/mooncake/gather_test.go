package mooncake

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"math"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestBatchReadGather reads strided remote rows into contiguous local
// memory over real loopback sockets, kvflow to kvflow (the strided READ)
// and with either side speaking Mooncake's protocol only (a READ per row),
// and checks every byte against a naive row-by-row copy, and what the
// target served: few strided requests, or one READ per row.
func TestBatchReadGather(t *testing.T) {
	const remoteLen, localLen = 2 << 20, 1 << 20
	for _, tc := range []struct {
		name                 string
		srvPlain, cliPlain   bool
		wantStrided          bool
		ops                  func(base, rbase uint64) []Op
		g                    Stride
		chunk                int
		wantServedOps        float64 // 0: not checked
		wantServedOpsStrided float64
	}{
		// A head slice: 1 KiB of every 2 KiB row, 16 blocks of 128 rows, two
		// tensors; 2 MiB per op at a 64 KiB chunk: 32 requests per op.
		{name: "head slice", wantStrided: true, g: Stride{Row: 1024, Pitch: 2048}, chunk: 64 << 10,
			ops: func(base, rbase uint64) []Op {
				return []Op{{Local: base, Remote: rbase + 1024, Length: 256 << 10}, {Local: base + 512<<10, Remote: rbase + 1<<20 + 1024, Length: 256 << 10}}
			}, wantServedOps: 8},
		{name: "one row, odd sizes", wantStrided: true, g: Stride{Row: 333, Pitch: 1000}, chunk: 4 << 20,
			ops: func(base, rbase uint64) []Op {
				return []Op{{Local: base + 3, Remote: rbase + 17, Length: 333}, {Local: base + 4096, Remote: rbase + 5000, Length: 333 * 900}}
			}, wantServedOps: 2},
		{name: "rows longer than a chunk", wantStrided: true, g: Stride{Row: 100 << 10, Pitch: 300 << 10}, chunk: 64 << 10,
			ops: func(base, rbase uint64) []Op {
				return []Op{{Local: base, Remote: rbase + 7, Length: 500 << 10}}
			}, wantServedOps: 5},
		{name: "mooncake target", srvPlain: true, g: Stride{Row: 1024, Pitch: 2048}, chunk: 64 << 10,
			ops: func(base, rbase uint64) []Op {
				return []Op{{Local: base, Remote: rbase + 1024, Length: 256 << 10}}
			}, wantServedOps: 256},
		{name: "mooncake initiator", cliPlain: true, g: Stride{Row: 1024, Pitch: 2048}, chunk: 64 << 10,
			ops: func(base, rbase uint64) []Op {
				return []Op{{Local: base, Remote: rbase, Length: 64 << 10}}
			}, wantServedOps: 64},
		{name: "plain rows longer than a chunk", srvPlain: true, g: Stride{Row: 100 << 10, Pitch: 300 << 10}, chunk: 64 << 10,
			ops: func(base, rbase uint64) []Op {
				return []Op{{Local: base, Remote: rbase + 7, Length: 300 << 10}}
			}, wantServedOps: 6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			scfg := testConfig()
			scfg.NoKvflowOps = tc.srvPlain
			srv, _ := newEngine(t, scfg)
			ccfg := testConfig()
			ccfg.NoKvflowOps = tc.cliPlain
			ccfg.ChunkSize = tc.chunk
			cli, _ := newEngine(t, ccfg)
			rem := register(t, srv, remoteLen, 9)
			loc := register(t, cli, localLen, 0)
			base, rbase := AddrOf(loc), AddrOf(rem)
			for i := range loc {
				loc[i] = 0xEE
			}
			ops := tc.ops(base, rbase)
			want := bytes.Clone(loc)
			for _, op := range ops {
				for i := uint64(0); i < op.Length; i++ {
					want[op.Local-base+i] = rem[op.Remote-rbase+(i/tc.g.Row)*tc.g.Pitch+i%tc.g.Row]
				}
			}
			if err := cli.BatchReadGather(context.Background(), srv.SessionID(), ops, tc.g); err != nil {
				t.Fatal(err)
			}
			if i := firstDiff(loc, want); i < len(loc) {
				t.Fatalf("byte %d: got %#x, want %#x", i, loc[i], want[i])
			}
			p, err := cli.peer(context.Background(), srv.SessionID())
			if err != nil {
				t.Fatal(err)
			}
			if _, strided := p.layout(); strided != tc.wantStrided && !tc.cliPlain {
				t.Fatalf("peer negotiated strided reads: %v, want %v", strided, tc.wantStrided)
			}
			// The target counts an op after its write returned, which may be
			// after the initiator saw the bytes: wait for the count first.
			waitFor(t, func() bool { return testutil.ToFloat64(srv.m.serveReadOps) >= tc.wantServedOps })
			if got := testutil.ToFloat64(srv.m.serveReadOps); got != tc.wantServedOps {
				t.Fatalf("target served %v requests, want %v", got, tc.wantServedOps)
			}
		})
	}
}

// TestGatherNegotiation: a kvflow target advertises its strided READ only
// to an initiator whose own descriptor advertised kvflow ops; a Mooncake
// initiator's recorded request gets Mooncake's descriptor, without the
// field.
func TestGatherNegotiation(t *testing.T) {
	srv, _ := newEngine(t, testConfig())
	register(t, srv, 1<<20, 1)
	ask := func(req []byte) (*SegmentDesc, []byte) {
		c := dial(t, srv.RPCPort())
		c.Write(req)
		raw, err := io.ReadAll(c)
		if err != nil {
			t.Fatal(err)
		}
		typ, payload, err := ReadFrame(bytes.NewReader(raw), DefaultMaxFrame)
		if err != nil || typ != FrameMetadata {
			t.Fatalf("reply: %v %v", typ, err)
		}
		d, err := DecodeSegment(payload)
		if err != nil {
			t.Fatal(err)
		}
		return d, payload
	}
	if d, payload := ask(loadHex(t, "metadata_request")); d.KvflowOps != 0 || bytes.Contains(payload, []byte("kvflow")) {
		t.Fatalf("a Mooncake initiator got kvflow ops: %s", payload)
	}
	kv := &SegmentDesc{Name: "127.0.0.1:1", Protocol: "tcp", TCPDataPort: 2, TCPProtoVersion: 2, KvflowOps: KvflowOpStridedRead}
	if d, _ := ask(AppendFrame(nil, FrameMetadata, EncodeSegment(kv))); d.KvflowOps != KvflowOpStridedRead {
		t.Fatalf("a kvflow initiator got kvflow_ops %d", d.KvflowOps)
	}
	plainCfg := testConfig()
	plainCfg.NoKvflowOps = true
	plain, _ := newEngine(t, plainCfg)
	if plain.Segment().KvflowOps != 0 || bytes.Contains(EncodeSegment(plain.Segment()), []byte("kvflow")) {
		t.Fatal("an engine with NoKvflowOps advertises kvflow ops")
	}
}

// stridedReq is a raw strided READ request (fields not validated).
func stridedReq(size, addr, row, pitch uint64, opcode byte) []byte {
	var b [StridedHeaderSize]byte
	binary.LittleEndian.PutUint64(b[0:], size)
	binary.LittleEndian.PutUint64(b[8:], addr)
	b[16] = opcode
	binary.LittleEndian.PutUint64(b[HeaderSize:], row)
	binary.LittleEndian.PutUint64(b[HeaderSize+8:], pitch)
	return b[:]
}

// TestGatherHostile throws hostile strided READs at a serving engine with
// read grants: each is refused with the v2 reject status and counted
// under its reason, no byte outside the checked span is served, and the
// engine keeps serving. A target with NoKvflowOps refuses the opcode as
// unknown.
func TestGatherHostile(t *testing.T) {
	cfg := testConfig()
	cfg.IOTimeout = 300 * time.Millisecond
	cfg.ReadGrants = true
	srv, _ := newEngine(t, cfg)
	rem := register(t, srv, 1<<20, 5)
	good := AddrOf(rem)
	// Granted: the first 512 KiB only.
	if err := srv.Grant(Range{Addr: good, Length: 512 << 10}); err != nil {
		t.Fatal(err)
	}
	rejected := func(t *testing.T, send []byte) {
		t.Helper()
		c := dial(t, srv.DataPort())
		c.Write(send)
		var st [StatusSize]byte
		if _, err := io.ReadFull(c, st[:]); err != nil {
			t.Fatalf("no status: %v", err)
		}
		if err := ParseStatus(&st); !errors.Is(err, ErrRejected) {
			t.Fatalf("status: %v", err)
		}
		if n, err := c.Read(st[:]); err == nil {
			t.Fatalf("connection left open after a refusal (%d more bytes)", n)
		}
	}
	v2 := OpcodeReadStrided | OpcodeV2
	for _, tc := range []struct {
		name   string
		send   []byte
		reason string
	}{
		{"huge count", stridedReq(1<<62, good, 1024, 2048, v2), reasonUnregistered},
		{"stride times count overflows", stridedReq(1<<20, good, 1, 1<<45, v2), reasonBadStrided},
		{"span wraps the address space", stridedReq(2048, math.MaxUint64-4096, 1024, 1<<20, v2), reasonBadStrided},
		{"last row leaves the region", stridedReq(16*1024, good, 1024, 128<<10, v2), reasonUnregistered},
		{"first row before the region", stridedReq(4096, good-1024, 1024, 2048, v2), reasonUnregistered},
		{"span leaves the grant", stridedReq(8*1024, good, 1024, 80<<10, v2), reasonNotGranted},
		{"rows overlap", stridedReq(4096, good, 1024, 512, v2), reasonBadStrided},
		{"zero row", stridedReq(4096, good, 0, 512, v2), reasonBadStrided},
		{"zero size", stridedReq(0, good, 1024, 2048, v2), reasonBadStrided},
		{"partial rows", stridedReq(1500, good, 1024, 2048, v2), reasonBadStrided},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := testutil.ToFloat64(srv.m.rejected.WithLabelValues(tc.reason))
			rejected(t, tc.send)
			if got := testutil.ToFloat64(srv.m.rejected.WithLabelValues(tc.reason)); got != before+1 {
				t.Fatalf("%s rejections %v -> %v", tc.reason, before, got)
			}
		})
	}
	t.Run("v1 strided", func(t *testing.T) {
		c := dial(t, srv.DataPort())
		c.Write(stridedReq(4096, good, 1024, 2048, OpcodeReadStrided))
		if b, _ := io.ReadAll(c); len(b) != 0 {
			t.Fatalf("a v1 strided read got %d bytes", len(b))
		}
	})
	if got := testutil.ToFloat64(srv.m.serveReadOps); got != 0 {
		t.Fatalf("served %v reads", got)
	}
	// A good one, by hand: the answer is the rows, back to back.
	c := dial(t, srv.DataPort())
	c.Write(stridedReq(4*100, good+10, 100, 1000, v2))
	resp := make([]byte, StatusSize+400)
	if _, err := io.ReadFull(c, resp); err != nil {
		t.Fatal(err)
	}
	if ParseStatus((*[StatusSize]byte)(resp)) != nil {
		t.Fatal("not OK")
	}
	for r := range 4 {
		if !bytes.Equal(resp[StatusSize+r*100:][:100], rem[10+r*1000:][:100]) {
			t.Fatalf("row %d differs", r)
		}
	}

	// Mooncake's protocol only: the opcode is unknown.
	pcfg := testConfig()
	pcfg.NoKvflowOps = true
	plain, _ := newEngine(t, pcfg)
	prem := register(t, plain, 1<<20, 5)
	pc := dial(t, plain.DataPort())
	pc.Write(stridedReq(4096, AddrOf(prem), 1024, 2048, v2))
	var st [StatusSize]byte
	if _, err := io.ReadFull(pc, st[:]); err != nil || !errors.Is(ParseStatus(&st), ErrRejected) {
		t.Fatalf("plain target: %v", err)
	}
	if got := testutil.ToFloat64(plain.m.rejected.WithLabelValues(reasonBadOpcode)); got != 1 {
		t.Fatalf("plain target bad_opcode rejections = %v", got)
	}
}

// TestBatchReadGatherBadInput: a stride that does not fit the ops, or
// remote rows that wrap, fail the batch before any I/O.
func TestBatchReadGatherBadInput(t *testing.T) {
	srv, _ := newEngine(t, testConfig())
	cli, _ := newEngine(t, testConfig())
	loc := register(t, cli, 1<<20, 0)
	rem := register(t, srv, 1<<20, 1)
	for _, tc := range []struct {
		name string
		ops  []Op
		g    Stride
	}{
		{"partial row", []Op{{AddrOf(loc), AddrOf(rem), 1000}}, Stride{Row: 300, Pitch: 600}},
		{"pitch below row", []Op{{AddrOf(loc), AddrOf(rem), 1024}}, Stride{Row: 512, Pitch: 100}},
		{"remote wraps", []Op{{AddrOf(loc), math.MaxUint64 - 1<<20, 1 << 20}}, Stride{Row: 1024, Pitch: 1 << 20}},
		{"local unregistered", []Op{{0x1000, AddrOf(rem), 1024}}, Stride{Row: 512, Pitch: 1024}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := cli.BatchReadGather(context.Background(), srv.SessionID(), tc.ops, tc.g)
			var be *BatchError
			if !errors.As(err, &be) || be.Failed() != len(tc.ops) {
				t.Fatalf("err %v", err)
			}
		})
	}
	if got := testutil.ToFloat64(srv.m.serveReadOps); got != 0 {
		t.Fatalf("served %v reads", got)
	}
}

// With RequireAuth the strided READ is served, like any READ, only on a
// connection that proved its credential: an authenticated kvflow
// initiator negotiates it and reads; a raw strided request from an
// outsider is cut at its first 8 bytes, with no byte of memory.
func TestGatherAuth(t *testing.T) {
	target, mem, _ := authTarget(t)
	cli, _ := newEngine(t, testConfig())
	if err := cli.SetPeerCredential(target.SessionID(), credFor(t, target)); err != nil {
		t.Fatal(err)
	}
	loc := register(t, cli, 64<<10, 0)
	g := Stride{Row: 512, Pitch: 2048}
	if err := cli.BatchReadGather(context.Background(), target.SessionID(), []Op{{Local: AddrOf(loc), Remote: AddrOf(mem) + 512, Length: 64 << 10}}, g); err != nil {
		t.Fatal(err)
	}
	for i := range loc {
		if want := mem[512+(i/512)*2048+i%512]; loc[i] != want {
			t.Fatalf("byte %d: %#x, want %#x", i, loc[i], want)
		}
	}
	waitFor(t, func() bool { return testutil.ToFloat64(target.m.serveReadOps) >= 1 })
	if got := testutil.ToFloat64(target.m.serveReadOps); got != 1 {
		t.Fatalf("target served %v requests, want 1 strided READ", got)
	}
	c := dialRaw(t, target.DataPort())
	c.Write(stridedReq(4096, AddrOf(mem), 1024, 2048, OpcodeReadStrided|OpcodeV2))
	if got := readAll(t, c); len(got) != 0 {
		t.Fatalf("an outsider's strided READ got %d bytes", len(got))
	}
}
