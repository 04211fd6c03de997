package decode

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/internal/tooling/testkit/fakes/leasefake"
	"github.com/kvflow/kvflow/stages/conf"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

// Ports of the prefill side channels the admission tests use (prefill TP
// 1: a request's remote_port is its only rank's handshake port).
const (
	portStall = 7000 // GET_META hangs: holds the single handshake worker
	portPeer  = 7001 // the peer under test
)

func ep(port int) string { return fmt.Sprintf("127.0.0.1:%d", port) }

// peerFetcher answers GET_META per endpoint: the stall endpoint waits for
// stall (or its context) and advertises a lease; the peer answers with ttl, or err, once gate is
// closed (nil gate: at once). Calls are counted per endpoint.
type peerFetcher struct {
	ttl   time.Duration
	err   error
	stall chan struct{}
	gate  chan struct{}

	stalled chan struct{} // closed at the stall endpoint's first call
	once    sync.Once
	calls   sync.Map // endpoint → *atomic.Int32
}

func newPeerFetcher(ttl time.Duration) *peerFetcher {
	return &peerFetcher{ttl: ttl, stall: make(chan struct{}), stalled: make(chan struct{})}
}

func (f *peerFetcher) count(endpoint string) int {
	v, _ := f.calls.LoadOrStore(endpoint, new(atomic.Int32))
	return int(v.(*atomic.Int32).Load())
}

func (f *peerFetcher) GetMeta(ctx context.Context, endpoint string) (job.Meta, error) {
	v, _ := f.calls.LoadOrStore(endpoint, new(atomic.Int32))
	v.(*atomic.Int32).Add(1)
	m := job.Meta{TERPCPort: 1, BaseAddrs: []uint64{1 << 20, 1<<20 + 4096}, NumBlocks: 8}
	wait := f.gate
	if endpoint == ep(portStall) {
		f.once.Do(func() { close(f.stalled) })
		// Leased (so that it is never refused as a stale read either; long
		// enough that the lease guard trusts it through the tests' sleeps).
		m.EngineID, m.LeaseTTL, wait = "S", time.Second, f.stall
	} else {
		m.EngineID, m.LeaseTTL = "P", f.ttl
		if f.err != nil {
			return job.Meta{}, f.err
		}
	}
	if wait != nil {
		select {
		case <-wait:
		case <-ctx.Done():
			return job.Meta{}, ctx.Err()
		}
	}
	return m, nil
}

func admissionTopology() plan.Topology {
	return plan.Topology{
		Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1, KVPort: 5000},
		Decode:  plan.Parallel{TP: 1, PP: 1, DP: 1, KVPort: 6000},
		Model:   plan.Model{NumLayers: 1, NumKVHeads: 1, MLA: true},
	}
}

// admissionWorker is a worker with one handshake worker, so a request to
// the stall endpoint holds every later request before its handshake.
func admissionWorker(t *testing.T, f handshake.Fetcher, rn Renewer, reads *atomic.Int32, sizes StageSizes, opts ...func(*Options)) (*Worker, *prometheus.Registry) {
	t.Helper()
	if sizes == (StageSizes{}) {
		sizes = DefaultStageSizes()
		sizes.Handshake = StageSize{Workers: 1, Queue: 64}
	}
	reg := prometheus.NewRegistry()
	o := Options{
		Topology: admissionTopology(),
		Fetcher:  f,
		Transfer: transferFunc(func(context.Context, string, []plan.Op) error {
			reads.Add(1)
			return nil
		}),
		Sender:     senderFunc(func(context.Context, string, string) error { return nil }),
		Renewer:    rn,
		Handshake:  handshakeConfig(5 * time.Second),
		Stages:     sizes,
		Layout:     plan.CacheLayout{BlockLen: []uint64{64, 64}, CachesPerLayer: 2},
		Local:      plan.Caches{Base: []uint64{1 << 30, 1<<30 + 4096}, NumBlocks: 8},
		Registerer: reg,
	}
	for _, set := range opts {
		set(&o)
	}
	w, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		w.Close(ctx)
	})
	return w, reg
}

func loadReq(id string, port int) LoadRequest {
	engine := "P"
	if port == portStall {
		engine = "S"
	}
	return LoadRequest{RequestID: id, LocalBlockIDs: []int{1},
		Params: KVTransferParams{RemoteBlockIDs: []int{2}, RemoteEngineID: engine, RemoteHost: "127.0.0.1", RemotePort: port}}
}

func mustLoad(t *testing.T, w *Worker, reqs ...LoadRequest) {
	t.Helper()
	for i, err := range w.Load(context.Background(), reqs) {
		if err != nil {
			t.Fatalf("load %s: %v", reqs[i].RequestID, err)
		}
	}
}

// warm caches the peer's metadata as an earlier request would have.
func warm(t *testing.T, w *Worker) {
	t.Helper()
	if _, err := w.hs.Get(context.Background(), handshake.Key{EngineID: "P", Endpoint: ep(portPeer)}); err != nil {
		t.Fatal(err)
	}
}

// waitEnded polls Finished until ids all ended and returns the failures.
// Its callers run in a synctest bubble (inBubble): its deadline, on the
// bubble's clock, only ends a hang.
func waitEnded(t *testing.T, w *Worker, ids ...string) (done []string, failed []Failure) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for len(done)+len(failed) < len(ids) {
		if time.Now().After(deadline) {
			t.Fatalf("ended %v %v, want %v", done, failed, ids)
		}
		d, f := w.Finished()
		done, failed = append(done, d...), append(failed, f...)
		time.Sleep(2 * time.Millisecond)
	}
	return done, failed
}

// renewsIdle reports whether no RENEW is in flight. A call records its ids
// before its endpoint turns idle, and any later call takes its ids after
// the check, so once it holds, no later RENEW carries a request that had
// already ended.
func renewsIdle(w *Worker) func() bool {
	return w.rn.Idle
}

// inBubble runs a test in a testing/synctest bubble: its clock moves
// only when every goroutine of the worker is blocked, so the sleeps that
// decide an outcome (a lease run out, an abort timeout passed) last exactly
// as written however loaded the machine, and the test fails if a goroutine
// of the worker outlives its Close (run by admissionWorker's cleanup,
// inside the bubble).
func inBubble(f func(t *testing.T)) func(t *testing.T) {
	return func(t *testing.T) { synctest.Test(t, f) }
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// A request queued behind a stalled handshake stage is leased from its
// admission: at once when its peer's metadata is cached, as soon as the
// fetch its admission started lands otherwise; never at a peer that
// advertised no lease. Its lease ends with it.
func TestLeaseAtAdmission(t *testing.T) {
	// b is read after its renewals, on synctest's clock (renewed every
	// 333 ms, trusted for 800 ms after each ACK).
	const ttl = time.Second
	for _, tc := range []struct {
		name   string
		ttl    time.Duration
		cached bool
		want   bool // renewed while queued
	}{
		{"cached metadata", ttl, true, true},
		{"metadata fetched at admission", ttl, false, true},
		{"cached, no lease advertised", 0, true, false},
		{"fetched, no lease advertised", 0, false, false},
	} {
		t.Run(tc.name, inBubble(func(t *testing.T) {
			f := newPeerFetcher(tc.ttl)
			rn := &leasefake.Renewer{}
			var reads atomic.Int32
			w, _ := admissionWorker(t, f, rn, &reads, StageSizes{})
			if tc.cached {
				warm(t, w)
			}
			mustLoad(t, w, loadReq("stall", portStall))
			<-f.stalled
			mustLoad(t, w, loadReq("b", portPeer))
			if tc.cached && tc.ttl > 0 && w.rn.Len() != 1 {
				t.Fatalf("leased requests %d right after Load, want 1 (b, from the cache)", w.rn.Len())
			}
			time.Sleep(300 * time.Millisecond) // the first RENEW goes within 5 ms
			if got := rn.Carried("b"); got != tc.want {
				t.Fatalf("b renewed while queued before its handshake: %v, want %v (calls %+v)", got, tc.want, rn.Calls())
			}
			if reads.Load() != 0 {
				t.Fatal("b was read: it was not held before its handshake")
			}
			if n := f.count(ep(portPeer)); !tc.cached && n != 1 {
				t.Fatalf("%d fetches of the peer, want 1 (at admission)", n)
			}
			close(f.stall)
			done, failed := waitEnded(t, w, "stall", "b")
			if len(done) != 2 {
				t.Fatalf("done %v failed %v", done, failed)
			}
			if w.rn.Len() != 0 {
				t.Fatalf("%d requests still leased after they ended", w.rn.Len())
			}
			waitUntil(t, "no RENEW in flight", renewsIdle(w))
			n := len(rn.Calls())
			time.Sleep(ttl/3 + 100*time.Millisecond) // a renewal period
			for _, c := range rn.Calls()[n:] {
				if slices.Contains(c.IDs, "b") || slices.Contains(c.IDs, "stall") {
					t.Fatalf("renewed after the requests ended: %+v", c)
				}
			}
		}))
	}
}

// A request that ends before its handshake completes — aborted while
// queued, while the fetch its admission started is in flight, failed by
// that fetch, or never submitted (pipeline full) — leaves no lease and no
// pending fetch behind, and is never renewed once it ended.
func TestLeaseRemovedBeforeHandshake(t *testing.T) {
	const ttl = 90 * time.Millisecond
	tight := StageSizes{Plan: StageSize{Workers: 1, Queue: 1}, Handshake: StageSize{Workers: 1, Queue: 1}, Read: StageSize{Workers: 1, Queue: 1}, Stitch: StageSize{Workers: 1, Queue: 1}, Notify: StageSize{Workers: 1, Queue: 1}}
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, w *Worker, f *peerFetcher, rn *leasefake.Renewer)
	}{
		{"leased from the cache, aborted while queued", func(t *testing.T, w *Worker, f *peerFetcher, rn *leasefake.Renewer) {
			warm(t, w)
			mustLoad(t, w, loadReq("stall", portStall))
			<-f.stalled
			mustLoad(t, w, loadReq("b", portPeer))
			waitUntil(t, "b renewed", func() bool { return rn.Carried("b") })
			w.Abort([]string{"b"})
			close(f.stall)
			_, failed := waitEnded(t, w, "stall", "b")
			if len(failed) != 1 || failed[0].RequestID != "b" || !strings.Contains(failed[0].Reason, "aborted") {
				t.Fatalf("failed %+v, want b aborted", failed)
			}
		}},
		{"pending on its fetch, aborted before it lands", func(t *testing.T, w *Worker, f *peerFetcher, rn *leasefake.Renewer) {
			f.gate = make(chan struct{})
			mustLoad(t, w, loadReq("b", portPeer))
			waitUntil(t, "the fetch", func() bool { return f.count(ep(portPeer)) == 1 })
			w.Abort([]string{"b"})
			_, failed := waitEnded(t, w, "b")
			if len(failed) != 1 || !strings.Contains(failed[0].Reason, "stage handshake") {
				t.Fatalf("failed %+v, want b failed in its handshake", failed)
			}
			close(f.gate) // the fetch lands after b ended: nothing to lease
		}},
		{"its fetch fails", func(t *testing.T, w *Worker, f *peerFetcher, rn *leasefake.Renewer) {
			f.err = errors.New("peer gone")
			mustLoad(t, w, loadReq("b", portPeer))
			_, failed := waitEnded(t, w, "b")
			if len(failed) != 1 || !strings.Contains(failed[0].Reason, "peer gone") {
				t.Fatalf("failed %+v, want b failed by the fetch", failed)
			}
		}},
		{"never submitted: pipeline full", func(t *testing.T, w *Worker, f *peerFetcher, rn *leasefake.Renewer) {
			warm(t, w)
			// stall holds the handshake worker; more stalled requests fill
			// the queues until one cannot be submitted: then b cannot either.
			mustLoad(t, w, loadReq("stall", portStall))
			<-f.stalled
			ids := []string{"stall"}
			for i := 0; ; i++ {
				id := fmt.Sprintf("s%d", i)
				// On synctest's clock only a full pipeline makes a Load
				// wait this out.
				ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
				err := w.Load(ctx, []LoadRequest{loadReq(id, portStall)})[0]
				cancel()
				if err != nil {
					break
				}
				ids = append(ids, id)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 3*ttl)
			defer cancel()
			if err := w.Load(ctx, []LoadRequest{loadReq("b", portPeer)})[0]; !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("load b into a full pipeline: %v, want a deadline", err)
			}
			if !rn.Carried("b") {
				t.Fatal("b not leased while its Submit waited")
			}
			close(f.stall)
			waitEnded(t, w, ids...)
		}},
	} {
		t.Run(tc.name, inBubble(func(t *testing.T) {
			f := newPeerFetcher(ttl)
			rn := &leasefake.Renewer{}
			var reads atomic.Int32
			sizes := StageSizes{}
			if strings.Contains(tc.name, "pipeline full") {
				sizes = tight
			}
			w, _ := admissionWorker(t, f, rn, &reads, sizes)
			tc.run(t, w, f, rn)
			waitUntil(t, "no RENEW in flight", renewsIdle(w)) // one in flight as b ended may carry it
			n := len(rn.Calls())
			time.Sleep(2 * ttl)
			for _, c := range rn.Calls()[n:] {
				if slices.Contains(c.IDs, "b") {
					t.Fatalf("b renewed after it ended: %+v", c)
				}
			}
			leased, pending, pendingOf := w.rn.Tracked()
			if leased != 0 || pending != 0 || pendingOf != 0 {
				t.Fatalf("after every request ended: %d leased, %d fetches pending (%d requests)", leased, pending, pendingOf)
			}
		}))
	}
}

// handshakeConfig bounds a job's whole handshake (one attempt) by timeout.
func handshakeConfig(timeout time.Duration) handshake.Config {
	c := handshake.DefaultConfig()
	c.Timeout, c.Attempts, c.RetryBackoff = conf.Duration(timeout), 1, 0
	return c
}
