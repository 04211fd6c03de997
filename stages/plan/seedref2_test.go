package plan

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
)

func TestSeedGroupContiguous(t *testing.T) {
	f := load[struct {
		Cases []struct {
			Src    []int `json:"src"`
			Dst    []int `json:"dst"`
			Expect struct {
				Src [][]int `json:"src_groups"`
				Dst [][]int `json:"dst_groups"`
			} `json:"expect"`
		} `json:"cases"`
	}](t, "group_concurrent_contiguous")
	if len(f.Cases) == 0 {
		t.Fatal("no cases")
	}
	for i, c := range f.Cases {
		s, d, err := GroupContiguous(c.Src, c.Dst)
		if err != nil || !equal2(s, c.Expect.Src) || !equal2(d, c.Expect.Dst) {
			t.Errorf("case %d: %v %v -> %v %v, %v; want %v %v", i, c.Src, c.Dst, s, d, err, c.Expect.Src, c.Expect.Dst)
		}
	}
	if _, _, err := GroupContiguous([]int{1}, nil); err == nil {
		t.Error("unequal lengths accepted")
	}
	t.Logf("%d cases", len(f.Cases))
}

type addCall struct {
	RequestID string `json:"request_id"`
	Local     []int  `json:"local_block_ids"`
	Remote    []int  `json:"remote_block_ids"`
	EngineID  string `json:"remote_engine_id"`
	Host      string `json:"remote_host"`
	Port      int    `json:"remote_handshake_port"`
	Offset    int    `json:"offset"`
	P         int    `json:"tp_num_need_pulls"`
	Last      bool   `json:"all_task_done"`
}

func (a addCall) String() string {
	return fmt.Sprintf("{%q %v %v port=%d off=%d P=%d last=%v}", a.RequestID, a.Local, a.Remote, a.Port, a.Offset, a.P, a.Last)
}

func callsOf(pl Plan, req Request) []addCall {
	var out []addCall
	for _, tk := range pl.Tasks {
		out = append(out, addCall{pl.RequestID, tk.LocalBlockIDs, tk.RemoteBlockIDs, pl.RemoteEngineID, pl.RemoteHost,
			tk.HandshakePort, tk.Offset, tk.P, tk.Last})
	}
	return out
}

func callsEqual(a, b []addCall) bool {
	return slices.EqualFunc(a, b, func(x, y addCall) bool {
		return x.RequestID == y.RequestID && slices.Equal(x.Local, y.Local) && slices.Equal(x.Remote, y.Remote) &&
			x.EngineID == y.EngineID && x.Host == y.Host && x.Port == y.Port && x.Offset == y.Offset && x.P == y.P && x.Last == y.Last
	})
}

// partitionLayers is the layer count a VLLM_PP_LAYER_PARTITION implies.
func partitionLayers(t *testing.T, s string) int {
	n := 0
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			t.Fatalf("partition %q: %v", s, err)
		}
		n += v
	}
	return n
}

func TestSeedStartLoadKV(t *testing.T) {
	type scase struct {
		Scenario  string      `json:"scenario"`
		PCPEnable bool        `json:"prefill_context_parallel_enable"`
		Partition *string     `json:"vllm_pp_layer_partition"`
		Worker    splitWorker `json:"worker"`
		Requests  []splitMeta `json:"requests"`
		Calls     []addCall   `json:"add_request_calls"`
		Done      []struct {
			Path string `json:"path"`
		} `json:"done_messages"`
		Finished []string `json:"finished_recving"`
		Exc      string   `json:"exception"`
	}
	f := load[struct {
		Cases   []scase `json:"cases"`
		Raising []scase `json:"raising_cases"`
	}](t, "start_load_kv")
	if len(f.Cases) == 0 {
		t.Fatal("no cases")
	}
	stats := map[string]int{}
	for i, c := range append(f.Cases, f.Raising...) {
		raising := i >= len(f.Cases)
		t.Run(name(i, c.Scenario), func(t *testing.T) {
			var ourCalls []addCall // calls of the requests kvflow plans as the seed does
			var finished []string
			for _, m := range c.Requests {
				tp, r := c.Worker.topo(m)
				if c.Partition != nil {
					tp.PPLayerPartition = *c.Partition
					tp.Model.NumLayers = partitionLayers(t, *c.Partition)
				}
				req := m.request(m.ReqID)
				pl, err := PlanRequest(tp, r, req)
				cp := tp.Mode() != ModeTP
				switch {
				case c.Worker.isSparseNoMLA():
					// §5b.8: rejected.
					stats["sparse without MLA rejected"]++
					if err == nil {
						t.Fatalf("sparse without MLA planned: %+v", pl)
					}
					return
				case err != nil:
					t.Fatalf("request %q: %v", m.ReqID, err)
				}
				if len(pl.Tasks) > 0 && pl.Tasks[len(pl.Tasks)-1].Last {
					finished = append(finished, pl.RequestID)
				}
				got := callsOf(pl, req)
				if cp && !c.PCPEnable {
					t.Fatalf("vector has context parallel sizes with prefill_context_parallel_enable false")
				}
				_, entries, _ := SplitMetadata(tp, r, req)
				empty := true
				for _, e := range entries {
					empty = empty && len(e.LocalBlockIDs)+len(e.RemoteBlockIDs) == 0
				}
				switch {
				case cp && empty:
					// §5b.4: notify every remote rank with an empty task.
					stats["all-empty context parallel notified"]++
					var exp []addCall
					for _, e := range entries {
						for o, port := range e.Ports[:pl.P] {
							exp = append(exp, addCall{m.ReqID, nil, nil, "engine-P", "192.0.2.20", port, o, pl.P, false})
						}
					}
					exp[len(exp)-1].Last = true
					if !callsEqual(got, exp) {
						t.Errorf("all-empty request %q: got %v, want %v", m.ReqID, got, exp)
					}
					continue
				case tp.Mode() == ModePointToPoint && tp.NeedPulls() > 1:
					// §5b.2: all P ports (the seed raises IndexError).
					stats["point_to_point P>1 corrected"]++
					exp := correctedP2P(t, tp, r, req)
					var want []addCall
					for o, port := range exp[0].Ports {
						want = append(want, addCall{m.ReqID, req.LocalBlockIDs, req.RemoteBlockIDs, "engine-P", "192.0.2.20", port, o, pl.P, o == pl.P-1})
					}
					if !callsEqual(got, want) {
						t.Errorf("request %q: got %v, want %v", m.ReqID, got, want)
					}
					continue
				}
				ourCalls = append(ourCalls, got...)
			}
			if raising {
				if !strings.Contains(c.Exc, "Error") {
					t.Fatalf("unexpected raising case %q", c.Exc)
				}
				return
			}
			// Compare the non-deviating requests' calls with the seed's, in order.
			if !callsEqual(ourCalls, c.Calls) {
				t.Errorf("add_request calls\n got %v\nwant %v", ourCalls, c.Calls)
			}
			// Every seed DONE goes where a task says; finished = requests with a Last task.
			var seedDone []int
			for _, d := range c.Done {
				p, _ := strconv.Atoi(d.Path[strings.LastIndexByte(d.Path, ':')+1:])
				seedDone = append(seedDone, p)
			}
			var ourDone []int
			for _, g := range ourCalls {
				ourDone = append(ourDone, g.Port)
			}
			if !slices.Equal(ourDone, seedDone) {
				t.Errorf("DONE ports %v, seed %v", ourDone, seedDone)
			}
			for _, id := range c.Finished {
				if !slices.Contains(finished, id) {
					t.Errorf("seed finished %q, kvflow has no last task for it", id)
				}
			}
			for _, id := range finished {
				if !slices.Contains(c.Finished, id) {
					stats["finished where the seed hangs"]++
				}
			}
			stats["seed-identical scenarios"]++
		})
	}
	t.Logf("%d cases + %d raising: %v", len(f.Cases), len(f.Raising), stats)
}

func TestSeedTransferKVCache(t *testing.T) {
	type batch struct {
		Session string   `json:"session_id"`
		Src     []uint64 `json:"src_list"`
		Dst     []uint64 `json:"dst_list"`
		Len     []uint64 `json:"length_list"`
	}
	type tcase struct {
		Scenario  string  `json:"scenario"`
		Partition *string `json:"vllm_pp_layer_partition"`
		Thread    struct {
			BlockLen  []uint64 `json:"block_len"`
			Layers    int      `json:"num_hidden_layers"`
			CPL       int      `json:"num_cache_per_layer"`
			PrefillPP int      `json:"prefill_pp_size"`
			LocalBase []uint64 `json:"local_kv_caches_base_addr"`
		} `json:"thread"`
		Req    addCall `json:"req_meta"`
		Remote *struct {
			Base   []uint64 `json:"kv_caches_base_addr"`
			TEPort int      `json:"te_rpc_port"`
		} `json:"remote_metadata"`
		Expect struct {
			Batches []batch `json:"batch_transfer_sync_read"`
			Cat     []struct {
				BlockIDs [][]int `json:"block_ids"`
				P        int     `json:"tp_num_need_pulls"`
			} `json:"cat_kv_cache"`
		} `json:"expect"`
		Batches []batch `json:"batch_transfer_sync_read"` // raising cases
		Exc     string  `json:"exception"`
	}
	f := load[struct {
		Cases   []tcase `json:"cases"`
		Raising []tcase `json:"raising_cases"`
	}](t, "transfer_kv_cache")
	if len(f.Cases) == 0 {
		t.Fatal("no cases")
	}
	nops := 0
	for i, c := range append(f.Cases, f.Raising...) {
		raising := i >= len(f.Cases)
		t.Run(name(i, c.Scenario), func(t *testing.T) {
			th, rq := c.Thread, c.Req
			part := ""
			if c.Partition != nil {
				part = *c.Partition
			}
			stage := rq.Offset / rq.P
			lo, hi, err := PPIndices(th.Layers, stage, th.PrefillPP, part)
			if err != nil {
				t.Fatal(err)
			}
			task := Task{Offset: rq.Offset, P: rq.P, HeadSlot: rq.Offset % rq.P, PPStage: stage, LayerStart: lo, LayerEnd: hi,
				LocalBlockIDs: rq.Local, RemoteBlockIDs: rq.Remote, Last: rq.Last}
			var remote []uint64
			if c.Remote != nil {
				remote = c.Remote.Base
			} else {
				// README convention: the P rank on port 30000+g serves
				// 0x70000000 + 0x40000000*g + 0x1000000*i for its stage's tensors.
				g := uint64(rq.Port - 30000)
				for k := 0; k < (hi-lo)*th.CPL; k++ {
					remote = append(remote, 0x70000000+0x40000000*g+0x1000000*uint64(k))
				}
			}
			layout := CacheLayout{BlockLen: th.BlockLen, CachesPerLayer: th.CPL}
			ops, err := Ops(layout, task, Caches{Base: th.LocalBase}, Caches{Base: remote})
			want := c.Expect.Batches
			if raising {
				want = c.Batches
				if len(want) == 0 { // raised before any transfer: an input error
					if err == nil {
						t.Fatalf("seed raised %s before transferring; kvflow planned %d ops", c.Exc, len(ops))
					}
					return
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			var src, dst, ln []uint64
			for _, b := range want {
				src, dst, ln = append(src, b.Src...), append(dst, b.Dst...), append(ln, b.Len...)
			}
			if len(ops) != len(src) {
				t.Fatalf("%d ops, seed %d", len(ops), len(src))
			}
			for j, op := range ops {
				if op.Local != src[j] || op.Remote != dst[j] || op.Len != ln[j] {
					t.Fatalf("op %d = %+v, seed {%d %d %d}", j, op, src[j], dst[j], ln[j])
				}
			}
			if got := OpCount(task, layout); got != len(ops) {
				t.Errorf("OpCount %d, ops %d", got, len(ops))
			}
			nops += len(ops)
			if raising {
				return
			}
			wantCat := len(c.Expect.Cat) > 0
			if got := NeedsStitch(rq.Offset, rq.P, th.PrefillPP) && len(rq.Local) > 0; got != wantCat {
				t.Errorf("stitch %v, seed cat_kv_cache %v", got, c.Expect.Cat)
			}
			for _, cat := range c.Expect.Cat {
				if cat.P != rq.P || len(cat.BlockIDs) != len(rq.Local) {
					t.Errorf("cat_kv_cache %v", cat)
				}
				for j, b := range cat.BlockIDs {
					if len(b) != 1 || b[0] != rq.Local[j] {
						t.Errorf("cat_kv_cache block_ids %v, local %v", cat.BlockIDs, rq.Local)
						break
					}
				}
			}
		})
	}
	t.Logf("%d cases + %d raising, %d ops compared", len(f.Cases), len(f.Raising), nops)
}
