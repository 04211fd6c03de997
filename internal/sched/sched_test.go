package sched

import (
	"bytes"
	"encoding/json"
	"os"
	"reflect"
	"strings"
	"testing"
)

// The op scripts of testdata/cases.json, which
// clients/python/tests/test_scheduler_cases.py runs against the Python
// port too.
type casesFile struct {
	EngineID  string  `json:"engine_id"`
	Host      string  `json:"host"`
	Port      int     `json:"port"`
	BlockSize int     `json:"block_size"`
	Clock     float64 `json:"clock"`
	Cases     []struct {
		Name     string `json:"name"`
		Requests map[string]struct {
			Params    map[string]any `json:"params"`
			PromptLen int            `json:"prompt_len"`
			Output    []int          `json:"output"`
			Status    string         `json:"status"`
		} `json:"requests"`
		Ops []struct {
			Op        string          `json:"op"`
			Req       string          `json:"req"`
			Computed  int             `json:"computed"`
			Unhashed  []int           `json:"unhashed"`
			Ext       int             `json:"ext"`
			Blocks    []int           `json:"blocks"`
			IDs       []string        `json:"ids"`
			Key       string          `json:"key"`
			Epochs    []uint64        `json:"epochs"`
			Want      json.RawMessage `json:"want"`
			WantError string          `json:"want_error"`
		} `json:"ops"`
	} `json:"cases"`
}

type metaJSON struct {
	Requests []recvJSON `json:"requests"`
	ToSend   [][2]any   `json:"to_send"`
	ToAbort  []string   `json:"to_abort"`
}

type recvJSON struct {
	ID     string  `json:"id"`
	Local  []int   `json:"local"`
	Remote []int   `json:"remote"`
	Engine string  `json:"engine"`
	Host   *string `json:"host"`
	Port   int     `json:"port"`
	PCP    int     `json:"pcp"`
	DCP    int     `json:"dcp"`
	Epochs []int64 `json:"boot_epochs,omitempty"`
}

func TestSharedCases(t *testing.T) {
	raw, err := os.ReadFile("testdata/cases.json")
	if err != nil {
		t.Fatal(err)
	}
	var f casesFile
	if err := json.Unmarshal(raw, &f); err != nil {
		t.Fatal(err)
	}
	if len(f.Cases) < 20 {
		t.Fatalf("%d cases", len(f.Cases))
	}
	for _, c := range f.Cases {
		t.Run(c.Name, func(t *testing.T) {
			s := &Rules{EngineID: f.EngineID, Host: f.Host, Port: f.Port, BlockSize: f.BlockSize,
				Clock: func() float64 { return f.Clock }}
			reqs := map[string]*Request{}
			for id, r := range c.Requests {
				reqs[id] = &Request{ID: id, Params: r.Params, PromptLen: r.PromptLen, OutputTokenIDs: r.Output, Status: r.Status}
			}
			for i, op := range c.Ops {
				var got any
				var err error
				switch op.Op {
				case "matched":
					n, async, e := s.MatchedTokens(reqs[op.Req], op.Computed)
					got, err = []any{n, async}, e
				case "alloc":
					err = s.AfterAlloc(reqs[op.Req], op.Unhashed, op.Ext)
				case "meta":
					got = toJSON(s.BuildMeta())
				case "finished":
					d, h := s.RequestFinished(reqs[op.Req], op.Blocks)
					hj, _ := json.Marshal(h)
					got = []any{d, json.RawMessage(hj)}
				case "recv_done":
					s.FinishedRecving(op.IDs)
				case "param":
					got = reqs[op.Req].Params[op.Key]
				case "boot_epochs":
					s.BootEpochs = op.Epochs
				default:
					t.Fatalf("op %d: unknown op %q", i, op.Op)
				}
				if op.WantError != "" {
					if err == nil || !strings.Contains(err.Error(), op.WantError) {
						t.Fatalf("op %d (%s): error %v, want %q", i, op.Op, err, op.WantError)
					}
					continue
				}
				if err != nil {
					t.Fatalf("op %d (%s): %v", i, op.Op, err)
				}
				if op.Want == nil {
					continue
				}
				if !sameJSON(t, got, op.Want) {
					g, _ := json.Marshal(got)
					t.Fatalf("op %d (%s): got %s\nwant %s", i, op.Op, g, op.Want)
				}
			}
		})
	}
}

func toJSON(m Meta) metaJSON {
	out := metaJSON{Requests: []recvJSON{}, ToSend: [][2]any{}, ToAbort: []string{}}
	for _, r := range m.Recvs {
		host := &r.RemoteHost
		if r.RemoteHost == "" {
			host = nil // the seed passes a null remote_host through (keys are checked, not values)
		}
		out.Requests = append(out.Requests, recvJSON{r.RequestID, r.LocalBlockIDs, r.RemoteBlockIDs, r.RemoteEngineID,
			host, r.RemotePort, r.RemotePCPSize, r.RemoteDCPSize, r.BootEpochs})
	}
	for _, s := range m.Sends {
		out.ToSend = append(out.ToSend, [2]any{s.RequestID, s.DelayStartTime})
	}
	out.ToAbort = append(out.ToAbort, m.ToAbort...)
	return out
}

// sameJSON compares got's JSON encoding with want byte for byte after
// compacting (so key order counts: the seed's params are an ordered map).
func sameJSON(t *testing.T, got any, want json.RawMessage) bool {
	t.Helper()
	g, err := json.Marshal(got)
	if err != nil {
		t.Fatal(err)
	}
	var w bytes.Buffer
	if err := json.Compact(&w, want); err != nil {
		t.Fatal(err)
	}
	return bytes.Equal(g, w.Bytes())
}

func TestHandoverRoundTrip(t *testing.T) {
	p := &Rules{EngineID: "p", Host: "10.0.0.1", Port: SideChannelPort(30000, 1, 4, 1, 1), BlockSize: 4, Clock: func() float64 { return 1 }}
	d := &Rules{EngineID: "d", Host: "10.0.0.2", Port: 40000, BlockSize: 4}
	pr := &Request{ID: "r", Params: map[string]any{"do_remote_decode": true}, PromptLen: 9, OutputTokenIDs: []int{7}, Status: StatusLengthCapped}
	delay, h := p.RequestFinished(pr, []int{3, 4, 5})
	if !delay || h.RemotePort != 30004 {
		t.Fatalf("delay %v params %+v", delay, h)
	}
	if m := p.BuildMeta(); len(m.Sends) != 1 || !reflect.DeepEqual(m.Sends[0], Send{"r", 1, []int{3, 4, 5}}) {
		t.Fatalf("sends %+v", m.Sends)
	}
	dr := &Request{ID: "r", Params: h.Params(), PromptLen: 9}
	n, async, err := d.MatchedTokens(dr, 4)
	if err != nil || n != 5 || !async {
		t.Fatalf("matched %d %v %v", n, async, err)
	}
	if err := d.AfterAlloc(dr, []int{10, 11}, n); err != nil {
		t.Fatal(err)
	}
	m := d.BuildMeta()
	want := Recv{RequestID: "r", LocalBlockIDs: []int{10, 11}, RemoteBlockIDs: []int{3, 4, 5}, RemoteEngineID: "p",
		RemoteHost: "10.0.0.1", RemotePort: 30004, RemotePCPSize: 1, RemoteDCPSize: 1}
	if len(m.Recvs) != 1 || !reflect.DeepEqual(m.Recvs[0], want) {
		t.Fatalf("recvs %+v", m.Recvs)
	}
}

// TestBootEpochsRoundTrip: the prefill's kvflow_boot_epochs reach the
// decode's Recv as they were handed over (msgpack/JSON decoded forms
// alike); anything that is not a list of whole numbers >= 0 becomes -1
// entries, which the decode worker refuses naming the field.
func TestBootEpochsRoundTrip(t *testing.T) {
	p := &Rules{EngineID: "p", Host: "h", Port: 30000, BlockSize: 4, BootEpochs: []uint64{1764870000123456789, 0}}
	_, h := p.RequestFinished(&Request{ID: "r", Params: map[string]any{"do_remote_decode": true}, PromptLen: 4,
		OutputTokenIDs: []int{1}, Status: StatusLengthCapped}, []int{3})
	params := h.Params()
	p.BootEpochs[0] = 1 // the hand-over holds its own copy
	for _, tc := range []struct {
		name string
		v    any
		want []int64
	}{
		{"handed over", params["kvflow_boot_epochs"], []int64{1764870000123456789, 0}},
		{"absent", nil, nil},
		{"msgpack ints", []any{int64(5), uint64(6), 7}, []int64{5, 6, 7}},
		{"JSON numbers", []any{5.0, 0.0}, []int64{5, 0}},
		{"negative", []any{int64(-3)}, []int64{-1}},
		{"fraction", []any{1.5}, []int64{-1}},
		{"string entry", []any{"5"}, []int64{-1}},
		{"not a list", "5", []int64{-1}},
		{"too big", []uint64{1 << 63}, []int64{-1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := &Rules{BlockSize: 4}
			r := &Request{ID: "r", PromptLen: 4, Params: map[string]any{"do_remote_prefill": true, "remote_block_ids": []any{3},
				"remote_engine_id": "p", "remote_host": "h", "remote_port": 30000}}
			if tc.v != nil {
				r.Params["kvflow_boot_epochs"] = tc.v
			}
			if err := d.AfterAlloc(r, []int{9}, 4); err != nil {
				t.Fatal(err)
			}
			got := d.BuildMeta().Recvs[0].BootEpochs
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("Recv.BootEpochs %v, want %v", got, tc.want)
			}
		})
	}
}
