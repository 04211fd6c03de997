package plan

import (
	"encoding/hex"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"testing"

	"github.com/kvflow/kvflow/internal/tooling/testkit"
)

// load decodes the seed vectors of family (testdata/seedref/<family>.json,
// or $KVFLOW_SEEDREF_DIR's).
func load[T any](t testing.TB, family string) T {
	t.Helper()
	var v T
	testkit.SeedrefJSON(t, family+".json", &v)
	return v
}

// name is a short, unique-enough subtest name.
func name(i int, parts ...any) string {
	s := strconv.Itoa(i)
	for _, p := range parts {
		s += "/" + fmt.Sprint(p)
	}
	return s
}

func TestSeedStringToInt64Hash(t *testing.T) {
	f := load[struct {
		Cases []struct {
			ReqID   string `json:"req_id"`
			UTF8Hex string `json:"req_id_utf8_hex"`
			Hash    uint64 `json:"hash"`
			HashDec string `json:"hash_dec"`
		} `json:"cases"`
	}](t, "string_to_int64_hash")
	if len(f.Cases) == 0 {
		t.Fatal("no cases")
	}
	for i, c := range f.Cases {
		if got := hex.EncodeToString([]byte(c.ReqID)); got != c.UTF8Hex {
			t.Errorf("case %d: id decodes to utf-8 %s, vector says %s", i, got, c.UTF8Hex)
			continue
		}
		dec, err := strconv.ParseUint(c.HashDec, 10, 64)
		if err != nil || dec != c.Hash {
			t.Errorf("case %d: hash %d vs hash_dec %q", i, c.Hash, c.HashDec)
		}
		if got := StringToInt64Hash(c.ReqID); got != c.Hash {
			t.Errorf("case %d: StringToInt64Hash(%q) = %d, want %d", i, c.ReqID, got, c.Hash)
		}
	}
	t.Logf("%d cases", len(f.Cases))
}

type rankCfg struct {
	PrefillTP int  `json:"prefill_tp"`
	DecodeTP  int  `json:"decode_tp"`
	PrefillPP int  `json:"prefill_pp"`
	Heads     int  `json:"num_key_value_heads"`
	MLA       bool `json:"is_deepseek_mla"`
	Sparse    bool `json:"use_sparse"`
	P         int  `json:"tp_num_need_pulls"`
}

// topo builds a topology from a seed worker config; layers defaults to
// 4 per prefill stage.
func (c rankCfg) topo() Topology {
	pp := max(c.PrefillPP, 1)
	return Topology{
		Prefill: Parallel{TP: c.PrefillTP, PP: pp, DP: 1},
		Decode:  Parallel{TP: c.DecodeTP, PP: 1, DP: 1},
		Model:   Model{NumLayers: 4 * pp, NumKVHeads: c.Heads, MLA: c.MLA, Sparse: c.Sparse},
	}
}

// isSparseNoMLA is the §5b.8 rule: kvflow rejects these topologies.
func (c rankCfg) isSparseNoMLA() bool { return c.Sparse && !c.MLA }

func TestSeedGetRemoteRanks(t *testing.T) {
	f := load[struct {
		Cases []struct {
			Config   rankCfg `json:"config"`
			ReqID    string  `json:"req_id"`
			SeedHash uint64  `json:"seed_hash"`
			ForReq   [][]int `json:"remote_ranks_for_req"`
			Prefill  []int   `json:"prefill_get_remote_rank"`
			ByTP     [][]int `json:"remote_rank_by_tp_rank"`
		} `json:"cases"`
		Raising []struct {
			Config rankCfg `json:"config"`
			ReqID  string  `json:"req_id"`
			Call   string  `json:"call"`
			Exc    string  `json:"exception"`
		} `json:"raising_cases"`
	}](t, "get_remote_ranks")
	if len(f.Cases) == 0 {
		t.Fatal("no cases")
	}
	valid := 0
	for i, c := range f.Cases {
		tp := c.Config.topo()
		if got := StringToInt64Hash(c.ReqID); got != c.SeedHash {
			t.Errorf("case %d: hash %d, want %d", i, got, c.SeedHash)
		}
		if got := tp.NeedPulls(); got != c.Config.P {
			t.Errorf("case %d %+v: tp_num_need_pulls %d, want %d", i, c.Config, got, c.Config.P)
		}
		got, err := tp.RemoteRanksForReq(c.ReqID)
		if err != nil || !equal2(got, c.ForReq) {
			t.Errorf("case %d %+v %q: _get_remote_ranks_for_req = %v, %v; want %v", i, c.Config, c.ReqID, got, err, c.ForReq)
			continue
		}
		flat, err := tp.PrefillRemoteRanks(c.ReqID)
		if err != nil || !slices.Equal(flat, c.Prefill) {
			t.Errorf("case %d: _prefill_get_remote_rank = %v, %v; want %v", i, flat, err, c.Prefill)
		}
		for r, want := range c.ByTP {
			got, err := tp.RemoteRanks(c.ReqID, r)
			if err != nil || !slices.Equal(got, want) {
				t.Errorf("case %d: _get_remote_rank(tp_rank=%d) = %v, %v; want %v", i, r, got, err, want)
			}
		}
		if tp.Validate() == nil {
			valid++
			// A validated topology gives every decode rank exactly P*pp ranks.
			for r := range c.ByTP {
				if n := len(c.ByTP[r]); n != c.Config.P*tp.Prefill.PP {
					t.Errorf("case %d: validated topology but rank %d has %d ranks, want %d", i, r, n, c.Config.P*tp.Prefill.PP)
				}
			}
		} else if c.Config.isSparseNoMLA() {
			continue
		}
	}
	callRE := regexp.MustCompile(`^_get_remote_rank\(tp_rank=(\d+)\)$`)
	for i, c := range f.Raising {
		tp := c.Config.topo()
		var err error
		if m := callRE.FindStringSubmatch(c.Call); m != nil {
			r, _ := strconv.Atoi(m[1])
			_, err = tp.RemoteRanks(c.ReqID, r)
		} else if c.Call == "_prefill_get_remote_rank" {
			_, err = tp.PrefillRemoteRanks(c.ReqID)
		} else {
			_, err = tp.RemoteRanksForReq(c.ReqID)
		}
		if err == nil {
			t.Errorf("raising %d %+v: %s: no error, seed raised %s", i, c.Config, c.Call, c.Exc)
		}
		if tp.Validate() == nil {
			t.Errorf("raising %d %+v: Validate accepted a topology the seed fails on", i, c.Config)
		}
	}
	t.Logf("%d cases (%d with a topology Validate accepts), %d raising", len(f.Cases), valid, len(f.Raising))
}

func equal2(a, b [][]int) bool {
	return slices.EqualFunc(a, b, func(x, y []int) bool { return slices.Equal(x, y) })
}

func TestSeedPrefillSendDecision(t *testing.T) {
	f := load[struct {
		Cases []struct {
			Worker struct {
				rankCfg
				TPRank int `json:"tp_rank"`
				PPRank int `json:"pp_rank"`
			} `json:"worker"`
			Requests [][2]any `json:"requests_to_send"`
			Expect   struct {
				Delayed     [][2]any `json:"delayed"`
				NotTransfer []string `json:"not_transfer"`
			} `json:"expect"`
		} `json:"cases"`
	}](t, "prefill_send_decision")
	if len(f.Cases) == 0 {
		t.Fatal("no cases")
	}
	n := 0
	for i, c := range f.Cases {
		tp := c.Worker.topo()
		if err := tp.Validate(); err != nil {
			t.Errorf("case %d: %v", i, err)
			continue
		}
		var delayed [][2]any
		var notTransfer []string
		for _, r := range c.Requests {
			id := r[0].(string)
			wait, err := PrefillMustWait(tp, Rank{TP: c.Worker.TPRank, PP: c.Worker.PPRank}, id, 1)
			if err != nil {
				t.Fatalf("case %d: %v", i, err)
			}
			if wait {
				delayed = append(delayed, r)
			} else {
				notTransfer = append(notTransfer, id)
			}
			n++
		}
		// not_transfer lands in the tracker's finished set: its order is not
		// the seed's to keep, so compare it as a set.
		wantNot := slices.Sorted(slices.Values(c.Expect.NotTransfer))
		slices.Sort(notTransfer)
		if fmt.Sprint(delayed) != fmt.Sprint(c.Expect.Delayed) || !slices.Equal(notTransfer, wantNot) {
			t.Errorf("case %d %+v: delayed %v not_transfer %v; want %v %v", i, c.Worker, delayed, notTransfer, c.Expect.Delayed, c.Expect.NotTransfer)
		}
	}
	t.Logf("%d cases, %d requests", len(f.Cases), n)
}

type portInputs struct {
	Prefill *struct {
		TP *int `json:"tp_size"`
		DP *int `json:"dp_size"`
		PP *int `json:"pp_size"`
	} `json:"prefill"`
	Decode *struct {
		TP *int `json:"tp_size"`
		DP *int `json:"dp_size"`
		PP *int `json:"pp_size"`
	} `json:"decode"`
	Heads      int  `json:"num_key_value_heads"`
	MLA        bool `json:"is_deepseek_mla"`
	TPSize     int  `json:"tensor_parallel_size"`
	TPRank     int  `json:"tp_rank"`
	PPSize     int  `json:"pipeline_parallel_size"`
	PPRank     int  `json:"pp_rank"`
	DPRank     int  `json:"data_parallel_rank"`
	DPLocal    int  `json:"data_parallel_size_local"`
	PCPEnabled bool `json:"prefill_context_parallel_enable"`
	PCPWorld   int  `json:"pcp_world_size"`
	PCPRank    int  `json:"pcp_rank"`
	DCPWorld   int  `json:"dcp_world_size"`
	DCPRank    int  `json:"dcp_rank"`
	KVPort     int  `json:"kv_port"`
}

func deref(p *int) int {
	if p == nil {
		return 0 // missing key: Validate reports it
	}
	return *p
}

// worker is the worker's own parallel config and rank; pcp only counts when
// prefill context parallel is enabled.
func (in portInputs) worker() (Parallel, Rank) {
	pcp, pcpRank := 1, 0
	if in.PCPEnabled {
		pcp = in.PCPWorld
		if pcp > 1 {
			pcpRank = in.PCPRank
		}
	}
	dcpRank := 0
	if in.DCPWorld > 1 {
		dcpRank = in.DCPRank
	}
	return Parallel{TP: in.TPSize, PP: in.PPSize, DP: in.DPLocal, PCP: pcp, DCP: in.DCPWorld, KVPort: in.KVPort},
		Rank{TP: in.TPRank, PP: in.PPRank, DP: in.DPRank, PCP: pcpRank, DCP: dcpRank}
}

func (in portInputs) topo() Topology {
	var t Topology
	if in.Prefill != nil {
		t.Prefill = Parallel{TP: deref(in.Prefill.TP), DP: deref(in.Prefill.DP), PP: 1}
		if in.Prefill.PP != nil {
			t.Prefill.PP = *in.Prefill.PP
		}
	}
	if in.Decode != nil {
		t.Decode = Parallel{TP: deref(in.Decode.TP), DP: deref(in.Decode.DP), PP: 1}
		if in.Decode.PP != nil {
			t.Decode.PP = *in.Decode.PP
		}
	}
	t.Model = Model{NumLayers: 4 * max(t.Prefill.PP, 1), NumKVHeads: in.Heads, MLA: in.MLA}
	return t
}

func TestSeedTPNumNeedPullsAndPorts(t *testing.T) {
	f := load[struct {
		Cases []struct {
			Kind   string     `json:"kind"`
			Inputs portInputs `json:"inputs"`
			Expect struct {
				P           int `json:"tp_num_need_pulls"`
				SideChannel int `json:"side_channel_port"`
				Handshake   int `json:"handshake_port"`
				MaxDevice   int `json:"max_device_id"`
				PCPSize     int `json:"pcp_size"`
				PCPRank     int `json:"pcp_rank"`
				DCPSize     int `json:"dcp_size"`
				DCPRank     int `json:"dcp_rank"`
			} `json:"expect"`
		} `json:"cases"`
		Raising []struct {
			Inputs portInputs `json:"inputs"`
			Exc    string     `json:"exception"`
			Msg    string     `json:"message"`
		} `json:"raising_cases"`
	}](t, "tp_num_need_pulls")
	if len(f.Cases) == 0 {
		t.Fatal("no cases")
	}
	for i, c := range f.Cases {
		in := c.Inputs
		par, r := in.worker()
		ptp := deref(in.Prefill.TP)
		e := c.Expect
		if got := NeedPulls(Model{NumKVHeads: in.Heads, MLA: in.MLA}, ptp, in.TPSize); got != e.P {
			t.Errorf("case %d (%s): tp_num_need_pulls %d, want %d", i, c.Kind, got, e.P)
		}
		if got := SideChannelPort(in.KVPort, par, r.DP); got != e.SideChannel {
			t.Errorf("case %d (%s): side_channel_port %d, want %d", i, c.Kind, got, e.SideChannel)
		}
		if got := HandshakePort(in.KVPort, par, r); got != e.Handshake {
			t.Errorf("case %d (%s): handshake_port %d, want %d", i, c.Kind, got, e.Handshake)
		}
		if got := par.Workers(); got != e.MaxDevice {
			t.Errorf("case %d (%s): max_device_id %d, want %d", i, c.Kind, got, e.MaxDevice)
		}
		if par.pcp() != e.PCPSize || r.PCP != e.PCPRank || par.dcp() != e.DCPSize || r.DCP != e.DCPRank {
			t.Errorf("case %d (%s): pcp %d/%d dcp %d/%d, want %d/%d %d/%d", i, c.Kind, par.pcp(), r.PCP, par.dcp(), r.DCP, e.PCPSize, e.PCPRank, e.DCPSize, e.DCPRank)
		}
	}
	for i, c := range f.Raising {
		par, _ := c.Inputs.worker()
		tp := c.Inputs.topo()
		err := tp.Validate()
		werr := par.Validate("worker")
		if err == nil && werr == nil && tp.NeedsKvflowPeer() {
			// The seed refuses decode tp > prefill tp and decode pp > 1;
			// kvflow serves them between kvflow nodes (package docs).
			t.Logf("raising %d (%s %q): kvflow-only topology, accepted", i, c.Exc, c.Msg)
			continue
		}
		if err == nil && werr == nil {
			t.Errorf("raising %d: no validation error; seed raised %s %q", i, c.Exc, c.Msg)
			continue
		}
		t.Logf("raising %d (%s %q): %v %v", i, c.Exc, c.Msg, err, werr)
	}
	t.Logf("%d cases, %d raising", len(f.Cases), len(f.Raising))
}

type splitWorker struct {
	rankCfg
	UseMLA  bool `json:"use_mla"`
	TPSize  int  `json:"tp_size"`
	TPRank  int  `json:"tp_rank"`
	PCPSize int  `json:"pcp_size"`
	PCPRank int  `json:"pcp_rank"`
	DCPSize int  `json:"dcp_size"`
}

type splitMeta struct {
	ReqID     string `json:"req_id"`
	Local     []int  `json:"local_block_ids"`
	Remote    []int  `json:"remote_block_ids"`
	Port      int    `json:"remote_port"`
	RemotePCP int    `json:"remote_pcp_size"`
	RemoteDCP int    `json:"remote_dcp_size"`
}

func (w splitWorker) topo(m splitMeta) (Topology, Rank) {
	tp := w.rankCfg.topo()
	tp.Decode.TP = w.TPSize
	tp.Decode.PCP, tp.Decode.DCP = w.PCPSize, w.DCPSize
	tp.Prefill.PCP, tp.Prefill.DCP = m.RemotePCP, m.RemoteDCP
	return tp, Rank{TP: w.TPRank, PCP: w.PCPRank}
}

func (m splitMeta) request(id string) Request {
	return Request{ID: id, LocalBlockIDs: m.Local, RemoteBlockIDs: m.Remote, RemotePort: m.Port,
		RemotePCPSize: m.RemotePCP, RemoteDCPSize: m.RemoteDCP, RemoteHost: "192.0.2.20", RemoteEngineID: "engine-P"}
}

// correctedP2P is kvflow's point-to-point answer (§5b.1-3): the context
// shard's prefill ranks at stride prefill_tp, all P ports (the plain rank
// choice's ranks when P > 1), all local and remote blocks in one entry.
func correctedP2P(t *testing.T, tp Topology, r Rank, req Request) []Entry {
	t.Helper()
	base := req.RemotePort + r.PCP*tp.Prefill.TP
	var ports []int
	if p := tp.NeedPulls(); p == 1 {
		ports = []int{base + r.TP}
	} else {
		ranks, err := tp.RemoteRanks(req.ID, r.TP)
		if err != nil {
			t.Fatal(err)
		}
		for _, x := range ranks[:p] {
			ports = append(ports, base+x)
		}
	}
	return []Entry{{ports, req.LocalBlockIDs, req.RemoteBlockIDs}}
}

func entriesEqual(a []Entry, ports [][]int, local, remote [][]int) bool {
	if len(a) != len(ports) || len(a) != len(local) || len(a) != len(remote) {
		return false
	}
	for i, e := range a {
		if !slices.Equal(e.Ports, ports[i]) || !slices.Equal(e.LocalBlockIDs, local[i]) || !slices.Equal(e.RemoteBlockIDs, remote[i]) {
			return false
		}
	}
	return true
}

func TestSeedKVSplitMetadata(t *testing.T) {
	type kcase struct {
		Label  string      `json:"label"`
		Branch string      `json:"branch"`
		Worker splitWorker `json:"worker"`
		ReqID  string      `json:"req_id"`
		Meta   splitMeta   `json:"meta"`
		Expect struct {
			Ports  [][]int `json:"remote_handshake_port_list"`
			Local  [][]int `json:"local_block_ids_list"`
			Remote [][]int `json:"remote_block_ids_list"`
		} `json:"expect"`
		Exc string `json:"exception"`
		Msg string `json:"message"`
	}
	f := load[struct {
		Cases   []kcase `json:"cases"`
		Raising []kcase `json:"raising_cases"`
	}](t, "kv_split_metadata")
	if len(f.Cases) == 0 {
		t.Fatal("no cases")
	}
	dev := map[string]int{}
	for i, c := range append(f.Cases, f.Raising...) {
		raising := i >= len(f.Cases)
		tp, r := c.Worker.topo(c.Meta)
		req := c.Meta.request(c.ReqID)
		mode, got, err := SplitMetadata(tp, r, req)
		if mode.String() != c.Branch && !(mode == ModeTP && c.Branch == "all_one") {
			t.Errorf("case %d (%s): mode %v, seed branch %s", i, c.Label, mode, c.Branch)
		}
		want := c.Expect
		switch {
		case mode == ModePointToPoint && (tp.NeedPulls() > 1 || (r.PCP > 0 && tp.Prefill.TP != tp.Decode.TP) || len(req.LocalBlockIDs) != len(req.RemoteBlockIDs)):
			// §5b.1 (port stride), §5b.2 (all ports), §5b.3 (prefix hit).
			dev["point_to_point corrected"]++
			exp := correctedP2P(t, tp, r, req)
			if err != nil || !slices.EqualFunc(got, exp, func(a, b Entry) bool {
				return slices.Equal(a.Ports, b.Ports) && slices.Equal(a.LocalBlockIDs, b.LocalBlockIDs) && slices.Equal(a.RemoteBlockIDs, b.RemoteBlockIDs)
			}) {
				t.Errorf("case %d (%s) %+v %+v: got %+v, %v; kvflow's corrected answer %+v", i, c.Label, c.Worker, c.Meta, got, err, exp)
			}
			if raising && tp.Validate() != nil {
				t.Errorf("case %d (%s): Validate rejects a topology kvflow handles: %v", i, c.Label, tp.Validate())
			}
		case mode == ModeSplit && c.Meta.RemoteDCP/max(c.Worker.DCPSize, 1) > tp.Prefill.TP:
			// §5b.11: the seed dials duplicate ports; kvflow rejects.
			dev["split duplicate ports rejected"]++
			if err == nil || tp.Validate() == nil {
				t.Errorf("case %d (%s): remote dcp %d > prefill tp %d accepted (%v)", i, c.Label, c.Meta.RemoteDCP, tp.Prefill.TP, err)
			}
		case raising:
			if err == nil {
				t.Errorf("raising %d (%s) %+v %+v: no error, seed raised %s %q; got %+v", i, c.Label, c.Worker, c.Meta, c.Exc, c.Msg, got)
			}
			if tp.Validate() == nil {
				t.Errorf("raising %d (%s): Validate accepts it", i, c.Label)
			}
			dev["raising"]++
		default:
			if err != nil || !entriesEqual(got, want.Ports, want.Local, want.Remote) {
				t.Errorf("case %d (%s) %+v %+v: got %+v, %v; want %+v", i, c.Label, c.Worker, c.Meta, got, err, want)
			}
			if err := tp.Validate(); err != nil && !c.Worker.isSparseNoMLA() {
				t.Errorf("case %d (%s): Validate rejects a seed configuration: %v", i, c.Label, err)
			}
			dev["seed"]++
		}
	}
	t.Logf("%d cases + %d raising: %v", len(f.Cases), len(f.Raising), dev)
}
