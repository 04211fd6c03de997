package decode

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

type renewCall struct {
	at       time.Time
	endpoint string
	ids      []string
}

type fakeRenewer struct {
	mu    sync.Mutex
	calls []renewCall
	block map[string]bool // endpoints whose calls wait for ctx
}

func (f *fakeRenewer) Renew(ctx context.Context, endpoint string, ids []string) error {
	f.mu.Lock()
	f.calls = append(f.calls, renewCall{time.Now(), endpoint, slices.Clone(ids)})
	block := f.block[endpoint]
	f.mu.Unlock()
	if block {
		<-ctx.Done()
		return ctx.Err()
	}
	return nil
}

func (f *fakeRenewer) snapshot() []renewCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

func (f *fakeRenewer) to(endpoint string) []renewCall {
	var out []renewCall
	for _, c := range f.snapshot() {
		if c.endpoint == endpoint {
			out = append(out, c)
		}
	}
	return out
}

// leaseJob is a job whose task i goes to 127.0.0.1:ports[i], advertising ttls[i].
func leaseJob(id string, ports []int, ttls []time.Duration) *job.Job {
	j := job.New(plan.Request{ID: id}, time.Now())
	j.Plan = plan.Plan{RequestID: id, RemoteHost: "127.0.0.1"}
	for i, p := range ports {
		j.Plan.Tasks = append(j.Plan.Tasks, plan.Task{HandshakePort: p})
		j.Metas = append(j.Metas, job.Meta{LeaseTTL: ttls[i]})
	}
	return j
}

// TestRenewer runs on synctest's clock: every gap it checks is the
// renewer's own schedule, not the machine's load.
func TestRenewer(t *testing.T) {
	synctest.Test(t, testRenewer)
}

func testRenewer(t *testing.T) {
	const ttl = 150 * time.Millisecond
	f := &fakeRenewer{block: map[string]bool{"127.0.0.1:3": true}}
	rn, err := newRenewer(f, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	// a: two tasks on port 1 (one lease there), one on port 2 without leases.
	rn.add(leaseJob("a", []int{1, 1, 2}, []time.Duration{ttl, ttl, 0}))
	rn.add(leaseJob("b", []int{1}, []time.Duration{ttl}))
	rn.add(leaseJob("seed", []int{2}, []time.Duration{0})) // a seed peer: never renewed
	rn.add(leaseJob("dead", []int{3}, []time.Duration{ttl}))
	if rn.len() != 3 {
		t.Fatalf("leased %d, want 3", rn.len())
	}
	time.Sleep(ttl)
	first := f.to("127.0.0.1:1")
	if len(first) == 0 || first[0].at.Sub(start) > 50*time.Millisecond {
		t.Fatalf("first renewal not prompt: %+v", first)
	}
	if !slices.Equal(first[0].ids, []string{"a", "b"}) {
		t.Fatalf("first batch %v, want [a b] in one message", first[0].ids)
	}
	if len(f.to("127.0.0.1:2")) != 0 {
		t.Fatal("RENEW sent to a peer that did not advertise leases")
	}
	time.Sleep(2 * ttl)
	calls := f.to("127.0.0.1:1")
	// About every ttl/3 (50 ms) over 450 ms: at least 5, at most ~10.
	if len(calls) < 5 || len(calls) > 12 {
		t.Fatalf("%d renewals of port 1 in %v (ttl %v)", len(calls), time.Since(start), ttl)
	}
	for i := 1; i < len(calls); i++ {
		if gap := calls[i].at.Sub(calls[i-1].at); gap > ttl/2 {
			t.Fatalf("renewal gap %v > ttl/2", gap)
		}
	}
	// The dead peer's calls (each blocked until its timeout) never overlap.
	if n := len(f.to("127.0.0.1:3")); n == 0 || n > 5 {
		t.Fatalf("%d calls to the blocked peer", n)
	}
	rn.remove("a")
	rn.remove("b")
	n := len(f.to("127.0.0.1:1"))
	time.Sleep(ttl)
	if got := len(f.to("127.0.0.1:1")); got > n+1 {
		t.Fatalf("renewals went on after remove: %d -> %d", n, got)
	}
	rn.add(leaseJob("c", []int{1}, []time.Duration{ttl}))
	time.Sleep(20 * time.Millisecond)
	if last := f.to("127.0.0.1:1"); !slices.Equal(last[len(last)-1].ids, []string{"c"}) {
		t.Fatalf("after remove and add: %v", last[len(last)-1].ids)
	}
	done := make(chan struct{})
	go func() { rn.close(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		t.Fatal("close hangs on a blocked call")
	}
	n = len(f.snapshot())
	rn.add(leaseJob("late", []int{1}, []time.Duration{ttl}))
	time.Sleep(ttl)
	if len(f.snapshot()) != n {
		t.Fatalf("renewed after close")
	}
	rn.close() // idempotent
	// synctest.Test fails if a goroutine of the renewer outlives close.
}

// TestWorkerLeases: the worker renews between handshake and the end of a
// request, and stops when it is closed.
func TestWorkerLeases(t *testing.T) {
	// On synctest's clock: the renewals counted while the read is stuck
	// follow the renewer's schedule, not the machine's load.
	synctest.Test(t, testWorkerLeases)
}

func testWorkerLeases(t *testing.T) {
	f := &fakeRenewer{}
	release := make(chan struct{})
	w, err := New(Options{
		Topology: plan.Topology{
			Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1, KVPort: 5000},
			Decode:  plan.Parallel{TP: 1, PP: 1, DP: 1, KVPort: 6000},
			Model:   plan.Model{NumLayers: 1, NumKVHeads: 1, MLA: true},
		},
		Fetcher: fetcherFunc(func(context.Context, string) (job.Meta, error) {
			return job.Meta{EngineID: "P", TERPCPort: 1, BaseAddrs: []uint64{1 << 20, 1<<20 + 4096}, NumBlocks: 8, LeaseTTL: 90 * time.Millisecond}, nil
		}),
		Transfer: transferFunc(func(ctx context.Context, _ string, _ []plan.Op) error {
			select {
			case <-release:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}),
		Sender:     senderFunc(func(context.Context, string, string) error { return nil }),
		Renewer:    f,
		Layout:     plan.CacheLayout{BlockLen: []uint64{64, 64}, CachesPerLayer: 2},
		Local:      plan.Caches{Base: []uint64{1 << 30, 1<<30 + 4096}, NumBlocks: 8},
		Registerer: prometheus.NewRegistry(),
	})
	if err != nil {
		t.Fatalf("worker setup: %v", err)
	}
	errs := w.Load(context.Background(), []LoadRequest{{RequestID: "r", LocalBlockIDs: []int{1},
		Params: KVTransferParams{RemoteBlockIDs: []int{2}, RemoteEngineID: "P", RemoteHost: "127.0.0.1", RemotePort: 5000}}})
	if errs[0] != nil {
		t.Fatal(errs[0])
	}
	time.Sleep(200 * time.Millisecond)
	if n := len(f.snapshot()); n < 2 {
		t.Fatalf("%d renewals while the read is stuck", n)
	}
	close(release)
	deadline := time.Now().Add(2 * time.Second)
	for w.Status().InFlight > 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	done, failed := w.Finished()
	if len(done)+len(failed) != 1 {
		t.Fatalf("done %v failed %v", done, failed)
	}
	n := len(f.snapshot())
	time.Sleep(100 * time.Millisecond)
	if got := len(f.snapshot()); got > n+1 {
		t.Fatalf("renewals after the request ended: %d -> %d", n, got)
	}
	if err := w.Close(context.Background()); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
	// synctest.Test fails if a goroutine of the worker outlives Close.
}

type fetcherFunc func(context.Context, string) (job.Meta, error)

func (f fetcherFunc) GetMeta(ctx context.Context, ep string) (job.Meta, error) { return f(ctx, ep) }

type transferFunc func(context.Context, string, []plan.Op) error

func (f transferFunc) BatchRead(ctx context.Context, s string, b *read.Batch) error {
	return f(ctx, s, b.AppendTo(nil))
}

func (transferFunc) Capabilities() read.Capabilities { return read.Capabilities{} }

type senderFunc func(context.Context, string, string) error

func (f senderFunc) SendDone(ctx context.Context, ep, id string) error { return f(ctx, ep, id) }
