package read

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

type fakeTransfer struct {
	short    bool // the ledger shows the last op short; the batch says ok
	fail     error
	inflight atomic.Int32
	peak     atomic.Int32
}

func (f *fakeTransfer) Capabilities() Capabilities { return Capabilities{Ledger: true} }

func (f *fakeTransfer) BatchRead(ctx context.Context, session string, b *Batch) error {
	ops, landed := b.AppendTo(nil), b.Landed
	if landed == nil {
		landed = make([]uint64, len(ops))
	}
	n := f.inflight.Add(1)
	defer f.inflight.Add(-1)
	for {
		p := f.peak.Load()
		if n <= p || f.peak.CompareAndSwap(p, n) {
			break
		}
	}
	if f.fail != nil {
		return f.fail
	}
	for i, op := range ops {
		landed[i] = op.Len
	}
	if f.short {
		landed[len(ops)-1] /= 2
	}
	return nil
}

var testNow = time.Unix(0, 0)

func testJob(tasks int) *job.Job {
	j := job.New(plan.Request{ID: "r"}, testNow)
	j.Plan = plan.Plan{RemoteHost: "127.0.0.1", P: 1}
	for range tasks {
		j.Plan.Tasks = append(j.Plan.Tasks, plan.Task{P: 1, HandshakePort: 30000, LayerStart: 0, LayerEnd: 2,
			LocalBlockIDs: []int{0, 1}, RemoteBlockIDs: []int{2, 3}})
		j.Metas = append(j.Metas, job.Meta{EngineID: "P", TERPCPort: 17000, BaseAddrs: []uint64{1 << 30, 2 << 30, 3 << 30, 4 << 30}, NumBlocks: 8})
	}
	return j
}

func newStage(t *testing.T, f *fakeTransfer, inv Invalidator, small ...uint64) *Stage {
	t.Helper()
	s, err := build(f, Options{
		Layout:     plan.CacheLayout{BlockLen: []uint64{4096}, CachesPerLayer: 2},
		Local:      plan.Caches{Base: []uint64{5 << 30, 6 << 30, 7 << 30, 8 << 30}, NumBlocks: 8},
		PerSession: 2, Invalidate: inv, SmallBatch: append(small, 0)[0],
	})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestLedger(t *testing.T) {
	cases := []struct {
		name      string
		f         *fakeTransfer
		wantErr   error
		wantBytes uint64
		wantInval bool
	}{
		{"complete", &fakeTransfer{}, nil, 4 * 2 * 4096, false},
		{"short but reported ok", &fakeTransfer{short: true}, ErrShortfall, 0, true},
		{"failed batch", &fakeTransfer{fail: errors.New("peer closed")}, nil, 0, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var invalidated atomic.Bool
			s := newStage(t, tc.f, func(*job.Job, int) { invalidated.Store(true) })
			j := testJob(1)
			err := s.Process(context.Background(), j)
			switch {
			case tc.f.fail != nil:
				if err == nil {
					t.Fatal("failed batch not reported")
				}
			case tc.wantErr != nil:
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("err %v, want %v", err, tc.wantErr)
				}
			case err != nil:
				t.Fatal(err)
			}
			if got := j.BytesRead.Load(); got != tc.wantBytes {
				t.Errorf("bytes %d, want %d", got, tc.wantBytes)
			}
			if invalidated.Load() != tc.wantInval {
				t.Errorf("invalidated %v, want %v", invalidated.Load(), tc.wantInval)
			}
		})
	}
}

// The tasks of one job run concurrently, bounded by the per-session limit.
func TestPerSessionLimit(t *testing.T) {
	f := &fakeTransfer{}
	s := newStage(t, f, nil, 1) // every batch counts against the limit
	j := testJob(6)
	if err := s.Process(context.Background(), j); err != nil {
		t.Fatal(err)
	}
	if p := f.peak.Load(); p > 2 {
		t.Fatalf("%d batches at once against one session, limit 2", p)
	}
}

// kindTransfer is a transfer with or without a ledger; it records the
// ops it was given (expanded).
type kindTransfer struct {
	mu     sync.Mutex
	ops    [][]plan.Op
	short  int // with a ledger: op index to report half landed; -1 none
	ledger bool
}

func (k *kindTransfer) record(ops []plan.Op) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.ops = append(k.ops, ops)
}

func (k *kindTransfer) Capabilities() Capabilities { return Capabilities{Ledger: k.ledger} }

func (k *kindTransfer) BatchRead(_ context.Context, _ string, b *Batch) error {
	ops := b.AppendTo(nil)
	k.record(ops)
	if (b.Landed != nil) != k.ledger {
		return fmt.Errorf("ledger %v asked of a transfer with ledger %v", b.Landed != nil, k.ledger)
	}
	for i, op := range ops {
		if b.Landed == nil {
			break
		}
		b.Landed[i] = op.Len
		if i == k.short {
			b.Landed[i] /= 2
		}
	}
	return nil
}

// Every kind of transfer gets the same ops, plan.Ops' for the task, and the
// stage counts the same bytes and ops; the kinds with a ledger catch a
// short op and name its addresses.
func TestTransferKinds(t *testing.T) {
	j0 := testJob(1)
	opts := Options{
		Layout: plan.CacheLayout{BlockLen: []uint64{4096}, CachesPerLayer: 2},
		Local:  plan.Caches{Base: []uint64{5 << 30, 6 << 30, 7 << 30, 8 << 30}, NumBlocks: 8},
	}
	want, err := plan.Ops(opts.Layout, j0.Plan.Tasks[0], opts.Local, plan.Caches{Base: j0.Metas[0].BaseAddrs, NumBlocks: j0.Metas[0].NumBlocks})
	if err != nil {
		t.Fatal(err)
	}
	var wantBytes uint64
	for _, op := range want {
		wantBytes += op.Len
	}
	for _, c := range []struct {
		name   string
		mk     func(*kindTransfer) Transfer
		ledger bool
	}{
		{"plain", func(k *kindTransfer) Transfer { return k }, false},
		{"ledger", func(k *kindTransfer) Transfer { k.ledger = true; return k }, true},
		{"ops func", func(k *kindTransfer) Transfer {
			return OpsFunc(func(_ context.Context, _ string, ops []plan.Op) error { k.record(ops); return nil })
		}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			k := &kindTransfer{short: -1}
			s, err := build(c.mk(k), opts)
			if err != nil {
				t.Fatal(err)
			}
			j := testJob(1)
			if err := s.Process(context.Background(), j); err != nil {
				t.Fatal(err)
			}
			if len(k.ops) != 1 || !slices.Equal(k.ops[0], want) {
				t.Fatalf("transfer got %v, want [%v]", k.ops, want)
			}
			if j.BytesRead.Load() != wantBytes || j.OpsRead.Load() != uint64(len(want)) {
				t.Fatalf("counted %d bytes, %d ops; want %d, %d", j.BytesRead.Load(), j.OpsRead.Load(), wantBytes, len(want))
			}
			k = &kindTransfer{short: 2}
			if s, err = build(c.mk(k), opts); err != nil {
				t.Fatal(err)
			}
			err = s.Process(context.Background(), testJob(1))
			if !c.ledger {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			op := want[2]
			msg := fmt.Sprintf("1 of %d ops incomplete, %d bytes missing; first: op 2 local %#x remote %#x landed %d of %d bytes",
				len(want), op.Len-op.Len/2, op.Local, op.Remote, op.Len/2, op.Len)
			if !errors.Is(err, ErrShortfall) || !strings.Contains(err.Error(), msg) {
				t.Fatalf("err %v, want %v naming %q", err, ErrShortfall, msg)
			}
		})
	}
}

// stridedKind states LocalStride and records the stride it was asked for.
type stridedKind struct {
	*kindTransfer
	row, pitch uint64
}

func (s *stridedKind) Capabilities() Capabilities { return Capabilities{LocalStride: true} }

func (s *stridedKind) BatchRead(_ context.Context, _ string, b *Batch) error {
	s.record(b.AppendTo(nil))
	if b.Row > 0 {
		s.mu.Lock()
		s.row, s.pitch = b.Row, b.Pitch
		s.mu.Unlock()
	}
	return nil
}

// TestFusedStitch: with a LocalStride transfer and a P > 1 plan the stage reads
// interleaved (each slot's op starts at slot*row/P, rows of row/P bytes,
// row apart) and marks the job Stitched; with NoFuse, P == 1, no block
// size or a block that does not split, it reads as the seed does and
// leaves the job for the stitch stage.
func TestFusedStitch(t *testing.T) {
	const bs = 16 // 4096-byte blocks: rows of 256 bytes
	p2 := func() *job.Job {
		j := testJob(2)
		j.Plan.P, j.Plan.Stitch = 2, true
		for i := range j.Plan.Tasks {
			j.Plan.Tasks[i].P, j.Plan.Tasks[i].HeadSlot = 2, i
		}
		return j
	}
	for _, c := range []struct {
		name    string
		j       *job.Job
		opts    func(*Options)
		strided bool
	}{
		{"P 2", p2(), func(*Options) {}, true},
		{"no fuse", p2(), func(o *Options) { o.NoFuse = true }, false},
		{"no block size", p2(), func(o *Options) { o.BlockSize = 0 }, false},
		{"rows do not split", p2(), func(o *Options) { o.BlockSize = 4096 }, false},
		{"P 1", testJob(2), func(*Options) {}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			k := &stridedKind{kindTransfer: &kindTransfer{short: -1}}
			o := Options{
				Layout:    plan.CacheLayout{BlockLen: []uint64{4096}, CachesPerLayer: 2},
				Local:     plan.Caches{Base: []uint64{5 << 30, 6 << 30, 7 << 30, 8 << 30}, NumBlocks: 8},
				BlockSize: bs,
			}
			c.opts(&o)
			s, err := build(k, o)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Process(context.Background(), c.j); err != nil {
				t.Fatal(err)
			}
			if c.j.Stitched != c.strided {
				t.Fatalf("Stitched %v, want %v", c.j.Stitched, c.strided)
			}
			if got := k.row != 0; got != c.strided {
				t.Fatalf("strided read %v (row %d pitch %d), want %v", got, k.row, k.pitch, c.strided)
			}
			if c.strided && (k.row != 4096/bs/2 || k.pitch != 4096/bs) {
				t.Fatalf("stride %d/%d, want rows of %d, %d apart", k.row, k.pitch, 4096/bs/2, 4096/bs)
			}
			for i, tk := range c.j.Plan.Tasks {
				rd := new(plan.Reads)
				if err := rd.Build(o.Layout, tk, o.Local, plan.Caches{Base: c.j.Metas[i].BaseAddrs, NumBlocks: 8}); err != nil {
					t.Fatal(err)
				}
				if c.strided {
					if _, _, err := rd.Interleave(bs); err != nil {
						t.Fatal(err)
					}
				}
				want := rd.AppendTo(nil)
				found := false
				for _, ops := range k.ops {
					found = found || slices.Equal(ops, want)
				}
				if !found {
					t.Fatalf("task %d: transfer got %v, want %v among them", i, k.ops, want)
				}
			}
		})
	}
}
