package decode

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/internal/tooling/testkit/fakes/leasefake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// TestWorkerLeases: the worker renews between handshake and the end of a
// request, and stops when it is closed.
func TestWorkerLeases(t *testing.T) {
	// On synctest's clock: the renewals counted while the read is stuck
	// follow the renewer's schedule, not the machine's load.
	synctest.Test(t, testWorkerLeases)
}

func testWorkerLeases(t *testing.T) {
	f := &leasefake.Renewer{}
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
	if n := len(f.Calls()); n < 2 {
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
	n := len(f.Calls())
	time.Sleep(100 * time.Millisecond)
	if got := len(f.Calls()); got > n+1 {
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
