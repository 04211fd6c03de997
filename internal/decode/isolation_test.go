package decode

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

// TestSlowPeerDoesNotHoldOthers: with the default stage sizes, requests
// stuck on one peer's reads (a congested or wedged link) cannot take
// every read worker, so a request to another peer still completes. Before
// the read stage had a worker for everything that can queue ahead of it,
// 150 requests to the slow peer held all 8 workers (each waiting for the
// peer) and the other peer's request waited for them.
func TestSlowPeerDoesNotHoldOthers(t *testing.T) {
	release := make(chan struct{})
	slow := "127.0.0.1:" + strconv.Itoa(portStall+1000)
	fetch := fetcherFunc(func(ctx context.Context, endpoint string) (job.Meta, error) {
		_, port, _ := strings.Cut(endpoint, ":")
		p, _ := strconv.Atoi(port)
		engine := "P"
		if p == portStall {
			engine = "S"
		}
		return job.Meta{EngineID: engine, TERPCPort: p + 1000, BaseAddrs: []uint64{1 << 20, 1<<20 + 4096}, NumBlocks: 8}, nil
	})
	o := Options{
		Topology: admissionTopology(),
		Fetcher:  fetch,
		Transfer: transferFunc(func(ctx context.Context, session string, _ []plan.Op) error {
			if session == slow {
				select {
				case <-release:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return nil
		}),
		Sender:     senderFunc(func(context.Context, string, string) error { return nil }),
		Stages:     DefaultStageSizes(),
		Layout:     plan.CacheLayout{BlockLen: []uint64{64, 64}, CachesPerLayer: 2},
		Local:      plan.Caches{Base: []uint64{1 << 30, 1<<30 + 4096}, NumBlocks: 8},
		Registerer: prometheus.NewRegistry(),
	}
	w, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		close(release)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		w.Close(ctx)
	}()
	for i := range 150 {
		mustLoad(t, w, loadReq(fmt.Sprintf("slow-%d", i), portStall))
	}
	mustLoad(t, w, loadReq("fast", portPeer))
	deadline := time.Now().Add(10 * time.Second) // a hang guard, not a timing bound
	for {
		done, failed := w.Finished()
		if len(failed) > 0 {
			t.Fatalf("failed: %+v", failed)
		}
		if len(done) > 0 {
			if done[0] != "fast" || len(done) != 1 {
				t.Fatalf("done %v, want only fast", done)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the request to the fast peer is held behind the slow peer's requests")
		}
		time.Sleep(5 * time.Millisecond)
	}
}
