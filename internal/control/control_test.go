package control

import (
	"bytes"
	"context"
	"errors"
	"math"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
)

// pack encodes v as a Python client would: maps with string keys, ints.
func pack(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

type m = map[string]any

func params() m {
	return m{"remote_block_ids": []any{7, 8, 9}, "remote_engine_id": "p-engine", "remote_host": "10.0.0.2",
		"remote_port": 30001, "remote_pcp_size": 1, "remote_dcp_size": 2, "do_remote_prefill": true}
}

func loadMsg() m {
	return m{"op": "load", "requests": []any{
		m{"request_id": "r1", "local_block_ids": []any{1, 2, 3}, "kv_transfer_params": params()},
		m{"request_id": "r2", "local_block_ids": []any{}, "kv_transfer_params": params(), "extra": "ignored"},
	}}
}

func TestDecodeOps(t *testing.T) {
	wantParams := decode.KVTransferParams{RemoteBlockIDs: []int{7, 8, 9}, RemoteEngineID: "p-engine",
		RemoteHost: "10.0.0.2", RemotePort: 30001, RemotePCPSize: 1, RemoteDCPSize: 2}
	cases := []struct {
		name string
		msg  any
		want Request
	}{
		{"load", loadMsg(), Request{Op: "load", Load: []decode.LoadRequest{
			{RequestID: "r1", LocalBlockIDs: []int{1, 2, 3}, Params: wantParams},
			{RequestID: "r2", LocalBlockIDs: []int{}, Params: wantParams},
		}}},
		{"load empty", m{"op": "load", "requests": []any{}}, Request{Op: "load", Load: []decode.LoadRequest{}}},
		{"load pcp/dcp omitted", m{"op": "load", "requests": []any{m{"request_id": "a", "local_block_ids": []any{0},
			"kv_transfer_params": m{"remote_block_ids": []any{4}, "remote_engine_id": "e", "remote_host": "h", "remote_port": 1}}}},
			Request{Op: "load", Load: []decode.LoadRequest{{RequestID: "a", LocalBlockIDs: []int{0},
				Params: decode.KVTransferParams{RemoteBlockIDs: []int{4}, RemoteEngineID: "e", RemoteHost: "h", RemotePort: 1}}}}},
		{"load nil lists", m{"op": "load", "requests": []any{m{"request_id": "a", "local_block_ids": nil,
			"kv_transfer_params": m{"remote_block_ids": nil, "remote_engine_id": "e", "remote_host": "h", "remote_port": 1}}}},
			Request{Op: "load", Load: []decode.LoadRequest{{RequestID: "a",
				Params: decode.KVTransferParams{RemoteEngineID: "e", RemoteHost: "h", RemotePort: 1}}}}},
		{"load from Go structs", m{"op": "load", "requests": []decode.LoadRequest{{RequestID: "g", Params: decode.KVTransferParams{RemoteHost: "h"}}}},
			Request{Op: "load", Load: []decode.LoadRequest{{RequestID: "g", Params: decode.KVTransferParams{RemoteHost: "h"}}}}},
		{"send from Go structs", m{"op": "send", "requests": []prefill.SendRequest{{RequestID: "g", DelayStartTime: 2}}},
			Request{Op: "send", Send: []prefill.SendRequest{{RequestID: "g", DelayStartTime: 2}}}},
		{"send", m{"op": "send", "requests": []any{
			m{"request_id": "s1", "delay_start_time": 1712345678.25},
			m{"request_id": "s2", "delay_start_time": 0, "block_ids": []any{4, 5}},
			m{"request_id": "s3"},
		}}, Request{Op: "send", Send: []prefill.SendRequest{
			{RequestID: "s1", DelayStartTime: 1712345678.25},
			{RequestID: "s2", BlockIDs: []int{4, 5}},
			{RequestID: "s3"},
		}}},
		{"abort", m{"op": "abort", "request_ids": []any{"a", "b"}}, Request{Op: "abort", RequestIDs: []string{"a", "b"}}},
		{"abort none", m{"op": "abort", "request_ids": []any{}}, Request{Op: "abort", RequestIDs: []string{}}},
		{"abort bin ids", m{"op": "abort", "request_ids": []any{[]byte("x")}}, Request{Op: "abort", RequestIDs: []string{"x"}}},
		{"load with kvflow_boot_epochs", m{"op": "load", "requests": []any{m{"request_id": "a", "local_block_ids": []any{0},
			"kv_transfer_params": m{"remote_block_ids": []any{4}, "remote_engine_id": "e", "remote_host": "h", "remote_port": 1,
				"kvflow_boot_epochs": []any{uint64(1764870000123456789), 0}}}}},
			Request{Op: "load", Load: []decode.LoadRequest{{RequestID: "a", LocalBlockIDs: []int{0},
				Params: decode.KVTransferParams{RemoteBlockIDs: []int{4}, RemoteEngineID: "e", RemoteHost: "h", RemotePort: 1,
					BootEpochs: []int64{1764870000123456789, 0}}}}}},
		{"load kvflow_boot_epochs nil", m{"op": "load", "requests": []any{m{"request_id": "a", "local_block_ids": []any{0},
			"kv_transfer_params": m{"remote_block_ids": []any{4}, "remote_engine_id": "e", "remote_host": "h", "remote_port": 1,
				"kvflow_boot_epochs": nil}}}},
			Request{Op: "load", Load: []decode.LoadRequest{{RequestID: "a", LocalBlockIDs: []int{0},
				Params: decode.KVTransferParams{RemoteBlockIDs: []int{4}, RemoteEngineID: "e", RemoteHost: "h", RemotePort: 1}}}}},
		{"finished", m{"op": "finished"}, Request{Op: "finished"}},
		{"status", m{"op": "status", "client": "vllm", "nested": m{"a": []any{1, m{"b": nil}}}}, Request{Op: "status"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := Decode(pack(t, c.msg))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, c.want) {
				t.Fatalf("got  %+v\nwant %+v", got, c.want)
			}
		})
	}
}

// TestDecodeBad: every malformed message is an ErrBadRequest naming what
// is wrong.
func TestDecodeBad(t *testing.T) {
	withReq := func(op string, r any) m { return m{"op": op, "requests": []any{r}} }
	okLoad := func(mut func(m)) m {
		r := m{"request_id": "a", "local_block_ids": []any{1}, "kv_transfer_params": params()}
		mut(r)
		return withReq("load", r)
	}
	okParams := func(mut func(m)) m {
		return okLoad(func(r m) { p := params(); mut(p); r["kv_transfer_params"] = p })
	}
	deep := func(n int) []byte {
		var b bytes.Buffer // {"op": "status", "x": [[[...[nil]...]]]}
		b.WriteByte(0x82)
		b.Write(pack(t, "op"))
		b.Write(pack(t, "status"))
		b.Write(pack(t, "x"))
		b.Write(bytes.Repeat([]byte{0x91}, n))
		b.WriteByte(0xc0)
		return b.Bytes()
	}
	cases := []struct {
		name string
		raw  []byte
		msg  any
		want string
	}{
		{name: "empty", raw: []byte{}, want: "empty message"},
		{name: "garbage", raw: []byte("hello"), want: "not a msgpack map"},
		{name: "truncated", raw: pack(t, loadMsg())[:20], want: "EOF"},
		{name: "reserved code", raw: []byte{0x81, 0xa2, 'o', 'p', 0xc1}, want: "bad request"},
		{name: "trailing bytes", raw: append(pack(t, m{"op": "status"}), 0xc0), want: "1 trailing bytes"},
		{name: "two messages", raw: append(pack(t, m{"op": "status"}), pack(t, m{"op": "status"})...), want: "trailing bytes"},
		{name: "array message", msg: []any{"abort", nil, []any{"x"}}, want: "not a msgpack map"},
		{name: "nil message", msg: nil, want: "not a msgpack map"},
		{name: "string message", msg: "status", want: "not a msgpack map"},
		{name: "op missing", msg: m{"requests": []any{}}, want: "op missing"},
		{name: "op empty", msg: m{"op": ""}, want: "op missing"},
		{name: "op int", msg: m{"op": 5}, want: "bad request: op: want a string, got an integer"},
		{name: "op nil", msg: m{"op": nil}, want: "op missing"},
		{name: "unknown op", msg: m{"op": "get_finished"}, want: `unknown op "get_finished"`},
		{name: "op case", msg: m{"op": "LOAD"}, want: "unknown op"},
		{name: "int key", msg: map[any]any{1: "x", "op": "status"}, want: "bad request"},
		{name: "load requests missing", msg: m{"op": "load"}, want: "requests missing"},
		{name: "load requests nil", msg: m{"op": "load", "requests": nil}, want: "requests missing"},
		{name: "send requests missing", msg: m{"op": "send"}, want: "requests missing"},
		{name: "requests map", msg: m{"op": "load", "requests": m{"request_id": "a"}}, want: "requests:"},
		{name: "requests string", msg: m{"op": "send", "requests": "a"}, want: "requests:"},
		{name: "request array", msg: withReq("load", []any{"a", []any{1}, params()}), want: "requests[0]: not a map"},
		{name: "request string", msg: withReq("send", "a"), want: "requests[0]: not a map"},
		{name: "request nil", msg: withReq("send", nil), want: "requests[0]: not a map"},
		{name: "request_id missing", msg: okLoad(func(r m) { delete(r, "request_id") }), want: "requests[0]: request_id missing"},
		{name: "request_id nil", msg: okLoad(func(r m) { r["request_id"] = nil }), want: "request_id missing"},
		{name: "request_id int", msg: okLoad(func(r m) { r["request_id"] = 5 }), want: "requests[0].request_id: want a string, got an integer"},
		{name: "send request_id missing", msg: withReq("send", m{"delay_start_time": 1.5}), want: "request_id missing"},
		{name: "local_block_ids missing", msg: okLoad(func(r m) { delete(r, "local_block_ids") }), want: "local_block_ids missing"},
		{name: "local_block_ids float", msg: okLoad(func(r m) { r["local_block_ids"] = []any{1.5} }), want: "requests[0].local_block_ids: want an array of integers, got an array"},
		{name: "local_block_ids bool", msg: okLoad(func(r m) { r["local_block_ids"] = []any{true} }), want: "requests[0]"},
		{name: "local_block_ids string", msg: okLoad(func(r m) { r["local_block_ids"] = "1,2" }), want: "requests[0].local_block_ids: want an array of integers, got a string (msgpack: invalid code=a3"},
		{name: "local_block_ids huge", msg: okLoad(func(r m) { r["local_block_ids"] = []any{uint64(1) << 63} }), want: "out of range"},
		{name: "params missing", msg: okLoad(func(r m) { delete(r, "kv_transfer_params") }), want: "kv_transfer_params missing"},
		{name: "params nil", msg: okLoad(func(r m) { r["kv_transfer_params"] = nil }), want: "kv_transfer_params missing"},
		{name: "remote_host nil", msg: okParams(func(p m) { p["remote_host"] = nil }), want: "kv_transfer_params.remote_host missing"},
		{name: "params list", msg: okLoad(func(r m) { r["kv_transfer_params"] = []any{1} }), want: "kv_transfer_params.not a map"},
		{name: "remote_host missing", msg: okParams(func(p m) { delete(p, "remote_host") }), want: "kv_transfer_params.remote_host missing"},
		{name: "remote_port missing", msg: okParams(func(p m) { delete(p, "remote_port") }), want: "remote_port missing"},
		{name: "remote_engine_id missing", msg: okParams(func(p m) { delete(p, "remote_engine_id") }), want: "remote_engine_id missing"},
		{name: "remote_block_ids missing", msg: okParams(func(p m) { delete(p, "remote_block_ids") }), want: "remote_block_ids missing"},
		{name: "remote_port string", msg: okParams(func(p m) { p["remote_port"] = "80" }), want: "requests[0].kv_transfer_params.remote_port: want an integer, got a string"},
		{name: "remote_block_ids float", msg: okParams(func(p m) { p["remote_block_ids"] = []any{2.0} }), want: "requests[0].kv_transfer_params.remote_block_ids: want an array of integers"},
		{name: "kvflow_boot_epochs string", msg: okParams(func(p m) { p["kvflow_boot_epochs"] = "1764870000123456789" }),
			want: "requests[0].kv_transfer_params.kvflow_boot_epochs: want an array of integers, got a string"},
		{name: "kvflow_boot_epochs int", msg: okParams(func(p m) { p["kvflow_boot_epochs"] = 5 }),
			want: "requests[0].kv_transfer_params.kvflow_boot_epochs: want an array of integers, got an integer"},
		{name: "kvflow_boot_epochs strings", msg: okParams(func(p m) { p["kvflow_boot_epochs"] = []any{"5"} }),
			want: "requests[0].kv_transfer_params.kvflow_boot_epochs: want an array of integers, got an array"},
		{name: "kvflow_boot_epochs float", msg: okParams(func(p m) { p["kvflow_boot_epochs"] = []any{1.5} }),
			want: "requests[0].kv_transfer_params.kvflow_boot_epochs: want an array of integers"},
		{name: "kvflow_boot_epochs map", msg: okParams(func(p m) { p["kvflow_boot_epochs"] = m{"0": 5} }),
			want: "requests[0].kv_transfer_params.kvflow_boot_epochs: want an array of integers, got a map"},
		{name: "kvflow_boot_epochs huge", msg: okParams(func(p m) { p["kvflow_boot_epochs"] = []any{uint64(1) << 63} }), want: "out of range"},
		{name: "delay_start_time string", msg: withReq("send", m{"request_id": "a", "delay_start_time": "now"}), want: "requests[0].delay_start_time: want a number, got a string"},
		{name: "block_ids map", msg: withReq("send", m{"request_id": "a", "block_ids": m{}}), want: "requests[0].block_ids: want an array of integers, got a map"},
		{name: "second request bad", msg: m{"op": "send", "requests": []any{m{"request_id": "a"}, m{}}}, want: "requests[1]: request_id missing"},
		{name: "abort request_ids missing", msg: m{"op": "abort"}, want: "request_ids missing"},
		{name: "abort request_ids nil", msg: m{"op": "abort", "request_ids": nil}, want: "request_ids missing"},
		{name: "abort request_ids map", msg: m{"op": "abort", "request_ids": m{"a": 1}}, want: "bad request"},
		{name: "abort request_ids ints", msg: m{"op": "abort", "request_ids": []any{1}}, want: "request_ids: want an array of strings, got an array"},
		{name: "request_ids on status ill-typed", msg: m{"op": "status", "request_ids": 3}, want: "bad request"},
		{name: "deep nesting", raw: deep(maxDepth + 1), want: "nested deeper than"},
		{name: "very deep nesting", raw: deep(20 << 20), want: "nested deeper than"},
		{name: "huge uint anywhere", msg: m{"op": "status", "x": uint64(math.MaxUint64)}, want: "out of range"},
		{name: "map length lies", raw: []byte{0xdf, 0xff, 0xff, 0xff, 0xff, 0xa2, 'o', 'p'}, want: "EOF"},
		{name: "array length lies", raw: []byte{0x81, 0xa1, 'x', 0xdd, 0xff, 0xff, 0xff, 0xff}, want: "EOF"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b := c.raw
			if b == nil {
				b = pack(t, c.msg)
			}
			r, err := Decode(b)
			if err == nil {
				t.Fatalf("accepted: %+v", r)
			}
			if !errors.Is(err, ErrBadRequest) {
				t.Fatalf("error %v does not wrap ErrBadRequest", err)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %q, want it to contain %q", err, c.want)
			}
		})
	}
}

func TestDecodeLimits(t *testing.T) {
	ids := make([]string, MaxRequests+1)
	for i := range ids {
		ids[i] = "r"
	}
	if _, err := Decode(pack(t, m{"op": "abort", "request_ids": ids})); err == nil || !strings.Contains(err.Error(), "max") {
		t.Fatalf("too many request_ids: %v", err)
	}
	reqs := make([]any, MaxRequests+1)
	for i := range reqs {
		reqs[i] = m{"request_id": "r"}
	}
	if _, err := Decode(pack(t, m{"op": "send", "requests": reqs})); err == nil || !strings.Contains(err.Error(), "max") {
		t.Fatalf("too many requests: %v", err)
	}
	if _, err := Decode(pack(t, m{"op": "send", "requests": reqs[:MaxRequests]})); err != nil {
		t.Fatalf("MaxRequests requests: %v", err)
	}
	// maxDepth nested maps and arrays, the message included, are fine.
	v := any(1)
	for range maxDepth - 1 {
		v = []any{v}
	}
	if _, err := Decode(pack(t, m{"op": "status", "x": v})); err != nil {
		t.Fatalf("depth %d: %v", maxDepth, err)
	}
	if _, err := Decode(pack(t, m{"op": "status", "x": []any{v}})); err == nil {
		t.Fatalf("depth %d accepted", maxDepth+1)
	}
	if _, err := Decode(pack(t, m{"op": "status", "x": uint64(math.MaxInt64), "y": int64(math.MinInt64)})); err != nil {
		t.Fatalf("int64 extremes: %v", err)
	}
}

// fakeBackend records every call.
type fakeBackend struct {
	mu       sync.Mutex
	loads    [][]decode.LoadRequest
	sends    [][]prefill.SendRequest
	aborts   [][]string
	deadline time.Duration // of the last load's ctx
}

func (f *fakeBackend) backend(role string) Backend {
	b := Backend{
		Role: role,
		Abort: func(ids []string) int {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.aborts = append(f.aborts, ids)
			n := 0
			for _, id := range ids {
				if strings.HasPrefix(id, "known") {
					n++
				}
			}
			return n
		},
		Finished: func() ([]string, []string, []decode.Failure) {
			if role == "prefill" {
				return []string{"s1", "s2"}, nil, nil
			}
			return nil, []string{"r1"}, []decode.Failure{{RequestID: "r2", BlockIDs: []int{3, 4}, Reason: "peer gone"}}
		},
		Status: func() map[string]any { return map[string]any{"in_flight": 2, "peers": []string{"a"}} },
	}
	reject := func(id string) error {
		if strings.HasPrefix(id, "bad") {
			return errors.New("rejected " + id)
		}
		return nil
	}
	switch role {
	case "decode":
		b.Load = func(ctx context.Context, reqs []decode.LoadRequest) []error {
			dl, _ := ctx.Deadline()
			f.mu.Lock()
			f.loads = append(f.loads, reqs)
			f.deadline = time.Until(dl)
			f.mu.Unlock()
			errs := make([]error, len(reqs))
			for i, r := range reqs {
				errs[i] = reject(r.RequestID)
			}
			return errs
		}
	case "prefill":
		b.Send = func(reqs []prefill.SendRequest) []error {
			f.mu.Lock()
			f.sends = append(f.sends, reqs)
			f.mu.Unlock()
			errs := make([]error, len(reqs))
			for i, r := range reqs {
				errs[i] = reject(r.RequestID)
			}
			return errs
		}
	}
	return b
}

// roundTrip dispatches msg and decodes the encoded reply as a client would.
func roundTrip(t *testing.T, b Backend, msg any) map[string]any {
	t.Helper()
	var raw []byte
	if r, ok := msg.([]byte); ok {
		raw = r
	} else {
		raw = pack(t, msg)
	}
	var out map[string]any
	if err := msgpack.Unmarshal(Encode(Dispatch(context.Background(), b, raw)), &out); err != nil {
		t.Fatal(err)
	}
	return out
}

func strp(s string) *string { return &s }

func TestDispatch(t *testing.T) {
	f := &fakeBackend{}
	dec, pre := f.backend("decode"), f.backend("prefill")

	msg := loadMsg()
	msg["requests"] = append(msg["requests"].([]any), m{"request_id": "bad1", "local_block_ids": []any{}, "kv_transfer_params": params()})
	rep := roundTrip(t, dec, msg)
	if rep["ok"] != true || !reflect.DeepEqual(rep["errors"], []any{nil, nil, "rejected bad1"}) {
		t.Fatalf("load reply %v", rep)
	}
	if len(f.loads) != 1 || len(f.loads[0]) != 3 || f.loads[0][0].Params.RemotePort != 30001 {
		t.Fatalf("backend got %+v", f.loads)
	}
	if f.deadline <= 0 || f.deadline > LoadTimeout {
		t.Fatalf("load ctx deadline in %v, want within LoadTimeout %v", f.deadline, LoadTimeout)
	}

	rep = roundTrip(t, pre, m{"op": "send", "requests": []any{m{"request_id": "s1", "delay_start_time": 5}, m{"request_id": "bad2"}}})
	if rep["ok"] != true || !reflect.DeepEqual(rep["errors"], []any{nil, "rejected bad2"}) {
		t.Fatalf("send reply %v", rep)
	}
	if f.sends[0][0].DelayStartTime != 5 {
		t.Fatalf("int delay_start_time decoded as %v", f.sends[0][0].DelayStartTime)
	}

	for _, c := range []struct {
		b  Backend
		op string
	}{{pre, "load"}, {dec, "send"}} {
		msg := m{"op": c.op, "requests": []any{}}
		rep := roundTrip(t, c.b, msg)
		if rep["ok"] != false || !strings.Contains(rep["error"].(string), "not supported by a "+c.b.Role+" worker") {
			t.Fatalf("%s on %s: %v", c.op, c.b.Role, rep)
		}
	}

	rep = roundTrip(t, dec, m{"op": "abort", "request_ids": []any{"known1", "x", "known2"}})
	if rep["ok"] != true || rep["aborted"] != int8(2) {
		t.Fatalf("abort reply %v (%T)", rep, rep["aborted"])
	}
	rep = roundTrip(t, dec, m{"op": "abort", "request_ids": []any{}})
	if rep["ok"] != true || rep["aborted"] != int8(0) {
		t.Fatalf("abort none reply %v", rep)
	}

	rep = roundTrip(t, dec, m{"op": "finished"})
	want := map[string]any{"ok": true, "done_sending": []any{}, "done_recving": []any{"r1"},
		"failed_recving": []any{map[string]any{"request_id": "r2", "block_ids": []any{int8(3), int8(4)}, "reason": "peer gone"}}}
	if !reflect.DeepEqual(rep, want) {
		t.Fatalf("finished reply\n got %#v\nwant %#v", rep, want)
	}
	rep = roundTrip(t, pre, m{"op": "finished"})
	if !reflect.DeepEqual(rep["done_sending"], []any{"s1", "s2"}) || !reflect.DeepEqual(rep["failed_recving"], []any{}) ||
		!reflect.DeepEqual(rep["done_recving"], []any{}) {
		t.Fatalf("prefill finished reply %v", rep)
	}

	rep = roundTrip(t, dec, m{"op": "status"})
	if rep["ok"] != true || rep["role"] != "decode" || !reflect.DeepEqual(rep["status"], map[string]any{"in_flight": int8(2), "peers": []any{"a"}}) {
		t.Fatalf("status reply %v", rep)
	}

	for _, bad := range []any{[]byte("junk"), m{"op": "nope"}, m{"op": "abort"}} {
		rep := roundTrip(t, dec, bad)
		if rep["ok"] != false || !strings.HasPrefix(rep["error"].(string), "control: bad request") {
			t.Fatalf("%v: reply %v", bad, rep)
		}
	}
}

func TestDispatchEmptyAndBrokenBackends(t *testing.T) {
	// A zero Backend: every op is an error reply except status.
	var zero Backend
	for _, msg := range []m{{"op": "load", "requests": []any{}}, {"op": "send", "requests": []any{}},
		{"op": "abort", "request_ids": []any{}}, {"op": "finished"}} {
		rep := roundTrip(t, zero, msg)
		if rep["ok"] != false || !strings.Contains(rep["error"].(string), "not supported") {
			t.Fatalf("%v on a zero Backend: %v", msg, rep)
		}
	}
	if rep := roundTrip(t, zero, m{"op": "status"}); rep["ok"] != true {
		t.Fatalf("status on a zero Backend: %v", rep)
	}
	// A backend that panics or miscounts gets an error reply, not a crash.
	broken := Backend{
		Role:     "decode",
		Load:     func(context.Context, []decode.LoadRequest) []error { return nil },
		Send:     func([]prefill.SendRequest) []error { panic("boom") },
		Abort:    func([]string) int { panic(errors.New("abort broke")) },
		Finished: func() ([]string, []string, []decode.Failure) { return nil, nil, nil },
		Status:   func() map[string]any { return map[string]any{"bad": make(chan int)} },
	}
	cases := []struct {
		msg  m
		want string
	}{
		{loadMsg(), "internal error: 0 results for 2 requests"},
		{m{"op": "send", "requests": []any{m{"request_id": "a"}}}, "op send: internal error: boom"},
		{m{"op": "abort", "request_ids": []any{"a"}}, "op abort: internal error: abort broke"},
		{m{"op": "status"}, "encode reply"},
	}
	for _, c := range cases {
		rep := roundTrip(t, broken, c.msg)
		if rep["ok"] != false || !strings.Contains(rep["error"].(string), c.want) {
			t.Fatalf("%v: reply %v, want error containing %q", c.msg["op"], rep, c.want)
		}
	}
	// Empty lists, not nils, on the wire.
	rep := roundTrip(t, broken, m{"op": "finished"})
	for _, k := range []string{"done_sending", "done_recving", "failed_recving"} {
		if !reflect.DeepEqual(rep[k], []any{}) {
			t.Fatalf("%s = %#v, want []", k, rep[k])
		}
	}
}

// TestReplyRoundTrip: Encode's output decodes into Reply again.
func TestReplyRoundTrip(t *testing.T) {
	n := 3
	for _, r := range []Reply{
		{OK: true, Errors: []*string{nil, strp("x")}},
		{OK: true, Aborted: &n},
		{OK: true, DoneSending: []string{"a"}, DoneRecving: []string{}, FailedRecving: []decode.Failure{{RequestID: "b", BlockIDs: []int{1}, Reason: "r"}}},
		{OK: true, Role: "prefill", Status: map[string]any{"k": "v"}},
		{Error: "control: bad request: op missing"},
	} {
		var got Reply
		if err := msgpack.Unmarshal(Encode(r), &got); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, r) {
			t.Fatalf("got %+v, want %+v", got, r)
		}
	}
}

// TestPeekOp: the router's background choice reads only the top-level op.
func TestPeekOp(t *testing.T) {
	raw := func(b ...byte) []byte { return b }
	deep := append(raw(0x82, 0xa1, 'x'), bytes.Repeat([]byte{0x91}, 1<<20)...) // nested past maxDepth
	deep = append(deep, 0xc0, 0xa2, 'o', 'p', 0xa4, 'l', 'o', 'a', 'd')
	cases := []struct {
		name string
		msg  []byte
		want string
	}{
		{"load", pack(t, loadMsg()), "load"},
		{"finished", pack(t, m{"op": "finished"}), "finished"},
		{"op after the requests", pack(t, []any{}), ""},
		{"nested op is not the op", pack(t, m{"x": m{"op": "load"}}), ""},
		{"op not a string", pack(t, m{"op": 3}), ""},
		{"not a map", pack(t, []any{"op", "load"}), ""},
		{"empty", nil, ""},
		{"truncated after the key", raw(0x81, 0xa2, 'o', 'p'), ""},
		{"non-string key skipped", raw(0x82, 0x01, 0x02, 0xa2, 'o', 'p', 0xa4, 's', 'e', 'n', 'd'), "send"},
		{"repeated op: the last, as Decode", raw(0x82, 0xa2, 'o', 'p', 0xa4, 's', 'e', 'n', 'd', 0xa2, 'o', 'p', 0xa5, 'a', 'b', 'o', 'r', 't'), "abort"},
		{"huge map length", raw(0xdf, 0xff, 0xff, 0xff, 0xff), ""},
		{"deep value before the op: not read", deep, ""},
		{"bin key and value, as Decode reads them", raw(0x81, 0xc4, 2, 'o', 'p', 0xc4, 4, 'l', 'o', 'a', 'd'), "load"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := peekOp(c.msg); got != c.want {
				t.Errorf("peekOp = %q, want %q", got, c.want)
			}
		})
	}
}
