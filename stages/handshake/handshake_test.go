package handshake

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

func meta(engine string) job.Meta {
	return job.Meta{EngineID: engine, TERPCPort: 17000, BaseAddrs: []uint64{1}, NumBlocks: 8}
}

func TestSingleflightAndCache(t *testing.T) {
	var calls atomic.Int32
	gate := make(chan struct{})
	f := FetcherFunc(func(ctx context.Context, ep string) (job.Meta, error) {
		calls.Add(1)
		<-gate
		return meta("P"), nil
	})
	reg := prometheus.NewRegistry()
	c, err := NewCache(f, Options{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	k := Key{EngineID: "P", Endpoint: "127.0.0.1:1"}
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			if _, err := c.Get(context.Background(), k); err != nil {
				t.Error(err)
			}
		})
	}
	time.Sleep(20 * time.Millisecond)
	close(gate)
	wg.Wait()
	if n := calls.Load(); n != 1 {
		t.Fatalf("16 concurrent misses made %d fetches, want 1", n)
	}
	if _, err := c.Get(context.Background(), k); err != nil {
		t.Fatal(err)
	}
	if calls.Load() != 1 {
		t.Fatal("a hit fetched again")
	}
	if !c.Invalidate(k) || c.Len() != 0 {
		t.Fatal("invalidate did not drop the entry")
	}
	c.Get(context.Background(), k)
	if calls.Load() != 2 {
		t.Fatal("no re-fetch after invalidation")
	}
	if got := testutil.ToFloat64(c.misses); got < 2 {
		t.Errorf("misses %v", got)
	}
}

// A silent peer does not delay requests to others.
func TestSlowPeerIsolated(t *testing.T) {
	block := make(chan struct{})
	defer close(block)
	f := FetcherFunc(func(ctx context.Context, ep string) (job.Meta, error) {
		if ep == "slow:1" {
			select {
			case <-block:
			case <-ctx.Done():
				return job.Meta{}, ctx.Err()
			}
		}
		return meta("P"), nil
	})
	c, _ := NewCache(f, Options{Timeout: 10 * time.Second})
	go c.Get(context.Background(), Key{"P", "slow:1"})
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if _, err := c.Get(ctx, Key{"P", "fast:1"}); err != nil {
		t.Fatalf("fast peer blocked by slow one: %v", err)
	}
	// The caller's context bounds its own wait.
	ctx2, cancel2 := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel2()
	if _, err := c.Get(ctx2, Key{"P", "slow:1"}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("slow peer: %v", err)
	}
}

func TestBoundedAndChecks(t *testing.T) {
	bad := map[string]job.Meta{
		"local:1":  meta("D"),
		"other:1":  meta("Q"),
		"port:1":   {EngineID: "P", TERPCPort: 0, BaseAddrs: []uint64{1}, NumBlocks: 1},
		"addrs:1":  {EngineID: "P", TERPCPort: 1, NumBlocks: 1},
		"blocks:1": {EngineID: "P", TERPCPort: 1, BaseAddrs: []uint64{1}},
	}
	f := FetcherFunc(func(ctx context.Context, ep string) (job.Meta, error) {
		if m, ok := bad[ep]; ok {
			return m, nil
		}
		if ep == "err:1" {
			return job.Meta{}, errors.New("refused")
		}
		return meta("P"), nil
	})
	c, _ := NewCache(f, Options{Size: 3, LocalEngineID: "D"})
	for ep := range bad {
		if _, err := c.Get(context.Background(), Key{"P", ep}); err == nil {
			t.Errorf("%s: bad metadata accepted", ep)
		}
	}
	if _, err := c.Get(context.Background(), Key{"P", "err:1"}); err == nil {
		t.Error("fetch error swallowed")
	}
	for i := range 10 {
		c.Get(context.Background(), Key{"P", fmt.Sprintf("h%d:1", i)})
	}
	if c.Len() != 3 {
		t.Fatalf("cache holds %d, bound 3", c.Len())
	}
}

// A re-fetch after invalidation that brings a new boot epoch counts a
// peer restart.
func TestBootEpochRestart(t *testing.T) {
	var epoch atomic.Uint64
	epoch.Store(1)
	f := FetcherFunc(func(ctx context.Context, ep string) (job.Meta, error) {
		m := meta("P")
		m.BootEpoch = epoch.Load()
		return m, nil
	})
	c, _ := NewCache(f, Options{})
	k := Key{"P", "h:1"}
	c.Get(context.Background(), k)
	c.Invalidate(k)
	c.Get(context.Background(), k) // same epoch: no restart
	if got := testutil.ToFloat64(c.restarts); got != 0 {
		t.Fatalf("restarts %v after a same-epoch re-fetch", got)
	}
	epoch.Store(2)
	c.Invalidate(k)
	m, _ := c.Get(context.Background(), k)
	if m.BootEpoch != 2 || testutil.ToFloat64(c.restarts) != 1 {
		t.Fatalf("epoch %d restarts %v", m.BootEpoch, testutil.ToFloat64(c.restarts))
	}
}

// TestFailedWhileWaiting: a request admitted before its peer's fetch
// failed gets that failure without a fetch of its own (transport error or
// bad metadata alike); one admitted after it fetches again; a success
// forgets the failure.
func TestFailedWhileWaiting(t *testing.T) {
	errDown := errors.New("connection refused")
	cases := []struct {
		name    string
		fetch   func() (job.Meta, error)
		wantErr error
	}{
		{"transport error", func() (job.Meta, error) { return job.Meta{}, errDown }, errDown},
		{"bad metadata", func() (job.Meta, error) { return meta("other"), nil }, ErrEngineMismatch},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var calls atomic.Int32
			now := time.Unix(1000, 0)
			f := FetcherFunc(func(ctx context.Context, ep string) (job.Meta, error) {
				calls.Add(1)
				return tc.fetch()
			})
			c, err := NewCache(f, Options{Now: func() time.Time { return now }, Registerer: prometheus.NewRegistry()})
			if err != nil {
				t.Fatal(err)
			}
			k := Key{"P", "dead:1"}
			steps := []struct {
				admitted time.Time
				waiting  bool  // gets the remembered failure
				calls    int32 // fetches so far
			}{
				{now.Add(-time.Second), false, 1}, // the fetch that fails (at now)
				{now.Add(-time.Millisecond), true, 1},
				{now, false, 2}, // admitted at the failure: not before it
				{now.Add(time.Second), false, 3},
			}
			for i, st := range steps {
				_, err := c.GetSince(context.Background(), k, st.admitted)
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("get %d: %v, want %v", i, err, tc.wantErr)
				}
				if got := errors.Is(err, ErrFailedWhileWaiting); got != st.waiting {
					t.Fatalf("get %d: %v: failed while waiting %v, want %v", i, err, got, st.waiting)
				}
				if got := calls.Load(); got != st.calls {
					t.Fatalf("get %d: %d fetches, want %d", i, got, st.calls)
				}
			}
			if got := testutil.ToFloat64(c.recentFail); got != 1 {
				t.Fatalf("failed_while_waiting lookups %v, want 1", got)
			}
		})
	}
	t.Run("success forgets", func(t *testing.T) {
		var fail atomic.Bool
		fail.Store(true)
		f := FetcherFunc(func(ctx context.Context, ep string) (job.Meta, error) {
			if fail.Load() {
				return job.Meta{}, errDown
			}
			return meta("P"), nil
		})
		now := time.Unix(1000, 0)
		c, _ := NewCache(f, Options{Now: func() time.Time { return now }})
		k := Key{"P", "flaky:1"}
		admitted := now.Add(-time.Second)
		c.GetSince(context.Background(), k, admitted)
		fail.Store(false)
		now = now.Add(time.Second)
		if _, err := c.Get(context.Background(), k); err != nil {
			t.Fatalf("after the failure: %v", err)
		}
		c.Invalidate(k)
		if _, err := c.GetSince(context.Background(), k, admitted); err != nil {
			t.Fatalf("re-fetch after invalidation found the old failure: %v", err)
		}
	})
}

// TestDeadPeerQueueFailsFast: through the stage, jobs queued for a peer
// whose fetch fails share that fetch's failure, so two stage workers are
// not held a fetch timeout per job and the live peer's jobs pass.
func TestDeadPeerQueueFailsFast(t *testing.T) {
	var dead, live atomic.Int32
	f := FetcherFunc(func(ctx context.Context, ep string) (job.Meta, error) {
		if ep == "127.0.0.1:9" {
			dead.Add(1)
			time.Sleep(20 * time.Millisecond) // a fetch that times out
			return job.Meta{}, errors.New("timeout")
		}
		live.Add(1)
		return meta("P"), nil
	})
	c, _ := NewCache(f, Options{})
	st := Stage{Cache: c}
	var jobs []*job.Job
	for i := range 40 { // all admitted before the first fetch fails
		port := 9
		if i%4 == 3 {
			port = 10
		}
		j := job.New(plan.Request{ID: fmt.Sprint(i), RemoteEngineID: "P", RemoteHost: "127.0.0.1", RemotePort: port}, time.Now())
		j.Plan = plan.Plan{RemoteEngineID: "P", RemoteHost: "127.0.0.1", Tasks: []plan.Task{{HandshakePort: port}}}
		j.Metas = make([]job.Meta, 1)
		jobs = append(jobs, j)
	}
	work := make(chan *job.Job)
	var failed atomic.Int32
	var wg sync.WaitGroup
	for range 2 { // the stage's workers
		wg.Go(func() {
			for j := range work {
				if err := st.Process(context.Background(), j); err != nil {
					failed.Add(1)
				}
			}
		})
	}
	for _, j := range jobs {
		work <- j
	}
	close(work)
	wg.Wait()
	// Two fetches of a peer can race (a lookup that missed just before the
	// other's fetch stored or failed); never one per job.
	if dead.Load() > 2 || failed.Load() != 30 || live.Load() > 2 {
		t.Fatalf("dead fetches %d (want ≤ 2), failed %d (want 30), live fetches %d (want ≤ 2)", dead.Load(), failed.Load(), live.Load())
	}
}
