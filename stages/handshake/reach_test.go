package handshake

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvflow/kvflow/stages/job"
)

// reachFetcher is a Fetcher with the Reacher capability.
type reachFetcher struct {
	get           func(ctx context.Context) (job.Meta, error)
	reach         func(ctx context.Context) error
	gets, reaches atomic.Int32
}

func (f *reachFetcher) GetMeta(ctx context.Context, ep string) (job.Meta, error) {
	f.gets.Add(1)
	return f.get(ctx)
}

func (f *reachFetcher) Reach(ctx context.Context, ep string) error {
	f.reaches.Add(1)
	return f.reach(ctx)
}

// attempts is a side channel's GET_META: n attempts of per each, the
// answer (if any) after answerAfter.
func attempts(n int, per, answerAfter time.Duration) func(ctx context.Context) (job.Meta, error) {
	return func(ctx context.Context) (job.Meta, error) {
		deadline := time.Duration(n) * per
		wait := deadline
		if answerAfter > 0 && answerAfter < deadline {
			wait = answerAfter
		}
		select {
		case <-ctx.Done():
			return job.Meta{}, context.Cause(ctx)
		case <-time.After(wait):
		}
		if wait == answerAfter {
			return meta("P"), nil
		}
		return job.Meta{}, fmt.Errorf("get_meta: no reply after %d attempts of %v", n, per)
	}
}

// TestReachRefusedFailsAtOnce: with a Reacher, a fetch from a port that
// refuses connections fails at once (no attempt's timeout waited) with
// job.ErrRefused, for every request waiting on it (one fetch, one reach);
// a port that accepts keeps every attempt: a slow but alive peer still
// answers, a silent one fails after all of them. Synthetic time
// (testing/synctest): the durations are exact, not measured.
func TestReachRefusedFailsAtOnce(t *testing.T) {
	// A refusal takes a round trip (1 ms); meanwhile every waiter joins
	// the fetch.
	const rtt = time.Millisecond
	refused := func(context.Context) error {
		time.Sleep(rtt)
		return fmt.Errorf("dial: %w: %w", job.ErrRefused, syscall.ECONNREFUSED)
	}
	connected := func(context.Context) error { return nil }
	unreachable := func(context.Context) error { return syscall.EHOSTUNREACH }
	hangs := func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() }
	for _, tc := range []struct {
		name    string
		get     func(ctx context.Context) (job.Meta, error)
		reach   func(ctx context.Context) error
		waiters int
		wantErr error // nil: the metadata
		wantAt  time.Duration
	}{
		{"refused", attempts(3, time.Second, 0), refused, 1, job.ErrRefused, rtt},
		{"refused, shared by 8", attempts(3, time.Second, 0), refused, 8, job.ErrRefused, rtt},
		{"accepts, silent", attempts(3, time.Second, 0), connected, 1, errAny, 3 * time.Second},
		{"accepts, slow but alive", attempts(3, time.Second, 2500*time.Millisecond), connected, 1, nil, 2500 * time.Millisecond},
		{"unreachable network retries", attempts(3, time.Second, 0), unreachable, 1, errAny, 3 * time.Second},
		{"dial hangs, peer answers", attempts(3, time.Second, 100*time.Millisecond), hangs, 1, nil, 100 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := &reachFetcher{get: tc.get, reach: tc.reach}
				c, err := NewCache(f, Options{Timeout: 5 * time.Second})
				if err != nil {
					t.Fatal(err)
				}
				k := Key{EngineID: "P", Endpoint: "127.0.0.1:1"}
				start := time.Now()
				errs := make([]error, tc.waiters)
				ats := make([]time.Duration, tc.waiters)
				var wg sync.WaitGroup
				for i := range tc.waiters {
					wg.Go(func() {
						_, errs[i] = c.GetSince(context.Background(), k, start)
						ats[i] = time.Since(start)
					})
				}
				wg.Wait()
				for i, err := range errs {
					switch {
					case tc.wantErr == nil && err != nil:
						t.Errorf("waiter %d: %v", i, err)
					case tc.wantErr == errAny && (err == nil || errors.Is(err, job.ErrRefused)):
						t.Errorf("waiter %d: %v, want a failure that is not a refusal", i, err)
					case tc.wantErr != nil && tc.wantErr != errAny && !errors.Is(err, tc.wantErr):
						t.Errorf("waiter %d: %v, want %v", i, err, tc.wantErr)
					}
					if ats[i] != tc.wantAt {
						t.Errorf("waiter %d ended at %v (synthetic), want %v", i, ats[i], tc.wantAt)
					}
				}
				if g, r := f.gets.Load(), f.reaches.Load(); g != 1 || r != 1 {
					t.Errorf("%d fetches and %d reaches, want one each", g, r)
				}
			})
		})
	}
}

// errAny stands for any error in TestReachRefusedFailsAtOnce's table.
var errAny = errors.New("any error")

// TestFetchTimeoutIsNoReply: a fetch cut by the cache's own bound (its
// attempts' timeouts) failed for want of a reply: job.ErrNoReply, which
// the notify stage reads; a fetch that failed otherwise is not marked.
func TestFetchTimeoutIsNoReply(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		for _, tc := range []struct {
			name string
			get  FetcherFunc
			want bool
		}{
			{"cut by the bound", func(ctx context.Context, _ string) (job.Meta, error) { <-ctx.Done(); return job.Meta{}, ctx.Err() }, true},
			{"bad reply", func(context.Context, string) (job.Meta, error) { return job.Meta{}, errors.New("bad reply") }, false},
		} {
			c, err := NewCache(tc.get, Options{Timeout: 3 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			_, err = c.Get(context.Background(), Key{EngineID: "P", Endpoint: "127.0.0.1:1"})
			if err == nil || errors.Is(err, job.ErrNoReply) != tc.want {
				t.Errorf("%s: %v, ErrNoReply %v, want %v", tc.name, err, errors.Is(err, job.ErrNoReply), tc.want)
			}
		}
	})
}
