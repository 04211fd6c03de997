package control

import (
	"context"
	"errors"
	"reflect"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
)

// FuzzDecode: Decode never panics; it accepts or wraps ErrBadRequest; an
// accepted message re-encoded the way a client would decodes to the same
// Request, whose op peekOp reads alike; Dispatch of any input yields a
// reply that decodes.
func FuzzDecode(f *testing.F) {
	seeds := []any{
		loadMsg(),
		m{"op": "send", "requests": []any{m{"request_id": "s", "delay_start_time": 1.25, "block_ids": []any{1, 2}}}},
		m{"op": "abort", "request_ids": []any{"a"}},
		m{"op": "finished"},
		m{"op": "status", "x": []any{m{"y": nil}}},
		m{"op": "load", "requests": []any{m{"request_id": "a"}}},
		m{"op": "load", "requests": []any{m{"request_id": "a", "local_block_ids": []any{1}, "kv_transfer_params": m{
			"remote_block_ids": []any{2}, "remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "kvflow_boot_epochs": []any{-1, 0, 5}}}}},
		[]any{"status"},
	}
	for _, s := range seeds {
		b, _ := msgpack.Marshal(s)
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{0x81, 0xa1, 'x', 0x91, 0x91, 0x91, 0xc0})
	f.Add([]byte{0xdf, 0xff, 0xff, 0xff, 0xff})
	fb := &fakeBackend{}
	backends := []Backend{fb.backend("decode"), fb.backend("prefill"), {}}
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := Decode(b)
		if err != nil {
			if !errors.Is(err, ErrBadRequest) {
				t.Fatalf("error %v does not wrap ErrBadRequest", err)
			}
		} else {
			if op := peekOp(b); op != r.Op {
				t.Fatalf("peekOp %q, Decode's op %q", op, r.Op)
			}
			again, err := Decode(reencode(t, r))
			if err != nil {
				t.Fatalf("re-encoded %+v rejected: %v", r, err)
			}
			if !reflect.DeepEqual(again, r) {
				t.Fatalf("re-encoded\n got %+v\nwant %+v", again, r)
			}
		}
		for _, be := range backends {
			var rep Reply
			if err := msgpack.Unmarshal(Encode(Dispatch(context.Background(), be, b)), &rep); err != nil {
				t.Fatalf("reply does not decode: %v", err)
			}
			if !rep.OK && rep.Error == "" {
				t.Fatal("error reply without an error")
			}
		}
		fb.mu.Lock()
		fb.loads, fb.sends, fb.aborts = nil, nil, nil
		fb.mu.Unlock()
	})
}

// reencode writes r as a client would (the struct tags are the wire keys).
func reencode(t *testing.T, r Request) []byte {
	msg := map[string]any{"op": r.Op}
	if r.RequestIDs != nil {
		msg["request_ids"] = r.RequestIDs
	}
	switch r.Op {
	case "load":
		msg["requests"] = nonNilSlice(r.Load)
	case "send":
		msg["requests"] = nonNilSlice(r.Send)
	}
	return pack(t, msg)
}

func nonNilSlice[T decode.LoadRequest | prefill.SendRequest](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}
