package sidechannel

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvflow/kvflow/internal/sidechannel/wire"
)

var testMeta = Metadata{
	EngineID:         "engine-P",
	TERPCPort:        15000,
	KVCachesBaseAddr: []uint64{0x10000000, 1<<63 + 5, math.MaxUint64},
	NumBlocks:        1024,
}

// metric returns a counter's value, a histogram's sample count or a gauge's
// value for the series of name with (at least) the given labels.
func metric(t *testing.T, e *testEnv, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := e.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				return m.GetCounter().GetValue()
			case m.Histogram != nil:
				return float64(m.GetHistogram().GetSampleCount())
			case m.Gauge != nil:
				return m.GetGauge().GetValue()
			}
		}
	}
	t.Fatalf("metric %s%v not found", name, labels)
	return 0
}

func requests(t *testing.T, e *testEnv, role, op, outcome string) float64 {
	t.Helper()
	return metric(t, e, "kvflow_sidechannel_requests_total", map[string]string{"role": role, "op": op, "outcome": outcome})
}

// serverRequests waits (up to 2 s) for a server-side counter to reach want:
// the server counts a request after its reply is queued, so the client can
// see the reply first.
func serverRequests(t *testing.T, e *testEnv, op, outcome string, want float64) float64 {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for {
		v := requests(t, e, "server", op, outcome)
		if v == want || time.Now().After(deadline) {
			return v
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestRoundTrip(t *testing.T) {
	e := newEnv(t)
	md := testMeta
	md.Ext = Ext{BootEpoch: 42}
	h := &recorder{md: md}
	s := e.server(t, h, ServerOptions{})
	c := e.client(t, fastClientOpts())
	ctx := context.Background()

	for i := range 3 { // later calls reuse the pooled socket
		got, err := c.GetMeta(ctx, s.Addr())
		if err != nil {
			t.Fatalf("GetMeta %d: %v", i, err)
		}
		if !reflect.DeepEqual(got, md) {
			t.Fatalf("GetMeta = %+v, want %+v", got, md)
		}
	}
	ids := []string{"req-1", "", "héllo", "🚀", strings.Repeat("x", 300)}
	for _, id := range ids {
		if err := c.SendDone(ctx, "tcp://"+s.Addr(), id); err != nil {
			t.Fatalf("SendDone(%q): %v", id, err)
		}
	}
	if got := h.doneIDs(); !reflect.DeepEqual(got, ids) {
		t.Fatalf("server saw %q, want %q", got, ids)
	}
	if v := requests(t, e, "client", "get_meta", "ok"); v != 3 {
		t.Errorf("client get_meta ok = %v", v)
	}
	if v := serverRequests(t, e, "done", "ok", float64(len(ids))); v != float64(len(ids)) {
		t.Errorf("server done ok = %v", v)
	}
	if v := metric(t, e, "kvflow_sidechannel_request_duration_seconds", map[string]string{"role": "client", "op": "done"}); v != float64(len(ids)) {
		t.Errorf("client done duration samples = %v", v)
	}
	for _, r := range resetReasons {
		if v := metric(t, e, "kvflow_sidechannel_socket_resets_total", map[string]string{"reason": r}); v != 0 {
			t.Errorf("resets{%s} = %v", r, v)
		}
	}
	// One pooled conn (3 sockets) and the server (3): sequential calls reuse.
	if v := metric(t, e, "kvflow_sidechannel_open_sockets", nil); int(v) != e.zctx.OpenSockets() || v != 6 {
		t.Errorf("open sockets gauge %v, count %d, want 6", v, e.zctx.OpenSockets())
	}
}

// TestSeedDialogues replays the seed's recorded ROUTER dialogues against the
// kvflow server through a DEALER carrying the recorded identity: every frame
// set the seed answered gets the seed's exact reply frames; the ones it
// dropped get kvflow's "ERR ..." (default) or nothing (DropBadMessages).
func TestSeedDialogues(t *testing.T) {
	vectors := filepath.Join("..", "..", "testdata", "seedref", "wire_bytes.json")
	if d := os.Getenv("KVFLOW_SEEDREF_DIR"); d != "" { // another vector set, when it has this family
		if _, err := os.Stat(filepath.Join(d, "wire_bytes.json")); err == nil {
			vectors = filepath.Join(d, "wire_bytes.json")
		}
	}
	raw, err := os.ReadFile(vectors)
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Cases []struct {
			Kind     string     `json:"kind"`
			Dialogue string     `json:"dialogue"`
			FramesIn [][]string `json:"frames_in"`
			Replies  [][]string `json:"replies"`
		} `json:"cases"`
	}
	if err := json.Unmarshal(raw, &f); err != nil {
		t.Fatal(err)
	}
	// What the seed answered GET_META with, and the first DONE it was sent,
	// come from the recorded dialogues themselves (any vector set).
	var seedMeta Metadata
	haveMeta, firstDone := false, ""
	for _, c := range f.Cases {
		if c.Kind != "send_thread_dialogue" {
			continue
		}
		for _, frames := range c.FramesIn {
			if len(frames) < 2 || firstDone != "" {
				continue
			}
			b, _ := hex.DecodeString(frames[len(frames)-1])
			if r, err := wire.DecodeRequest(b); err == nil && r.Kind == wire.KindDoneRecving {
				firstDone = r.RequestID
			}
		}
		for _, rep := range c.Replies {
			if len(rep) < 2 {
				continue
			}
			b, _ := hex.DecodeString(rep[len(rep)-1])
			m, err := wire.DecodeMetadata(b)
			if err != nil {
				continue
			}
			if haveMeta && !reflect.DeepEqual(m, seedMeta) {
				t.Fatalf("%s: the seed answered GET_META with %+v and elsewhere %+v", c.Dialogue, m, seedMeta)
			}
			seedMeta, haveMeta = m, true
		}
	}
	if !haveMeta || firstDone == "" {
		t.Fatalf("vectors: no GET_META reply (%v) or no DONE (%q) in the seed's dialogues", haveMeta, firstDone)
	}
	for _, drop := range []bool{false, true} {
		t.Run(fmt.Sprintf("drop=%v", drop), func(t *testing.T) {
			e := newEnv(t)
			h := &recorder{md: seedMeta}
			s := e.server(t, h, ServerOptions{DropBadMessages: drop})
			n := 0
			for ci, c := range f.Cases {
				if c.Kind != "send_thread_dialogue" {
					continue
				}
				replies := c.Replies
				for fi, frames := range c.FramesIn {
					if len(frames) < 2 {
						continue // a DEALER cannot send a message with no frames
					}
					id, _ := hex.DecodeString(frames[0])
					// A unique identity per frame set: ZMQ refuses a second
					// connection with an identity already in use.
					id = append(id, fmt.Sprintf("-%d-%d-%v", ci, fi, drop)...)
					d := e.dealer(t, s.Addr(), id)
					var out [][]byte
					for _, fr := range frames[1:] {
						b, _ := hex.DecodeString(fr)
						out = append(out, b)
					}
					if _, err := d.SendMessage(out); err != nil {
						t.Fatal(err)
					}
					answered := len(replies) > 0 && replies[0][0] == frames[0]
					if !answered && drop {
						// Nothing must come back: follow with a GET_META and
						// check that its reply is the first thing received.
						if _, err := d.SendMessage("", wire.EncodeGetMeta()); err != nil {
							t.Fatal(err)
						}
					}
					got, err := d.RecvMessageBytes(0)
					if err != nil {
						t.Fatalf("%s: no reply: %v", c.Dialogue, err)
					}
					switch {
					case answered:
						want := replies[0][1:]
						replies = replies[1:]
						if len(got) != len(want) {
							t.Fatalf("%s: reply %x, seed %v", c.Dialogue, got, want)
						}
						for i := range want {
							if hex.EncodeToString(got[i]) != want[i] {
								t.Fatalf("%s: reply frame %d %x, seed %s", c.Dialogue, i, got[i], want[i])
							}
						}
						n++
					case drop:
						if len(got) != 2 || len(got[0]) != 0 || string(got[1]) != string(wire.EncodeMetadata(seedMeta)) {
							t.Fatalf("%s: dropped message got a reply: %q", c.Dialogue, got)
						}
					default:
						if len(got) != 2 || len(got[0]) != 0 || !strings.HasPrefix(string(got[1]), wire.ErrorReplyPrefix) {
							t.Fatalf("%s: want ERR reply, got %q", c.Dialogue, got)
						}
					}
				}
				if len(replies) != 0 {
					t.Fatalf("%s: %d seed replies not reproduced", c.Dialogue, len(replies))
				}
			}
			if n < 10 {
				t.Fatalf("only %d answered frame sets checked", n)
			}
			if got := h.doneIDs(); len(got) == 0 || got[0] != firstDone {
				t.Fatalf("DONEs seen: %q, want %q first", got, firstDone)
			}
			if v := metric(t, e, "kvflow_sidechannel_bad_messages_total", map[string]string{"reason": "envelope"}); v < 2 {
				t.Errorf("bad envelope count %v", v)
			}
			if v := metric(t, e, "kvflow_sidechannel_bad_messages_total", map[string]string{"reason": "decode"}); v < 3 {
				t.Errorf("bad decode count %v", v)
			}
		})
	}
}

// TestConcurrentPeers runs many goroutines against several servers at once.
func TestConcurrentPeers(t *testing.T) {
	e := newEnv(t)
	const peers, workers, calls = 4, 24, 25
	var hs []*recorder
	var addrs []string
	for i := range peers {
		md := testMeta
		md.EngineID = fmt.Sprintf("engine-%d", i)
		h := &recorder{md: md}
		hs = append(hs, h)
		addrs = append(addrs, e.server(t, h, ServerOptions{}).Addr())
	}
	opts := fastClientOpts()
	opts.AttemptTimeout = 2 * time.Second // -race on 2 cores: generous
	c := e.client(t, opts)
	var wg sync.WaitGroup
	var dones [peers]atomic.Int64
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for i := range calls {
				p := rng.IntN(peers)
				if rng.IntN(2) == 0 {
					md, err := c.GetMeta(context.Background(), addrs[p])
					if err == nil && md.EngineID != fmt.Sprintf("engine-%d", p) {
						err = fmt.Errorf("peer %d answered as %s", p, md.EngineID)
					}
					if err != nil {
						errs <- err
						return
					}
				} else {
					if err := c.SendDone(context.Background(), addrs[p], fmt.Sprintf("w%d-%d", w, i)); err != nil {
						errs <- err
						return
					}
					dones[p].Add(1)
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for i, h := range hs {
		if got := len(h.doneIDs()); int64(got) != dones[i].Load() {
			t.Errorf("peer %d saw %d DONEs, client sent %d", i, got, dones[i].Load())
		}
	}
	if v := metric(t, e, "kvflow_sidechannel_socket_resets_total", map[string]string{"reason": "timeout"}); v != 0 {
		t.Errorf("timeouts under load: %v", v)
	}
}

// TestTimeoutDoesNotPoison: a peer ignores the first request, then answers.
// The timed-out socket is closed; the next call works on a fresh one.
func TestTimeoutDoesNotPoison(t *testing.T) {
	e := newEnv(t)
	var seen atomic.Int64
	meta := wire.EncodeMetadata(testMeta)
	p := e.rawRouter(t, func(frames [][]byte) [][]byte {
		if seen.Add(1) == 1 {
			return nil // swallow the first request
		}
		return [][]byte{frames[0], {}, meta}
	})
	opts := fastClientOpts()
	opts.Attempts = 1
	c := e.client(t, opts)
	start := time.Now()
	_, err := c.GetMeta(context.Background(), p.addr)
	if !errors.Is(err, ErrTimeout) {
		t.Fatalf("first call: want ErrTimeout, got %v", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("timeout took %v", d)
	}
	for i := range 3 {
		md, err := c.GetMeta(context.Background(), p.addr)
		if err != nil || md.EngineID != testMeta.EngineID {
			t.Fatalf("call %d after timeout: %+v %v", i, md, err)
		}
	}
	if v := metric(t, e, "kvflow_sidechannel_socket_resets_total", map[string]string{"reason": "timeout"}); v != 1 {
		t.Errorf("timeout resets %v, want 1", v)
	}
	if v := requests(t, e, "client", "get_meta", "timeout"); v != 1 {
		t.Errorf("timeout outcomes %v", v)
	}

	// With retries the same peer behaviour is invisible to the caller.
	seen.Store(0)
	c2 := e.client(t, fastClientOpts())
	if _, err := c2.GetMeta(context.Background(), p.addr); err != nil {
		t.Fatalf("retry should hide one lost request: %v", err)
	}
	if v := metric(t, e, "kvflow_sidechannel_socket_resets_total", map[string]string{"reason": "timeout"}); v != 2 {
		t.Errorf("timeout resets %v, want 2", v)
	}
}

// TestNoAnswer: a peer that accepts connections but never answers, and a
// port with no listener: both fail with ErrTimeout within the budget.
func TestNoAnswer(t *testing.T) {
	e := newEnv(t)
	c := e.client(t, fastClientOpts()) // 2 × 200 ms + 10 ms
	for name, addr := range map[string]string{"black hole": e.blackHole(t), "no listener": e.freePort(t)} {
		start := time.Now()
		err := c.SendDone(context.Background(), addr, "r")
		d := time.Since(start)
		if !errors.Is(err, ErrTimeout) {
			t.Fatalf("%s: want ErrTimeout, got %v", name, err)
		}
		if d < 400*time.Millisecond || d > 1500*time.Millisecond {
			t.Fatalf("%s: failed after %v, want ≈410ms", name, d)
		}
	}
	if v := requests(t, e, "client", "done", "timeout"); v != 2 {
		t.Errorf("timeout outcomes %v", v)
	}
}

func TestContextCancelIsPrompt(t *testing.T) {
	e := newEnv(t)
	addr := e.blackHole(t)
	opts := fastClientOpts()
	opts.AttemptTimeout = 30 * time.Second
	c := e.client(t, opts)

	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	start := time.Now()
	_, err := c.GetMeta(ctx, addr)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("want context.Canceled, got %v", err)
	}
	if d := time.Since(start); d > 500*time.Millisecond {
		t.Fatalf("cancel took %v", d)
	}

	ctx, cancel2 := context.WithTimeout(context.Background(), 80*time.Millisecond)
	defer cancel2()
	start = time.Now()
	err = c.SendDone(ctx, addr, "r")
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want DeadlineExceeded, got %v", err)
	}
	if d := time.Since(start); d > 500*time.Millisecond {
		t.Fatalf("deadline took %v", d)
	}
	if v := requests(t, e, "client", "get_meta", "canceled"); v != 1 {
		t.Errorf("canceled outcomes %v", v)
	}
	if v := metric(t, e, "kvflow_sidechannel_socket_resets_total", map[string]string{"reason": "canceled"}); v != 2 {
		t.Errorf("canceled resets %v", v)
	}
}

// TestSlowPeerDoesNotBlockOthers: callers stuck on an unresponsive peer
// (more than its socket limit) do not delay calls to a healthy peer.
func TestSlowPeerDoesNotBlockOthers(t *testing.T) {
	e := newEnv(t)
	slow := e.blackHole(t)
	good := e.server(t, &recorder{md: testMeta}, ServerOptions{}).Addr()
	opts := fastClientOpts()
	opts.AttemptTimeout = 3 * time.Second
	opts.Attempts = 1
	opts.MaxConnsPerPeer = 2
	c := e.client(t, opts)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range 6 {
		wg.Go(func() { _, _ = c.GetMeta(ctx, slow) })
	}
	time.Sleep(50 * time.Millisecond) // let them occupy the slow peer
	start := time.Now()
	for i := range 20 {
		if err := c.SendDone(context.Background(), good, fmt.Sprint(i)); err != nil {
			t.Fatal(err)
		}
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("20 calls to the healthy peer took %v", d)
	}
	cancel()
	wg.Wait()
}

// TestGarbageKeepsServing throws malformed traffic at the ROUTER (bad
// envelopes, bad msgpack, wrong types, oversize messages, a raw REQ peer)
// and checks the server still answers, and answers a REQ peer's garbage
// with an error reply instead of leaving it hanging.
func TestGarbageKeepsServing(t *testing.T) {
	e := newEnv(t)
	h := &recorder{md: testMeta}
	s := e.server(t, h, ServerOptions{MaxMessageBytes: 4096})
	d := e.dealer(t, s.Addr(), nil)
	garbage := [][][]byte{
		{{}},                          // delimiter only
		{{}, {}, {}},                  // empty payloads
		{{0xc1, 0xff}},                // invalid msgpack, no delimiter
		{{}, {0x92, 0xc4}},            // truncated
		{{}, {0x81, 0xa1, 'a', 0x01}}, // map, not array
		{{}, {0x92, 0xac, 'g', 'e', 't', '_', 'm', 'e', 't', 'a', '_', 'm', 's', 'g', 0xa0}}, // str tag
		{{}, {0x92, 0xc4, 0x03, 'f', 'o', 'o', 0xa0}},                                        // unknown
		{{}, wire.EncodeGetMeta(), wire.EncodeGetMeta()},                                     // two payloads
		{{}, []byte(strings.Repeat("\x92", 100))},                                            // nesting
	}
	rng := rand.New(rand.NewPCG(7, 7))
	for range 50 {
		b := make([]byte, rng.IntN(64)+1)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		garbage = append(garbage, [][]byte{{}, b})
	}
	for _, g := range garbage {
		if _, err := d.SendMessage(g); err != nil {
			t.Fatal(err)
		}
	}
	errReplies := 0
	for range garbage {
		got, err := d.RecvMessageBytes(0)
		if err != nil {
			t.Fatalf("reply %d: %v", errReplies, err)
		}
		if len(got) != 2 || !strings.HasPrefix(string(got[1]), wire.ErrorReplyPrefix) {
			// random bytes may happen to form a valid request; fine
			continue
		}
		errReplies++
	}
	if errReplies < len(garbage)-5 {
		t.Errorf("only %d of %d garbage messages got an error reply", errReplies, len(garbage))
	}

	// Oversize: libzmq drops the connection; the server lives on.
	big := e.dealer(t, s.Addr(), nil)
	if _, err := big.SendMessage("", strings.Repeat("x", 10000)); err != nil {
		t.Fatal(err)
	}

	// A raw REQ peer sending garbage gets an immediate ERR reply.
	req, err := e.zctx.newSocket(zmq.REQ)
	if err != nil {
		t.Fatal(err)
	}
	defer e.zctx.closeSocket(req)
	_ = req.SetRcvtimeo(2 * time.Second)
	if err := req.Connect("tcp://" + s.Addr()); err != nil {
		t.Fatal(err)
	}
	if _, err := req.SendBytes([]byte{0xc1}, 0); err != nil {
		t.Fatal(err)
	}
	if rep, err := req.RecvBytes(0); err != nil || !strings.HasPrefix(string(rep), "ERR ") {
		t.Fatalf("REQ garbage reply %q %v", rep, err)
	}

	c := e.client(t, fastClientOpts())
	for range 3 {
		if md, err := c.GetMeta(context.Background(), s.Addr()); err != nil || md.EngineID != testMeta.EngineID {
			t.Fatalf("after garbage: %+v %v", md, err)
		}
	}
	if err := c.SendDone(context.Background(), s.Addr(), "after"); err != nil {
		t.Fatal(err)
	}
	bad := 0.0
	for _, r := range badReasons {
		bad += metric(t, e, "kvflow_sidechannel_bad_messages_total", map[string]string{"reason": r})
	}
	if bad < float64(errReplies) {
		t.Errorf("bad_messages_total %v < error replies %d", bad, errReplies)
	}
}

// TestBadReplies: a peer answering garbage fails the call at once (no
// retry), with a clear error, and the socket is replaced.
func TestBadReplies(t *testing.T) {
	e := newEnv(t)
	var mode atomic.Int64
	p := e.rawRouter(t, func(frames [][]byte) [][]byte {
		switch mode.Load() {
		case 0:
			return [][]byte{frames[0], {}, {0x92, 0x01}} // not a map
		case 1:
			return [][]byte{frames[0], {}, []byte("NACK")}
		case 2:
			return [][]byte{frames[0], {}, []byte("ERR go away")}
		default:
			return [][]byte{frames[0], {}, []byte("A"), []byte("CK")} // two frames
		}
	})
	c := e.client(t, fastClientOpts())
	ctx := context.Background()
	if _, err := c.GetMeta(ctx, p.addr); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "want map") {
		t.Fatalf("garbage metadata: %v", err)
	}
	mode.Store(1)
	if err := c.SendDone(ctx, p.addr, "r"); !errors.Is(err, ErrUnexpectedReply) {
		t.Fatalf("NACK: %v", err)
	}
	mode.Store(2)
	var re *RemoteError
	if err := c.SendDone(ctx, p.addr, "r"); !errors.As(err, &re) || re.Reason != "go away" {
		t.Fatalf("ERR reply: %v", err)
	}
	if _, err := c.GetMeta(ctx, p.addr); !errors.As(err, &re) {
		t.Fatalf("ERR reply to GET_META: %v", err)
	}
	mode.Store(3)
	if err := c.SendDone(ctx, p.addr, "r"); !errors.Is(err, ErrUnexpectedReply) {
		t.Fatalf("two frames: %v", err)
	}
	if v := requests(t, e, "client", "done", "bad_reply"); v != 2 {
		t.Errorf("bad_reply %v", v)
	}
	if v := requests(t, e, "client", "done", "remote_error"); v != 1 {
		t.Errorf("remote_error %v", v)
	}
	if v := metric(t, e, "kvflow_sidechannel_socket_resets_total", map[string]string{"reason": "error"}); v != 5 {
		t.Errorf("error resets %v, want 5", v)
	}
}

func TestHandlerErrors(t *testing.T) {
	e := newEnv(t)
	h := &recorder{md: testMeta, err: errors.New("unknown request")}
	s := e.server(t, h, ServerOptions{})
	c := e.client(t, fastClientOpts())
	ctx := context.Background()
	if err := c.SendDone(ctx, s.Addr(), "unknown"); err != nil {
		t.Fatalf("a Done error is still ACKed: %v", err)
	}
	h.mu.Lock()
	h.panic = true
	h.mu.Unlock()
	var re *RemoteError
	if err := c.SendDone(ctx, s.Addr(), "boom"); !errors.As(err, &re) {
		t.Fatalf("panicking handler: want RemoteError, got %v", err)
	}
	if _, err := c.GetMeta(ctx, s.Addr()); err != nil {
		t.Fatalf("server must survive a handler panic: %v", err)
	}
	if v := serverRequests(t, e, "done", "handler_error", 2); v != 2 {
		t.Errorf("handler_error %v", v)
	}
}

// TestLateReplyIsNotMisattributed: the server answers a DONE after the
// client gave up; the late reply must not be read as the answer to the next
// request (the timed-out socket is gone).
func TestLateReplyIsNotMisattributed(t *testing.T) {
	e := newEnv(t)
	gate := make(chan struct{})
	h := &recorder{md: testMeta, gate: gate}
	s := e.server(t, h, ServerOptions{})
	opts := fastClientOpts()
	opts.Attempts = 1
	c := e.client(t, opts)
	if err := c.SendDone(context.Background(), s.Addr(), "slow"); !errors.Is(err, ErrTimeout) {
		t.Fatalf("want timeout, got %v", err)
	}
	h.mu.Lock()
	h.gate = nil
	h.mu.Unlock()
	close(gate) // the server now ACKs "slow" to a closed socket
	md, err := c.GetMeta(context.Background(), s.Addr())
	if err != nil || !reflect.DeepEqual(md, testMeta) {
		t.Fatalf("next call: %+v %v", md, err)
	}
}

func TestCloseAbortsInFlight(t *testing.T) {
	e := newEnv(t)
	addr := e.blackHole(t)
	opts := fastClientOpts()
	opts.AttemptTimeout = 30 * time.Second
	c, err := NewClient(e.zctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { _, err := c.GetMeta(context.Background(), addr); errc <- err }()
	time.Sleep(50 * time.Millisecond)
	start := time.Now()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; !errors.Is(err, ErrClosed) {
		t.Fatalf("in-flight call: want ErrClosed, got %v", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("Close took %v", d)
	}
	if _, err := c.GetMeta(context.Background(), addr); !errors.Is(err, ErrClosed) {
		t.Fatalf("call after Close: %v", err)
	}
	_ = c.Close() // idempotent
}

func TestContextCloseClosesEverything(t *testing.T) {
	zctx, err := NewContext(ContextOptions{})
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewServer(zctx, ServerOptions{Addr: "127.0.0.1:0"}, HandlerFuncs{MetadataFunc: func() Metadata { return testMeta }})
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewClient(zctx, fastClientOpts())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetMeta(context.Background(), s.Addr()); err != nil {
		t.Fatal(err)
	}
	if err := c.SendDone(context.Background(), s.Addr(), "x"); err != nil { // nil DoneFunc: ACK
		t.Fatal(err)
	}
	if zctx.OpenSockets() == 0 {
		t.Fatal("no sockets open?")
	}
	if err := zctx.Close(); err != nil {
		t.Fatal(err)
	}
	if n := zctx.OpenSockets(); n != 0 {
		t.Fatalf("%d sockets open after Close", n)
	}
	if _, err := NewClient(zctx, ClientOptions{}); !errors.Is(err, ErrClosed) {
		t.Fatalf("NewClient after Close: %v", err)
	}
	if _, err := NewServer(zctx, ServerOptions{Addr: "127.0.0.1:0"}, HandlerFuncs{}); !errors.Is(err, ErrClosed) {
		t.Fatalf("NewServer after Close: %v", err)
	}
	_ = s.Close() // after the context: no-op
	if err := zctx.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestServerCloseAndRebind(t *testing.T) {
	e := newEnv(t)
	s := e.server(t, &recorder{md: testMeta}, ServerOptions{})
	addr := s.Addr()
	start := time.Now()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 200*time.Millisecond {
		t.Fatalf("Close took %v", d)
	}
	_ = s.Close()
	opts := fastClientOpts()
	opts.Attempts = 3
	c := e.client(t, opts)
	// The port is free again: a new server on it answers the same client.
	errc := make(chan error, 1)
	go func() { _, err := c.GetMeta(context.Background(), addr); errc <- err }()
	time.Sleep(100 * time.Millisecond)
	e.server(t, &recorder{md: testMeta}, ServerOptions{Addr: addr})
	if err := <-errc; err != nil {
		t.Fatalf("after restart on %s: %v", addr, err)
	}
	if _, err := NewServer(e.zctx, ServerOptions{Addr: addr}, &recorder{}); err == nil {
		t.Fatal("second bind on a used port must fail")
	}
}

func TestEndpoints(t *testing.T) {
	for _, c := range []struct {
		in, key, zmq string
		wild, err    bool
	}{
		{in: "127.0.0.1:5555", key: "127.0.0.1:5555", zmq: "tcp://127.0.0.1:5555"},
		{in: "tcp://h:1", key: "h:1", zmq: "tcp://h:1"},
		{in: "[::1]:7", key: "[::1]:7", zmq: "tcp://[::1]:7"},
		{in: "h:0", err: true},
		{in: "h:0", wild: true, key: "h:0", zmq: "tcp://h:*"},
		{in: ":9", wild: true, key: "*:9", zmq: "tcp://*:9"},
		{in: ":9", err: true},
		{in: "h", err: true},
		{in: "h:70000", err: true},
		{in: "h:x", err: true},
	} {
		ep, err := parseEndpoint(c.in, c.wild)
		if c.err {
			if !errors.Is(err, ErrEndpoint) {
				t.Errorf("%q: want ErrEndpoint, got %v", c.in, err)
			}
			continue
		}
		if err != nil || ep.key != c.key || ep.zmq != c.zmq {
			t.Errorf("%q: %+v %v", c.in, ep, err)
		}
	}
	e := newEnv(t)
	c := e.client(t, fastClientOpts())
	if _, err := c.GetMeta(context.Background(), "nope"); !errors.Is(err, ErrEndpoint) {
		t.Fatalf("bad endpoint: %v", err)
	}
}

func TestOptionsValidate(t *testing.T) {
	if err := (ClientOptions{}).Validate(); err != nil {
		t.Fatalf("zero options: %v", err)
	}
	err := ClientOptions{AttemptTimeout: time.Microsecond, Attempts: -1, MaxConnsPerPeer: 1, MaxIdlePerPeer: 2}.Validate()
	if err == nil || !strings.Contains(err.Error(), "AttemptTimeout") || !strings.Contains(err.Error(), "Attempts") || !strings.Contains(err.Error(), "MaxIdlePerPeer") {
		t.Fatalf("want all problems, got %v", err)
	}
}

// BenchmarkGetMetaLoopback: one GET_META round trip, straight to the
// ROUTER and through the front the node puts on the port (Limits).
func BenchmarkGetMetaLoopback(b *testing.B) {
	for _, bc := range []struct {
		name string
		lim  *Limits
	}{{"direct", nil}, {"front", &DefaultLimits}} {
		b.Run(bc.name, func(b *testing.B) {
			zctx, err := NewContext(ContextOptions{})
			if err != nil {
				b.Fatal(err)
			}
			defer zctx.Close()
			s, err := NewServer(zctx, ServerOptions{Addr: "127.0.0.1:0", Limits: bc.lim}, &recorder{md: testMeta})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			c, err := NewClient(zctx, ClientOptions{})
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			ctx := context.Background()
			for b.Loop() {
				if _, err := c.GetMeta(ctx, s.Addr()); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestRenew: kvflow's RENEW round trip (batched by wire.MaxRenewIDs), the
// lease TTL in the metadata, and a handler without leases refusing RENEW
// with "ERR" (so a misdirected RENEW fails at once instead of timing out).
func TestRenew(t *testing.T) {
	e := newEnv(t)
	md := testMeta
	md.Ext = Ext{BootEpoch: 1, LeaseTTL: 10 * time.Second}
	var mu sync.Mutex
	var got [][]string
	s := e.server(t, HandlerFuncs{
		MetadataFunc: func() Metadata { return md },
		RenewFunc: func(ids []string) error {
			mu.Lock()
			defer mu.Unlock()
			got = append(got, ids)
			if len(ids) == 1 && ids[0] == "err" {
				return errors.New("not held")
			}
			return nil
		},
	}, ServerOptions{})
	c := e.client(t, fastClientOpts())
	ctx := context.Background()
	m, err := c.GetMeta(ctx, s.Addr())
	if err != nil || m.Ext.LeaseTTL != 10*time.Second {
		t.Fatalf("GetMeta: %+v %v", m.Ext, err)
	}
	ids := make([]string, wire.MaxRenewIDs+3)
	for i := range ids {
		ids[i] = fmt.Sprintf("req-%d", i)
	}
	if err := c.Renew(ctx, s.Addr(), ids); err != nil {
		t.Fatal(err)
	}
	if err := c.Renew(ctx, s.Addr(), []string{"err"}); err != nil {
		t.Fatalf("a Renew error is still ACKed: %v", err)
	}
	if err := c.Renew(ctx, s.Addr(), nil); err != nil {
		t.Fatalf("empty renew: %v", err)
	}
	mu.Lock()
	if len(got) != 3 || len(got[0]) != wire.MaxRenewIDs || !reflect.DeepEqual(append(got[0], got[1]...), ids) {
		t.Fatalf("server saw %d batches", len(got))
	}
	mu.Unlock()
	if v := serverRequests(t, e, "renew", "ok", 2); v != 2 { // Renew(nil) sends nothing
		t.Errorf("server renew ok = %v", v)
	}
	if v := serverRequests(t, e, "renew", "handler_error", 1); v != 1 {
		t.Errorf("server renew handler_error = %v", v)
	}

	// No leases: a Handler without Renew, and HandlerFuncs without RenewFunc.
	for name, h := range map[string]Handler{"recorder": &recorder{md: testMeta}, "funcs": HandlerFuncs{}} {
		s2 := e.server(t, h, ServerOptions{})
		var re *RemoteError
		if err := c.Renew(ctx, s2.Addr(), []string{"a"}); !errors.As(err, &re) || !strings.Contains(re.Reason, "renew") {
			t.Fatalf("%s: renew to a server without leases: %v", name, err)
		}
		if _, err := c.GetMeta(ctx, s2.Addr()); err != nil {
			t.Fatalf("%s: server must keep serving: %v", name, err)
		}
	}
}

// A peer whose host name does not resolve is reported as such, not as a
// bare "no reply" (ZMQ resolves in the background and never says); the
// error is still ErrTimeout for callers that retry on it.
func TestUnresolvableHostNamed(t *testing.T) {
	zctx, err := NewContext(ContextOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer zctx.Close()
	opts := fastClientOpts()
	opts.Attempts, opts.AttemptTimeout = 1, 100*time.Millisecond
	c, err := NewClient(zctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = c.GetMeta(context.Background(), "kvflow-no-such-host.invalid:20001")
	var dns *net.DNSError
	if !errors.Is(err, ErrTimeout) || !errors.As(err, &dns) ||
		!strings.Contains(err.Error(), "host does not resolve: lookup kvflow-no-such-host.invalid") {
		t.Fatalf("GetMeta = %v", err)
	}
	// An IP that does not answer is a plain timeout.
	_, err = c.GetMeta(context.Background(), "127.0.0.1:1")
	if !errors.Is(err, ErrTimeout) || strings.Contains(err.Error(), "resolve") {
		t.Fatalf("GetMeta(127.0.0.1:1) = %v", err)
	}
}

// TestBadHostFailsNoPanic: a host libzmq refuses to connect to (a space, a
// NUL, a bare colon: values a router may hand over as remote_host) fails the
// call with the endpoint named. It once crashed the process: newConn's
// cleanup closed a nil conn after the failed connect.
func TestBadHostFailsNoPanic(t *testing.T) {
	zctx, err := NewContext(ContextOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer zctx.Close()
	opts := fastClientOpts()
	opts.Attempts, opts.AttemptTimeout = 1, 100*time.Millisecond
	c, err := NewClient(zctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, host := range []string{"a b\x00c", "a b", "bad\x00host", "x:y:z", "%zz", "[::1"} {
		_, err := c.GetMeta(context.Background(), net.JoinHostPort(host, "20001"))
		if err == nil {
			t.Errorf("GetMeta(%q) succeeded", host)
			continue
		}
		if err := c.SendDone(context.Background(), net.JoinHostPort(host, "20001"), "r"); err == nil {
			t.Errorf("SendDone(%q) succeeded", host)
		}
	}
	// The client still works for a good peer afterwards.
	if _, err := c.GetMeta(context.Background(), "127.0.0.1:1"); !errors.Is(err, ErrTimeout) {
		t.Fatalf("GetMeta(127.0.0.1:1) after bad hosts = %v", err)
	}
	if n := zctx.OpenSockets(); n > 3 {
		t.Errorf("%d sockets open after failed connects: leaked", n)
	}
}
