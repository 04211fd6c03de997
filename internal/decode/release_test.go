package decode

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/internal/tooling/testkit/fakes/leasefake"
)

// TestCloseReleasesCanceled: requests Close cancels before their notify
// stage (queued before planning, queued for or in the handshake) get
// their DONEs sent at shutdown, to every rank they read; a request whose
// own DONE was under way and one already done get no second one.
func TestCloseReleasesCanceled(t *testing.T) {
	// On synctest's clock: no wall-clock deadline decides it.
	synctest.Test(t, testCloseReleasesCanceled)
}

func testCloseReleasesCanceled(t *testing.T) {
	var mu sync.Mutex
	sent := map[string][]string{} // request id → endpoints, every SendDone
	blockN := make(chan struct{})
	sender := senderFunc(func(ctx context.Context, endpoint, id string) error {
		mu.Lock()
		sent[id] = append(sent[id], endpoint)
		mu.Unlock()
		if id == "n" { // its DONE hangs: n is in notify when Close cancels
			select {
			case <-blockN:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	})
	f := newPeerFetcher(0)
	var reads atomic.Int32
	w, reg := admissionWorker(t, f, &leasefake.Renewer{}, &reads, StageSizes{}, func(o *Options) { o.Sender = sender })
	warm(t, w)
	mustLoad(t, w, loadReq("done", portPeer))
	waitEnded(t, w, "done")
	mustLoad(t, w, loadReq("n", portPeer))
	waitUntil(t, "n's DONE under way", func() bool { mu.Lock(); defer mu.Unlock(); return len(sent["n"]) == 1 })
	mustLoad(t, w, loadReq("stall", portStall)) // holds the single handshake worker
	<-f.stalled
	mustLoad(t, w, loadReq("a", portPeer), loadReq("b", portPeer))

	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the drain deadline has passed: cancel at once
	w.Close(ctx)
	close(f.stall)
	close(blockN)

	mu.Lock()
	defer mu.Unlock()
	want := map[string][]string{
		"done":  {ep(portPeer)},  // its own DONE, from notify
		"n":     {ep(portPeer)},  // its own only
		"stall": {ep(portStall)}, // canceled in handshake
		"a":     {ep(portPeer)},  // canceled queued for handshake
		"b":     {ep(portPeer)},
	}
	for id, eps := range want {
		if !slices.Equal(sent[id], eps) {
			t.Errorf("DONEs of %s: %v, want %v", id, sent[id], eps)
		}
	}
	if got := w.counter(t, "kvflow_decode_shutdown_dones_total", "acked"); got != 3 {
		t.Errorf("shutdown DONEs acked %v, want 3", got)
	}
	if n, err := testutil.GatherAndCount(reg, "kvflow_decode_shutdown_dones_total"); err != nil || n != 2 {
		t.Errorf("metric series %d, %v", n, err)
	}
}
