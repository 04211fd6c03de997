package handshake

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

// side is one worker's cache and topology view, built as a node builds it.
type side struct {
	layout npu.Layout
	fp     npu.Fingerprint
}

func sizesOf(p plan.Parallel) npu.Sizes { return npu.Sizes{TP: p.TP, PP: p.PP, PCP: 1, DCP: 1} }

// worker builds the shape a worker of topo (prefill or decode, rank r)
// allocates: its PP stage's layers and max(1, H/tp) heads.
func worker(t testing.TB, topo plan.Topology, prefill bool, r npu.RankPos, headDim int) side {
	t.Helper()
	own := topo.Decode
	if prefill {
		own = topo.Prefill
	}
	layers := topo.Model.NumLayers
	if prefill {
		s, e, err := plan.PPIndices(layers, r.PP, own.PP, "")
		if err != nil {
			t.Fatal(err)
		}
		layers = e - s
	}
	l, err := npu.NewLayout(npu.Shape{NumLayers: layers, NumBlocks: 32, BlockSize: 16, DType: npu.BF16,
		NumKVHeads: max(1, topo.Model.NumKVHeads/own.TP), HeadDim: headDim})
	if err != nil {
		t.Fatal(err)
	}
	f := l.Fingerprint()
	f.Prefill, f.Decode, f.Rank = sizesOf(topo.Prefill), sizesOf(topo.Decode), r
	return side{l, f}
}

func cacheLayout(l npu.Layout) plan.CacheLayout {
	bl := make([]uint64, 0, 3)
	for _, b := range l.BlockLens() {
		bl = append(bl, uint64(b))
	}
	return plan.CacheLayout{BlockLen: bl, CachesPerLayer: l.NumParts()}
}

func planned(t testing.TB, topo plan.Topology) *job.Job {
	t.Helper()
	j := job.New(plan.Request{ID: "req-7", LocalBlockIDs: []int{1, 2}, RemoteBlockIDs: []int{3, 4}, RemoteHost: "127.0.0.1",
		RemotePort: 30000, RemoteEngineID: "P", RemotePCPSize: 1, RemoteDCPSize: 1}, time.Now())
	// What the plan stage does (planstage.Plan, which imports this
	// package).
	p, err := plan.PlanRequest(topo, plan.Rank{}, j.Req)
	if err != nil {
		t.Fatal(err)
	}
	j.Plan, j.Metas = p, make([]job.Meta, len(p.Tasks))
	return j
}

// TestCompatExpectations: the expected peer follows the plan (heads and
// block_len divided by tp_num_need_pulls, layers of the task's PP stage),
// so correctly shaped peers pass in every topology, and each kind of
// difference is named with both values.
func TestCompatExpectations(t *testing.T) {
	gqa := func(ptp, dtp, ppp, layers int) plan.Topology {
		return plan.Topology{Prefill: plan.Parallel{TP: ptp, PP: ppp, DP: 1}, Decode: plan.Parallel{TP: dtp, PP: 1, DP: 1},
			Model: plan.Model{NumLayers: layers, NumKVHeads: 8}}
	}
	cases := []struct {
		name   string
		topo   plan.Topology
		peer   func(f *npu.Fingerprint, m *job.Meta) // nil: a correct peer
		field  string
		reason string
	}{
		{name: "tp1-to-1", topo: gqa(1, 1, 1, 2)},
		{name: "tp4-to-2", topo: gqa(4, 2, 1, 2)},
		{name: "tp8-to-1", topo: gqa(8, 1, 1, 2)},
		{name: "pp2", topo: gqa(2, 2, 2, 5)},
		{name: "tp4-to-2 peer with decode heads", topo: gqa(4, 2, 1, 2),
			peer:  func(f *npu.Fingerprint, _ *job.Meta) { f.KVHeads, f.BlockLens = 4, []int{2048, 2048} },
			field: "kv_heads", reason: "kv_heads is 4, this decode expects 2; block_len of part 0 is 2048, this decode expects 1024; block_len of part 1 is 2048, this decode expects 1024"},
		{name: "pp2 layers", topo: gqa(2, 2, 2, 5), peer: func(f *npu.Fingerprint, _ *job.Meta) { f.Layers = 5 },
			field: "layers", reason: "peer P tp 0 pp 0: layers is 5, this decode expects 3; the number of kv_caches_base_addr is 6, this decode expects 10"},
		{name: "topology", topo: gqa(4, 2, 1, 2), peer: func(f *npu.Fingerprint, _ *job.Meta) { f.Decode.TP = 1 },
			field: "topology", reason: "decode.tp_size in the peer's configuration is 1, this decode expects 2"},
		{name: "rank", topo: gqa(4, 2, 1, 2), peer: func(f *npu.Fingerprint, _ *job.Meta) { f.Rank.TP += 1 },
			field: "rank", reason: "the peer's rank (tp, pp, pcp)"},
		{name: "num_blocks", topo: gqa(1, 1, 1, 2), peer: func(f *npu.Fingerprint, _ *job.Meta) { f.NumBlocks = 64 },
			field: "num_blocks", reason: "num_blocks of the cache fingerprint is 64, this decode expects 32 (the metadata's num_blocks)"},
		{name: "dtype", topo: gqa(1, 1, 1, 2), peer: func(f *npu.Fingerprint, _ *job.Meta) { f.DType = npu.FP16 },
			field: "dtype", reason: "peer P tp 0: dtype is fp16, this decode expects bf16"},
		{name: "kind", topo: gqa(1, 1, 1, 2), peer: func(f *npu.Fingerprint, _ *job.Meta) { f.Kind = npu.Sparse; f.BlockLens = []int{1, 2, 3} },
			field: "kind", reason: "cache kind is sparse, this decode expects gqa; parts per layer is 3, this decode expects 2"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dec := worker(t, tc.topo, false, npu.RankPos{}, 16)
			reg := prometheus.NewRegistry()
			c, err := NewCompat(CompatOptions{Topology: tc.topo, Layout: cacheLayout(dec.layout), Local: dec.fp, Registerer: reg})
			if err != nil {
				t.Fatal(err)
			}
			j := planned(t, tc.topo)
			var firstErr error
			for i, task := range j.Plan.Tasks {
				ptp := tc.topo.Prefill.TP
				p := worker(t, tc.topo, true, npu.RankPos{TP: task.RemoteRank % ptp, PP: task.PPStage}, 16)
				f := p.fp
				m := job.Meta{EngineID: "P", TERPCPort: 1, NumBlocks: 32, BaseAddrs: p.layout.BaseAddrs(1 << 20)}
				if tc.peer != nil {
					tc.peer(&f, &m)
				}
				m.Cache = &f
				j.Metas[i] = m
				if err := c.Check(context.Background(), j, i); err != nil && firstErr == nil {
					firstErr = err
				}
			}
			if tc.peer == nil {
				if firstErr != nil {
					t.Fatalf("correct peer refused: %v", firstErr)
				}
				return
			}
			var me *MismatchError
			if !errors.As(firstErr, &me) || !errors.Is(firstErr, ErrIncompatible) || me.Mismatches[0].Field != tc.field {
				t.Fatalf("error %v, want a mismatch of %s", firstErr, tc.field)
			}
			if !strings.Contains(firstErr.Error(), tc.reason) {
				t.Fatalf("reason %q, want it to contain %q", firstErr, tc.reason)
			}
			if !c.observe(firstErr) || testutil.ToFloat64(c.mismatches.WithLabelValues(tc.field)) != 1 {
				t.Fatal("mismatch not counted by its field")
			}
		})
	}
}

// TestCompatSeedSegment: a peer without a fingerprint is checked against
// its transfer engine's registered buffers.
func TestCompatSeedSegment(t *testing.T) {
	topo := plan.Topology{Prefill: plan.Parallel{TP: 2, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 1, PP: 1, DP: 1},
		Model: plan.Model{NumLayers: 2, NumKVHeads: 8}}
	dec := worker(t, topo, false, npu.RankPos{}, 16)
	pre := worker(t, topo, true, npu.RankPos{}, 16)
	regions := pre.layout.Regions(1 << 20)
	bufs := func(edit func([]Buffer) []Buffer) SegmentLister {
		return SegmentListerFunc(func(context.Context, string) ([]Buffer, error) {
			out := []Buffer{{Addr: 1, Len: 4096}} // an unrelated registration
			for _, r := range regions {
				out = append(out, Buffer{Addr: r.Addr, Len: r.Len})
			}
			if edit != nil {
				out = edit(out)
			}
			return out, nil
		})
	}
	cases := []struct {
		name     string
		segments SegmentLister
		addrs    []uint64
		want     string // "" ok; else a substring; "ERR" a non-mismatch error
	}{
		{name: "matching", segments: bufs(nil)},
		{name: "no lister", segments: nil},
		{name: "short buffer", segments: bufs(func(b []Buffer) []Buffer { b[2].Len /= 2; return b }),
			want: "the registered buffer at kv_caches_base_addr[1] (part 1) is 32768 bytes, this decode expects 65536 (num_blocks 32 × block_len 2048)"},
		{name: "missing buffer", segments: bufs(func(b []Buffer) []Buffer { return b[:2] }),
			want: "kv_caches_base_addr[1] 0x"},
		{name: "addresses", segments: bufs(nil), addrs: []uint64{1, 2, 3},
			want: "the number of kv_caches_base_addr is 3, this decode expects 4 (2 layers × 2 parts)"},
		{name: "listing fails", segments: SegmentListerFunc(func(context.Context, string) ([]Buffer, error) {
			return nil, errors.New("connection refused")
		}), want: "ERR"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, err := NewCompat(CompatOptions{Topology: topo, Layout: cacheLayout(dec.layout), Local: dec.fp, Segments: tc.segments})
			if err != nil {
				t.Fatal(err)
			}
			j := planned(t, topo)
			addrs := tc.addrs
			if addrs == nil {
				addrs = pre.layout.BaseAddrs(1 << 20)
			}
			for i := range j.Metas {
				j.Metas[i] = job.Meta{EngineID: "P", TERPCPort: 1, NumBlocks: 32, BaseAddrs: addrs}
			}
			err = c.Check(context.Background(), j, 0)
			var me *MismatchError
			switch {
			case tc.want == "":
				if err != nil {
					t.Fatal(err)
				}
			case tc.want == "ERR":
				if err == nil || errors.As(err, &me) || !strings.Contains(err.Error(), "connection refused") {
					t.Fatalf("listing error: %v", err)
				}
			default:
				if !errors.As(err, &me) || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("error %v, want a mismatch containing %q", err, tc.want)
				}
			}
		})
	}
}

// TestStageRefusesPeer: a refused peer's metadata is not cached: every
// later fetch of the same metadata fails with the same reason (also one
// not made by the stage, such as an admission prefetch), counted; once
// the peer comes back with other metadata it is checked afresh.
func TestStageRefusesPeer(t *testing.T) {
	topo := plan.Topology{Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 1, PP: 1, DP: 1},
		Model: plan.Model{NumLayers: 2, NumKVHeads: 8}}
	dec := worker(t, topo, false, npu.RankPos{}, 16)
	bad := worker(t, topo, true, npu.RankPos{}, 32) // another head_dim
	good := worker(t, topo, true, npu.RankPos{}, 16)
	var fetches atomic.Int32
	var cur atomic.Pointer[job.Meta]
	metaOf := func(s side, epoch uint64) *job.Meta {
		f := s.fp
		return &job.Meta{EngineID: "P", TERPCPort: 1, NumBlocks: 32, BaseAddrs: s.layout.BaseAddrs(1 << 20), BootEpoch: epoch, Cache: &f}
	}
	cur.Store(metaOf(bad, 1))
	cache, err := NewCache(FetcherFunc(func(context.Context, string) (job.Meta, error) {
		fetches.Add(1)
		return *cur.Load(), nil
	}), Options{})
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewCompat(CompatOptions{Topology: topo, Layout: cacheLayout(dec.layout), Local: dec.fp})
	if err != nil {
		t.Fatal(err)
	}
	st := Stage{Cache: cache, Compat: c}
	for i := range 2 {
		err := st.Process(context.Background(), planned(t, topo))
		if !errors.Is(err, ErrIncompatible) || !strings.Contains(err.Error(), "head_dim is 32, this decode expects 16") {
			t.Fatalf("request %d: %v", i, err)
		}
		if cache.Len() != 0 {
			t.Fatalf("request %d: refused metadata cached", i)
		}
	}
	if n := testutil.ToFloat64(c.mismatches.WithLabelValues("head_dim")); n != 2 {
		t.Fatalf("head_dim mismatches counted %v, want 2", n)
	}
	if _, err := cache.Get(context.Background(), KeyOf(planned(t, topo), 0)); !errors.Is(err, ErrIncompatible) || cache.Len() != 0 {
		t.Fatalf("a plain Get of refused metadata: %v, %d cached", err, cache.Len())
	}
	cur.Store(metaOf(good, 2)) // restarted with the right shape
	if err := st.Process(context.Background(), planned(t, topo)); err != nil {
		t.Fatalf("restarted peer: %v", err)
	}
	if cache.Len() != 1 || fetches.Load() != 4 {
		t.Fatalf("%d cached, %d fetches; want 1 and 4", cache.Len(), fetches.Load())
	}
}

// BenchmarkCompatCheck is the check's cost per task, paid on every job:
// a kvflow peer (fingerprint) and a seed peer (segment of 2 × 61 buffers).
func BenchmarkCompatCheck(b *testing.B) {
	topo := plan.Topology{Prefill: plan.Parallel{TP: 4, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 2, PP: 1, DP: 1},
		Model: plan.Model{NumLayers: 61, NumKVHeads: 8}}
	dec := worker(b, topo, false, npu.RankPos{}, 128)
	j := planned(b, topo)
	task := j.Plan.Tasks[0]
	pre := worker(b, topo, true, npu.RankPos{TP: task.RemoteRank}, 128)
	var bufs []Buffer
	for _, r := range pre.layout.Regions(1 << 30) {
		bufs = append(bufs, Buffer{Addr: r.Addr, Len: r.Len})
	}
	c, err := NewCompat(CompatOptions{Topology: topo, Layout: cacheLayout(dec.layout), Local: dec.fp,
		Segments: SegmentListerFunc(func(context.Context, string) ([]Buffer, error) { return bufs, nil })})
	if err != nil {
		b.Fatal(err)
	}
	for _, fp := range []*npu.Fingerprint{&pre.fp, nil} {
		name := "fingerprint"
		if fp == nil {
			name = "seed-segment"
		}
		b.Run(name, func(b *testing.B) {
			j.Metas[0] = job.Meta{EngineID: "P", TERPCPort: 1, NumBlocks: 32, BaseAddrs: pre.layout.BaseAddrs(1 << 30), Cache: fp}
			for b.Loop() {
				if err := c.Check(context.Background(), j, 0); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestStageListingFails: a seed peer whose transfer engine cannot be
// listed fails the job (not as a mismatch) and its cached metadata is
// dropped, so the next job fetches fresh metadata (a restarted peer's new
// te_rpc_port).
func TestStageListingFails(t *testing.T) {
	topo := plan.Topology{Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 1, PP: 1, DP: 1},
		Model: plan.Model{NumLayers: 2, NumKVHeads: 8}}
	dec := worker(t, topo, false, npu.RankPos{}, 16)
	cache, err := NewCache(FetcherFunc(func(context.Context, string) (job.Meta, error) {
		return job.Meta{EngineID: "P", TERPCPort: 1, NumBlocks: 32, BaseAddrs: dec.layout.BaseAddrs(1 << 20)}, nil
	}), Options{})
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewCompat(CompatOptions{Topology: topo, Layout: cacheLayout(dec.layout), Local: dec.fp,
		Segments: SegmentListerFunc(func(context.Context, string) ([]Buffer, error) { return nil, errors.New("connection refused") })})
	if err != nil {
		t.Fatal(err)
	}
	err = Stage{Cache: cache, Compat: c}.Process(context.Background(), planned(t, topo))
	if err == nil || errors.Is(err, ErrIncompatible) || !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("error %v", err)
	}
	if cache.Len() != 0 {
		t.Fatal("metadata of an unlisted peer kept")
	}
}
