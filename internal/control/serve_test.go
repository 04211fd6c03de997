package control

import (
	"bytes"
	"context"
	"log/slog"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvflow/kvflow/internal/sidechannel"
)

// serve starts Serve for b on an ipc socket in a temp dir.
func serve(t *testing.T, b Backend) (endpoint string) {
	t.Helper()
	zctx, err := sidechannel.NewContext(sidechannel.ContextOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	endpoint = "ipc://" + filepath.Join(t.TempDir(), "ctl.sock")
	srv, err := Serve(ctx, zctx, endpoint, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		srv.Close()
		if err := zctx.Close(); err != nil {
			t.Errorf("close context: %v", err)
		}
	})
	return endpoint
}

// reqClient is a REQ socket, as the Python client uses.
type reqClient struct {
	t    *testing.T
	ctx  *zmq.Context
	sock *zmq.Socket
}

func newReqClient(t *testing.T, endpoint string) *reqClient {
	t.Helper()
	zc, err := zmq.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	s, err := zc.NewSocket(zmq.REQ)
	if err != nil {
		t.Fatal(err)
	}
	s.SetLinger(0)
	s.SetRcvtimeo(5 * time.Second)
	s.SetSndtimeo(5 * time.Second)
	if err := s.Connect(endpoint); err != nil {
		t.Fatal(err)
	}
	c := &reqClient{t: t, ctx: zc, sock: s}
	t.Cleanup(func() { s.Close(); zc.Term() })
	return c
}

// call sends frames (one payload, or several for envelope tests) and
// returns the raw reply.
func (c *reqClient) call(frames ...[]byte) []byte {
	c.t.Helper()
	parts := make([]any, len(frames))
	for i, f := range frames {
		parts[i] = f
	}
	if _, err := c.sock.SendMessage(parts...); err != nil {
		c.t.Fatal(err)
	}
	rep, err := c.sock.RecvBytes(0)
	if err != nil {
		c.t.Fatalf("no reply: %v", err)
	}
	return rep
}

func (c *reqClient) callMap(msg any) map[string]any {
	c.t.Helper()
	var out map[string]any
	if err := msgpack.Unmarshal(c.call(pack(c.t, msg)), &out); err != nil {
		c.t.Fatal(err)
	}
	return out
}

func TestServeEveryOp(t *testing.T) {
	f := &fakeBackend{}
	for _, role := range []string{"decode", "prefill"} {
		t.Run(role, func(t *testing.T) {
			c := newReqClient(t, serve(t, f.backend(role)))
			load := c.callMap(loadMsg())
			send := c.callMap(m{"op": "send", "requests": []any{m{"request_id": "s1", "delay_start_time": 1.5, "block_ids": []any{1}}}})
			if role == "decode" {
				if load["ok"] != true || !reflect.DeepEqual(load["errors"], []any{nil, nil}) || send["ok"] != false {
					t.Fatalf("load %v, send %v", load, send)
				}
			} else if send["ok"] != true || !reflect.DeepEqual(send["errors"], []any{nil}) || load["ok"] != false {
				t.Fatalf("load %v, send %v", load, send)
			}
			if rep := c.callMap(m{"op": "abort", "request_ids": []any{"known", "other"}}); rep["ok"] != true || rep["aborted"] != int8(1) {
				t.Fatalf("abort %v", rep)
			}
			fin := c.callMap(m{"op": "finished"})
			if fin["ok"] != true {
				t.Fatalf("finished %v", fin)
			}
			if role == "decode" && !reflect.DeepEqual(fin["done_recving"], []any{"r1"}) ||
				role == "prefill" && !reflect.DeepEqual(fin["done_sending"], []any{"s1", "s2"}) {
				t.Fatalf("finished %v", fin)
			}
			if st := c.callMap(m{"op": "status"}); st["ok"] != true || st["role"] != role {
				t.Fatalf("status %v", st)
			}
		})
	}
	if len(f.loads) != 1 || f.loads[0][1].RequestID != "r2" || len(f.sends) != 1 || f.sends[0][0].DelayStartTime != 1.5 {
		t.Fatalf("backend saw loads %+v sends %+v", f.loads, f.sends)
	}
}

// TestServeBadMessages: garbage gets an error reply and the server, and the
// same REQ socket, keep working.
func TestServeBadMessages(t *testing.T) {
	f := &fakeBackend{}
	c := newReqClient(t, serve(t, f.backend("decode")))
	bad := [][]byte{
		[]byte("garbage"),
		{0xc1},
		{0x81, 0xa2, 'o', 'p'},
		pack(t, m{"op": "frobnicate"}),
		pack(t, []any{"status"}),
		append(pack(t, m{"op": "status"}), 0),
		pack(t, m{"op": "load", "requests": []any{m{"request_id": 1}}}),
		pack(t, m{"op": "abort"}),
	}
	for i, b := range bad {
		var rep map[string]any
		if err := msgpack.Unmarshal(c.call(b), &rep); err != nil {
			t.Fatalf("bad %d: reply is not msgpack: %v", i, err)
		}
		if rep["ok"] != false || !strings.HasPrefix(rep["error"].(string), "control: bad request") {
			t.Fatalf("bad %d: reply %v", i, rep)
		}
		if st := c.callMap(m{"op": "status"}); st["ok"] != true {
			t.Fatalf("after bad %d: status %v", i, st)
		}
	}
	// Framing errors are the side channel's: a raw "ERR <reason>" reply.
	for _, frames := range [][][]byte{{{}}, {[]byte("a"), []byte("b")}} {
		rep := c.call(frames...)
		if !strings.HasPrefix(string(rep), "ERR ") {
			t.Fatalf("%d frames: reply %q", len(frames), rep)
		}
		if st := c.callMap(m{"op": "status"}); st["ok"] != true {
			t.Fatalf("after framing error: status %v", st)
		}
	}
	// A message nested deep enough to overflow a recursive decoder.
	deep := append([]byte{0x82, 0xa2, 'o', 'p', 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa1, 'x'}, make([]byte, 8<<20)...)
	for i := 13; i < len(deep)-1; i++ {
		deep[i] = 0x91
	}
	deep[len(deep)-1] = 0xc0
	var rep map[string]any
	if err := msgpack.Unmarshal(c.call(deep), &rep); err != nil || rep["ok"] != false {
		t.Fatalf("deep message: %v %v", rep, err)
	}
	if len(f.loads) != 0 || len(f.aborts) != 0 {
		t.Fatalf("bad messages reached the backend: %+v %+v", f.loads, f.aborts)
	}
}

// TestServeManyClients: concurrent REQ peers each get their own replies.
func TestServeManyClients(t *testing.T) {
	f := &fakeBackend{}
	ep := serve(t, f.backend("decode"))
	done := make(chan error, 8)
	for i := range 8 {
		go func() {
			zc, _ := zmq.NewContext()
			defer zc.Term()
			s, _ := zc.NewSocket(zmq.REQ)
			defer s.Close()
			s.SetLinger(0)
			s.SetRcvtimeo(5 * time.Second)
			if err := s.Connect(ep); err != nil {
				done <- err
				return
			}
			for j := range 50 {
				id := "known"
				if (i+j)%2 == 1 {
					id = "x"
				}
				b, _ := msgpack.Marshal(m{"op": "abort", "request_ids": []any{id}})
				if _, err := s.SendBytes(b, 0); err != nil {
					done <- err
					return
				}
				r, err := s.RecvBytes(0)
				if err != nil {
					done <- err
					return
				}
				var rep map[string]any
				if err := msgpack.Unmarshal(r, &rep); err != nil {
					done <- err
					return
				}
				if want := int8(1 - (i+j)%2); rep["aborted"] != want {
					done <- &mismatch{rep}
					return
				}
			}
			done <- nil
		}()
	}
	for range 8 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}

type mismatch struct{ rep map[string]any }

func (e *mismatch) Error() string { return "wrong reply" }

func TestServeBadEndpoint(t *testing.T) {
	zctx, err := sidechannel.NewContext(sidechannel.ContextOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer zctx.Close()
	for _, ep := range []string{"", "ctl.sock", "ipc://", "udp://x"} {
		if srv, err := Serve(context.Background(), zctx, ep, Backend{}, nil); err == nil {
			srv.Close()
			t.Fatalf("%q accepted", ep)
		} else if !strings.Contains(err.Error(), "control socket") {
			t.Fatalf("%q: %v", ep, err)
		}
	}
}

// The control socket logs itself as the control socket, not as a side
// channel (it is a router of package sidechannel, which logs "side channel
// listening" for its own sockets).
func TestServeLogsControlSocket(t *testing.T) {
	var buf syncBuffer
	zctx, err := sidechannel.NewContext(sidechannel.ContextOptions{Logger: slog.New(slog.NewTextHandler(&buf, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv, err := Serve(ctx, zctx, "ipc://"+filepath.Join(t.TempDir(), "ctl.sock"), Backend{Role: "decode"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv.Close()
	if err := zctx.Close(); err != nil {
		t.Fatal(err)
	}
	if got := buf.String(); !strings.Contains(got, `msg="control socket listening"`) || !strings.Contains(got, `msg="control socket closed"`) || strings.Contains(got, "side channel") {
		t.Fatalf("log:\n%s\nwant \"control socket listening\" and no \"side channel listening\"", got)
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
