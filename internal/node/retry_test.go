package node

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/internal/sidechannel/wire"
	"github.com/kvflow/kvflow/internal/tooling/testkit"
)

// countingRouter is a side channel on a real ZMQ ROUTER socket that counts
// the copies of each request kind it receives. It answers GET_META with
// meta when meta is set and nothing else, ever: every DONE, batched DONE
// and RENEW goes unanswered, so the client retries it until its attempts
// run out.
type countingRouter struct {
	port int

	mu     sync.Mutex
	counts map[wire.Kind]int
}

func startCountingRouter(t *testing.T, meta *sidechannel.Metadata) *countingRouter {
	t.Helper()
	zctx, err := zmq.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	sock, err := zctx.NewSocket(zmq.ROUTER)
	if err != nil {
		t.Fatal(err)
	}
	if err := sock.Bind("tcp://127.0.0.1:*"); err != nil {
		t.Fatal(err)
	}
	ep, err := sock.GetLastEndpoint()
	if err != nil {
		t.Fatal(err)
	}
	r := &countingRouter{counts: map[wire.Kind]int{}}
	if _, err := fmt.Sscanf(ep[strings.LastIndexByte(ep, ':')+1:], "%d", &r.port); err != nil {
		t.Fatalf("endpoint %q: %v", ep, err)
	}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() { // owns sock
		defer close(done)
		poller := zmq.NewPoller()
		poller.Add(sock, zmq.POLLIN)
		for {
			select {
			case <-stop:
				return
			default:
			}
			polled, err := poller.Poll(20 * time.Millisecond)
			if err != nil || len(polled) == 0 {
				continue
			}
			frames, err := sock.RecvMessageBytes(0)
			if err != nil || len(frames) != 3 {
				continue
			}
			req, err := wire.DecodeRequest(frames[2])
			if err != nil {
				t.Errorf("router: undecodable request %q: %v", frames[2], err)
				continue
			}
			r.mu.Lock()
			r.counts[req.Kind]++
			r.mu.Unlock()
			if req.Kind == wire.KindGetMeta && meta != nil {
				if _, err := sock.SendMessage(frames[0], "", wire.EncodeMetadata(*meta)); err != nil {
					t.Errorf("router: reply: %v", err)
				}
			}
		}
	}()
	t.Cleanup(func() {
		close(stop)
		<-done
		sock.SetLinger(0)
		sock.Close()
		zctx.Term()
	})
	return r
}

func (r *countingRouter) snapshot() map[wire.Kind]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[wire.Kind]int{}
	for k, n := range r.counts {
		out[k] = n
	}
	return out
}

// TestRetriesFollowConfig: a decode node's GET_META is tried
// handshake.attempts times and its DONE_RECVING, batched DONE and RENEW
// notify.attempts times, over real sockets, against a ROUTER that never
// answers them. The two sections' attempts differ (2 and 4), so a call on
// the wrong section's client shows up as a wrong count.
func TestRetriesFollowConfig(t *testing.T) {
	const (
		handshakeAttempts = 2
		notifyAttempts    = 4
		attemptTimeout    = 200 * time.Millisecond
		backoff           = 50 * time.Millisecond
	)
	tp := topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}
	results := make(chan decode.Result, 8)
	var p, d *Node
	for range 8 {
		kvPort := testkit.RandomPort()
		var err error
		if p, err = Start(baseConfig(tp, "prefill", kvPort), Deps{}); err != nil {
			continue
		}
		dc := baseConfig(tp, "decode", kvPort+1000)
		dc.Handshake.Attempts = handshakeAttempts
		dc.Handshake.Timeout = config.Duration(attemptTimeout)
		dc.Handshake.RetryBackoff = config.Duration(backoff)
		dc.Notify.Attempts = notifyAttempts
		dc.Notify.Timeout = config.Duration(attemptTimeout)
		dc.Notify.RetryBackoff = config.Duration(backoff)
		if d, err = Start(dc, Deps{OnFinish: func(r decode.Result) { results <- r }}); err != nil {
			p.Close(context.Background())
			p = nil
			continue
		}
		break
	}
	if p == nil || d == nil {
		t.Fatal("nodes did not start")
	}
	defer p.Close(context.Background())
	defer d.Close(context.Background())
	// The real prefill's transfer engine serves the reads; the router
	// stands in for its side channel.
	meta := func(batch bool) *sidechannel.Metadata {
		return &sidechannel.Metadata{EngineID: "P", TERPCPort: p.Engine.RPCPort(), KVCachesBaseAddr: p.Device.BaseAddrs(),
			NumBlocks: p.Shape.NumBlocks, Ext: sidechannel.Ext{BatchDone: batch}}
	}

	cases := []struct {
		name string
		meta *sidechannel.Metadata // nil: GET_META unanswered
		// call, if set, is made directly instead of a load through the
		// decode worker.
		call func(ctx context.Context, endpoint string) error
		// want is the copies of each kind; answered GET_META (-1) may
		// also be retried, up to handshake.attempts, if a loaded machine
		// delays its reply past the attempt timeout.
		want map[wire.Kind]int
	}{
		// The handshake fails; the failed job still sends a plain DONE,
		// with one attempt: the side channel just answered none of the
		// GET_META's (notify's doneAfter).
		{name: "get_meta unanswered", want: map[wire.Kind]int{wire.KindGetMeta: handshakeAttempts, wire.KindDoneRecving: 1}},
		{name: "done unanswered", meta: meta(false), want: map[wire.Kind]int{wire.KindGetMeta: -1, wire.KindDoneRecving: notifyAttempts}},
		{name: "batched done unanswered", meta: meta(true), want: map[wire.Kind]int{wire.KindGetMeta: -1, wire.KindDoneBatch: notifyAttempts}},
		{name: "renew unanswered", call: func(ctx context.Context, ep string) error { return d.Notify.Renew(ctx, ep, []string{"r"}) },
			want: map[wire.Kind]int{wire.KindRenew: notifyAttempts}},
		{name: "get_meta direct", call: func(ctx context.Context, ep string) error { _, err := d.Client.GetMeta(ctx, ep); return err },
			want: map[wire.Kind]int{wire.KindGetMeta: handshakeAttempts}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := startCountingRouter(t, tc.meta)
			start := time.Now()
			if tc.call != nil {
				err := tc.call(context.Background(), fmt.Sprintf("127.0.0.1:%d", r.port))
				if !errors.Is(err, sidechannel.ErrTimeout) {
					t.Fatalf("unanswered call: %v, want ErrTimeout", err)
				}
			} else {
				id := fmt.Sprint("req", i)
				// Held for decode, so read grants serve its block.
				if err := p.Prefill.Send([]prefill.SendRequest{{RequestID: id, BlockIDs: []int{1}}})[0]; err != nil {
					t.Fatal(err)
				}
				if err := load(t, d, id, []int{1}, []int{1}, r.port, "P"); err != nil {
					t.Fatal(err)
				}
				select {
				case res := <-results:
					if res.RequestID != id {
						t.Fatalf("result for %q, want %q", res.RequestID, id)
					}
					if (tc.meta == nil) != (res.Err != nil) {
						t.Errorf("result error %v (metadata answered: %v)", res.Err, tc.meta != nil)
					}
				case <-time.After(20 * time.Second):
					t.Fatal("no result")
				}
			}
			// Any copy beyond the attempts would come within one more
			// timeout and backoff.
			time.Sleep(2 * (attemptTimeout + backoff))
			got := r.snapshot()
			for _, k := range []wire.Kind{wire.KindGetMeta, wire.KindDoneRecving, wire.KindDoneBatch, wire.KindRenew} {
				lo, hi, want := tc.want[k], tc.want[k], fmt.Sprint(tc.want[k])
				if lo == -1 {
					lo, hi, want = 1, handshakeAttempts, fmt.Sprintf("1..%d", handshakeAttempts)
				}
				if got[k] < lo || got[k] > hi {
					t.Errorf("%v: %d copies, want %s (after %v)", k, got[k], want, time.Since(start))
				}
			}
		})
	}
}
