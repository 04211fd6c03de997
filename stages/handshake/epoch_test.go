package handshake

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

// TestRequestBootEpoch: the boot epochs a request's kv_transfer_params
// name (kvflow_boot_epochs) are compared with each rank's metadata before
// any read: the same epoch, no epoch on either side (a seed prefill, a
// rank its scheduler did not know) or metadata cached before a restart
// that the request postdates pass; another epoch fails the job naming the
// rank and both epochs, and the rank is owed no DONE.
func TestRequestBootEpoch(t *testing.T) {
	const port = 30000
	cases := []struct {
		name    string
		epochs  []uint64 // the request's kvflow_boot_epochs
		rank    int      // the task's remote rank
		cached  uint64   // epoch of metadata cached before the admission; 0: none
		peer    uint64   // the peer's epoch now
		fetches int32
		err     error // nil: the job passes
		msg     string
		owed    bool // notify sends the rank its DONE
	}{
		{name: "same epoch", epochs: []uint64{5}, peer: 5, fetches: 1, owed: true},
		{name: "different epoch", epochs: []uint64{5}, peer: 6, fetches: 1, err: job.ErrBootEpoch,
			msg: "prefill 127.0.0.1:30000 restarted (boot epoch 6, request from epoch 5): its blocks are gone"},
		{name: "missing field", epochs: nil, peer: 6, fetches: 1, owed: true},
		{name: "rank's epoch unknown", epochs: []uint64{0, 5}, peer: 6, fetches: 1, owed: true},
		{name: "peer sends no epoch", epochs: []uint64{5}, peer: 0, fetches: 1, owed: true},
		{name: "second rank", epochs: []uint64{6, 5}, rank: 1, peer: 6, fetches: 1, err: job.ErrBootEpoch,
			msg: "prefill 127.0.0.1:30001 restarted (boot epoch 6, request from epoch 5)"},
		{name: "stale cache, request from the new process", epochs: []uint64{6}, cached: 5, peer: 6, fetches: 2, owed: true},
		{name: "cache of the new process, request from the old", epochs: []uint64{5}, cached: 6, peer: 6, fetches: 2, err: job.ErrBootEpoch,
			msg: "(boot epoch 6, request from epoch 5)"},
		{name: "list too short", epochs: []uint64{5}, rank: 1, peer: 5, fetches: 1, err: job.ErrBootEpochsShort,
			msg: "1 entries, prefill rank 1 (port 30001) is read"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var now atomic.Int64 // the cache's clock, in seconds
			clock := func() time.Time { return time.Unix(1000+now.Load(), 0) }
			var epoch atomic.Uint64
			var fetches atomic.Int32
			f := FetcherFunc(func(ctx context.Context, ep string) (job.Meta, error) {
				fetches.Add(1)
				m := meta("P")
				m.BootEpoch = epoch.Load()
				return m, nil
			})
			c, err := NewCache(f, Options{Now: clock})
			if err != nil {
				t.Fatal(err)
			}
			ep := "127.0.0.1:" + itoa(port+tc.rank)
			if tc.cached != 0 {
				epoch.Store(tc.cached)
				if _, err := c.Get(context.Background(), Key{"P", ep}); err != nil {
					t.Fatal(err)
				}
			}
			epoch.Store(tc.peer)
			now.Add(1) // the request is admitted after the cached fetch
			j := job.New(plan.Request{ID: "r", RemoteHost: "127.0.0.1", RemotePort: port, RemoteEngineID: "P", BootEpochs: tc.epochs}, clock())
			j.Plan = plan.Plan{RemoteEngineID: "P", RemoteHost: "127.0.0.1",
				Tasks: []plan.Task{{RemoteRank: tc.rank, HandshakePort: port + tc.rank}}}
			j.Metas = make([]job.Meta, 1)
			now.Add(1)
			err = Stage{Cache: c}.Process(context.Background(), j)
			if tc.err == nil && err != nil {
				t.Fatalf("failed: %v", err)
			}
			if tc.err != nil && !errors.Is(err, tc.err) {
				t.Fatalf("error %v, want %v", err, tc.err)
			}
			if err != nil && !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("error %q does not say %q", err, tc.msg)
			}
			if n := fetches.Load(); n != tc.fetches {
				t.Errorf("%d fetches, want %d", n, tc.fetches)
			}
			if tc.err == nil || errors.Is(tc.err, job.ErrBootEpoch) {
				if got := j.Metas[0].BootEpoch; got != tc.peer {
					t.Errorf("job holds metadata of epoch %d, want the peer's %d", got, tc.peer)
				}
				if got := j.OwesDone(0); got != tc.owed {
					t.Errorf("owes the rank its DONE: %v, want %v", got, tc.owed)
				}
			}
		})
	}
}
