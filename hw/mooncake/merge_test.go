package mooncake

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestSplitOps checks how a batch's ops become requests: READs whose
// remote ranges follow one another inside one remote buffer merge up to
// the chunk size (their local ranges become the request's segments);
// nothing merges across a buffer's end, without the peer's buffers, for
// WRITEs, or for ops of a chunk or more, which are split as before.
func TestSplitOps(t *testing.T) {
	const chunk = 256
	bufs := []BufferDesc{{Addr: 1000, Length: 1000}, {Addr: 2000, Length: 1000}}
	// Eight 64-byte ops, remote-contiguous from 1000; locals strided.
	strided := func(n int, remote uint64) []Op {
		var ops []Op
		for i := range n {
			ops = append(ops, Op{Local: 50000 + uint64(i)*1000, Remote: remote + uint64(i)*64, Length: 64})
		}
		return ops
	}
	type want struct {
		remote, length uint64
		ops            []int // ops covered, in order
	}
	for _, tc := range []struct {
		name   string
		opcode uint8
		ops    []Op
		bufs   []BufferDesc
		want   []want
	}{
		{"merged up to chunk", OpcodeRead, strided(8, 1000), bufs,
			[]want{{1000, 256, []int{0, 1, 2, 3}}, {1256, 256, []int{4, 5, 6, 7}}}},
		{"not across a buffer end", OpcodeRead, strided(4, 1872), bufs,
			[]want{{1872, 128, []int{0, 1}}, {2000, 128, []int{2, 3}}}},
		{"unknown buffers", OpcodeRead, strided(2, 1000), nil,
			[]want{{1000, 64, []int{0}}, {1064, 64, []int{1}}}},
		{"writes", OpcodeWrite, strided(2, 1000), bufs,
			[]want{{1000, 64, []int{0}}, {1064, 64, []int{1}}}},
		{"gap", OpcodeRead, []Op{{Local: 1, Remote: 1000, Length: 64}, {Local: 2, Remote: 1100, Length: 64}}, bufs,
			[]want{{1000, 64, []int{0}}, {1100, 64, []int{1}}}},
		{"large ops split", OpcodeRead, []Op{{Local: 1, Remote: 1000, Length: 600}, {Local: 601, Remote: 1600, Length: 64}}, bufs,
			[]want{{1000, 256, []int{0}}, {1256, 256, []int{0}}, {1512, 88, []int{0}}, {1600, 64, []int{1}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &batch{opcode: tc.opcode, left: make([]atomic.Int32, len(tc.ops))}
			tasks := splitOps(b, tc.ops, chunk, tc.bufs)
			if len(tasks) != len(tc.want) {
				t.Fatalf("%d requests, want %d: %+v", len(tasks), len(tc.want), tasks)
			}
			perOp := make([]int32, len(tc.ops))
			for i, tk := range tasks {
				w := tc.want[i]
				if tk.remote != w.remote || tk.length != w.length {
					t.Errorf("request %d: remote %d length %d, want %d %d", i, tk.remote, tk.length, w.remote, w.length)
				}
				var got []int
				var sum uint64
				if tk.segs == nil {
					got = []int{tk.op}
					sum = tk.length
				}
				for _, sg := range tk.segs {
					got = append(got, sg.op)
					sum += sg.length
					if sg.local != tc.ops[sg.op].Local || sg.length != tc.ops[sg.op].Length {
						t.Errorf("request %d: segment of op %d is %d+%d, want the op's local range", i, sg.op, sg.local, sg.length)
					}
				}
				if sum != tk.length || !equalInts(got, w.ops) {
					t.Errorf("request %d covers ops %v (%d bytes), want %v (%d)", i, got, sum, w.ops, tk.length)
				}
				if tk.pieces() != len(got) {
					t.Errorf("request %d: %d pieces, want %d", i, tk.pieces(), len(got))
				}
				for _, o := range got {
					perOp[o]++
				}
			}
			for i := range tc.ops {
				if n := b.left[i].Load(); n != perOp[i] {
					t.Errorf("op %d: left %d, want %d", i, n, perOp[i])
				}
			}
		})
	}
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestMergedScatterRead reads blocks that are contiguous on the target
// into strided local places (the P > 1 pattern) over real loopback
// sockets: every byte lands where its op says, and far fewer requests
// than ops cross the wire.
func TestMergedScatterRead(t *testing.T) {
	const (
		nops   = 256
		opLen  = 16 << 10
		stride = 3 * opLen
	)
	srv, _ := newEngine(t, testConfig())
	cli, _ := newEngine(t, testConfig())
	remote := register(t, srv, nops*opLen, 5)
	local := register(t, cli, nops*stride, 6)
	var ops []Op
	for i := range nops {
		ops = append(ops, Op{Local: AddrOf(local[i*stride:]), Remote: AddrOf(remote[i*opLen:]), Length: opLen})
	}
	if err := cli.BatchRead(context.Background(), srv.SessionID(), ops); err != nil {
		t.Fatal(err)
	}
	for i := range nops {
		if !bytes.Equal(local[i*stride:i*stride+opLen], remote[i*opLen:(i+1)*opLen]) {
			t.Fatalf("op %d: data mismatch", i)
		}
		// The gap after each op is untouched (still the local pattern).
		gap := local[i*stride+opLen : (i+1)*stride]
		for j, c := range gap {
			if c != byte((i*stride+opLen+j)*7)^6 {
				t.Fatalf("op %d: byte %d after it overwritten", i, j)
			}
		}
	}
	requests := testutil.ToFloat64(cli.m.ops.WithLabelValues(dirRead))
	if max := float64(nops*opLen) / float64(testConfig().ChunkSize) * 2; requests > max {
		t.Errorf("%v requests for %d remote-contiguous ops, want at most %v", requests, nops, max)
	}
	t.Logf("%d ops in %v requests", nops, requests)
}
