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
