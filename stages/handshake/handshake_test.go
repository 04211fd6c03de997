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

// TestFailureRemembered: a failed fetch (transport error or bad metadata)
// is answered from memory for FailureTTL, with the original error, and
// fetched again after it; a success clears it; a negative TTL turns it off.
func TestFailureRemembered(t *testing.T) {
	errDown := errors.New("connection refused")
	cases := []struct {
		name    string
		ttl     time.Duration
		fetch   func() (job.Meta, error)
		wantErr error
		// calls after: a first Get, a second within the TTL, a third after it
		calls [3]int32
	}{
		{"transport error", time.Second, func() (job.Meta, error) { return job.Meta{}, errDown }, errDown, [3]int32{1, 1, 2}},
		{"bad metadata", time.Second, func() (job.Meta, error) { return meta("other"), nil }, ErrEngineMismatch, [3]int32{1, 1, 2}},
		{"off", -1, func() (job.Meta, error) { return job.Meta{}, errDown }, errDown, [3]int32{1, 2, 3}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var calls atomic.Int32
			now := time.Unix(1000, 0)
			f := FetcherFunc(func(ctx context.Context, ep string) (job.Meta, error) {
				calls.Add(1)
				return tc.fetch()
			})
			c, err := NewCache(f, Options{FailureTTL: tc.ttl, Now: func() time.Time { return now }, Registerer: prometheus.NewRegistry()})
			if err != nil {
				t.Fatal(err)
			}
			k := Key{"P", "dead:1"}
			for i, advance := range []time.Duration{0, 999 * time.Millisecond, time.Millisecond} {
				now = now.Add(advance)
				_, err := c.Get(context.Background(), k)
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("get %d: %v, want %v", i, err, tc.wantErr)
				}
				if remembered := errors.Is(err, ErrRecentFailure); remembered != (tc.calls[i] == tc.calls[max(i-1, 0)] && i > 0) {
					t.Fatalf("get %d: %v: remembered %v", i, err, remembered)
				}
				if got := calls.Load(); got != tc.calls[i] {
					t.Fatalf("get %d: %d fetches, want %d", i, got, tc.calls[i])
				}
			}
		})
	}
	t.Run("success clears", func(t *testing.T) {
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
		c.Get(context.Background(), k)
		fail.Store(false)
		now = now.Add(2 * time.Second)
		if _, err := c.Get(context.Background(), k); err != nil {
			t.Fatalf("after the ttl: %v", err)
		}
		c.Invalidate(k)
		if _, err := c.Get(context.Background(), k); err != nil {
			t.Fatalf("re-fetch after invalidation found the old failure: %v", err)
		}
	})
}

// TestDeadPeerFailsFast: jobs queued for a peer whose fetch fails each
// cost no fetch of their own while the failure is remembered, so two
// stage workers are not held a fetch timeout per job.
func TestDeadPeerFailsFast(t *testing.T) {
	var dead, live atomic.Int32
	f := FetcherFunc(func(ctx context.Context, ep string) (job.Meta, error) {
		if ep == "dead:1" {
			dead.Add(1)
			time.Sleep(20 * time.Millisecond) // a fetch that times out
			return job.Meta{}, errors.New("timeout")
		}
		live.Add(1)
		return meta("P"), nil
	})
	c, _ := NewCache(f, Options{FailureTTL: time.Hour})
	var wg sync.WaitGroup
	work := make(chan Key)
	var failed atomic.Int32
	for range 2 { // the stage's workers
		wg.Go(func() {
			for k := range work {
				if _, err := c.Get(context.Background(), k); err != nil {
					failed.Add(1)
				}
			}
		})
	}
	for i := range 40 {
		k := Key{"P", "dead:1"}
		if i%4 == 3 {
			k.Endpoint = "live:1"
		}
		work <- k
	}
	close(work)
	wg.Wait()
	if dead.Load() > 2 || failed.Load() != 30 || live.Load() != 1 {
		t.Fatalf("dead fetches %d (want ≤ 2: one, or two racing), failed %d (want 30), live fetches %d", dead.Load(), failed.Load(), live.Load())
	}
}
