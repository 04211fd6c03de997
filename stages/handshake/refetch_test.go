package handshake

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvflow/kvflow/stages/job"
)

// clock is a settable clock for the cache (Options.Now).
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) advance(d time.Duration) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
	return c.t
}

// epochFetcher answers with the current epoch, or err, once gate is
// closed, counting calls.
type epochFetcher struct {
	epoch atomic.Uint64
	err   atomic.Pointer[error]
	gate  chan struct{}
	calls atomic.Int32
	took  func() // called as a fetch ends (a fetch takes time)
}

func (f *epochFetcher) GetMeta(ctx context.Context, _ string) (job.Meta, error) {
	f.calls.Add(1)
	select {
	case <-f.gate:
	case <-ctx.Done():
		return job.Meta{}, ctx.Err()
	}
	if f.took != nil {
		f.took()
	}
	if p := f.err.Load(); p != nil {
		return job.Meta{}, *p
	}
	m := meta("P")
	m.BootEpoch = f.epoch.Load()
	m.TERPCPort = 17000 + int(m.BootEpoch)
	return m, nil
}

// Many reads that fail together on the same metadata cause one fetch, not
// one each: those that fail while it runs share it, those that fail after
// it landed take its result; only a read that fails after a fetch that
// brought the same metadata back fetches again (a newer failure).
func TestRefetchDedup(t *testing.T) {
	clk := &clock{t: time.Unix(1000, 0)}
	f := &epochFetcher{gate: make(chan struct{})}
	f.epoch.Store(1)
	close(f.gate)
	c, err := NewCache(f, Options{Now: clk.now})
	if err != nil {
		t.Fatal(err)
	}
	k := Key{EngineID: "P", Endpoint: "127.0.0.1:1"}
	used, err := c.Get(context.Background(), k)
	if err != nil {
		t.Fatal(err)
	}
	// The peer restarts; 32 reads fail on the old metadata at once.
	f.epoch.Store(2)
	f.gate = make(chan struct{})
	failedAt := clk.advance(time.Second)
	const n = 32
	var wg sync.WaitGroup
	got := make([]job.Meta, n)
	errs := make([]error, n)
	started := make(chan struct{}, n)
	for i := range n {
		wg.Go(func() {
			started <- struct{}{}
			got[i], errs[i] = c.Refetch(context.Background(), k, used, failedAt)
		})
	}
	for range n {
		<-started
	}
	close(f.gate)
	wg.Wait()
	for i := range n {
		if errs[i] != nil || got[i].BootEpoch != 2 {
			t.Fatalf("refetch %d: epoch %d, %v", i, got[i].BootEpoch, errs[i])
		}
	}
	if calls := f.calls.Load(); calls != 2 {
		t.Fatalf("%d reads failing together made %d fetches in all, want 1 (+1 first Get)", n, calls-1)
	}
	// A read that failed on the old metadata later still takes the new
	// one without a fetch.
	if m, err := c.Refetch(context.Background(), k, used, clk.advance(time.Second)); err != nil || m.BootEpoch != 2 || f.calls.Load() != 2 {
		t.Fatalf("late refetch: epoch %d, %v, %d fetches", m.BootEpoch, err, f.calls.Load())
	}
	// A read that failed on the new metadata before it was fetched: the
	// fetch is newer than the failure, no fetch.
	if m, err := c.Refetch(context.Background(), k, got[0], failedAt); err != nil || m.BootEpoch != 2 || f.calls.Load() != 2 {
		t.Fatalf("refetch older than the fetch: epoch %d, %v, %d fetches", m.BootEpoch, err, f.calls.Load())
	}
	// A read that failed on the new metadata after it was fetched: a newer
	// failure, one fetch.
	if m, err := c.Refetch(context.Background(), k, got[0], clk.advance(time.Second)); err != nil || m.BootEpoch != 2 || f.calls.Load() != 3 {
		t.Fatalf("refetch after a newer failure: epoch %d, %v, %d fetches", m.BootEpoch, err, f.calls.Load())
	}
	if c.Len() != 1 {
		t.Fatalf("cache holds %d peers", c.Len())
	}
}

// Reads that fail together on a peer that is gone share one failed fetch:
// those that failed before it failed get its failure at once
// (ErrFailedWhileWaiting), and one that fails after it tries again.
func TestRefetchSharesFailure(t *testing.T) {
	clk := &clock{t: time.Unix(1000, 0)}
	f := &epochFetcher{gate: make(chan struct{}), took: func() { clk.advance(time.Millisecond) }}
	f.epoch.Store(1)
	close(f.gate)
	c, _ := NewCache(f, Options{Now: clk.now})
	k := Key{EngineID: "P", Endpoint: "127.0.0.1:1"}
	used, err := c.Get(context.Background(), k)
	if err != nil {
		t.Fatal(err)
	}
	gone := errors.New("connection refused")
	f.err.Store(&gone)
	failedAt := clk.advance(time.Second)
	if _, err := c.Refetch(context.Background(), k, used, failedAt); !errors.Is(err, gone) {
		t.Fatalf("first refetch: %v", err)
	}
	clk.advance(time.Second)
	for range 8 { // failed as the first did, before its fetch failed
		if _, err := c.Refetch(context.Background(), k, used, failedAt); !errors.Is(err, ErrFailedWhileWaiting) || !errors.Is(err, gone) {
			t.Fatalf("refetch that failed while the fetch ran: %v", err)
		}
	}
	if calls := f.calls.Load(); calls != 2 {
		t.Fatalf("%d fetches, want 1 (+1 first Get)", calls-1)
	}
	f.err.Store(nil)
	f.epoch.Store(2)
	if m, err := c.Refetch(context.Background(), k, used, clk.advance(time.Second)); err != nil || m.BootEpoch != 2 || f.calls.Load() != 3 {
		t.Fatalf("refetch after the failure: epoch %d, %v, %d fetches", m.BootEpoch, err, f.calls.Load())
	}
}
