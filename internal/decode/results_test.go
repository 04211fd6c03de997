package decode

import (
	"sync/atomic"
	"testing"
	"testing/synctest"

	"github.com/kvflow/kvflow/internal/tooling/testkit/fakes/leasefake"
)

// TestFinishedBound: results not polled beyond MaxFinished are dropped,
// oldest done ones first, and counted; the rest are still reported.
func TestFinishedBound(t *testing.T) {
	// On synctest's clock: no wall-clock deadline decides it.
	synctest.Test(t, testFinishedBound)
}

func testFinishedBound(t *testing.T) {
	var reads atomic.Int32
	w, _ := admissionWorker(t, newPeerFetcher(0), &leasefake.Renewer{}, &reads, StageSizes{}, func(o *Options) { o.MaxFinished = 2 })
	ids := []string{"a", "b", "c", "d", "e"}
	for _, id := range ids {
		mustLoad(t, w, loadReq(id, portPeer))
	}
	waitUntil(t, "every request ended", func() bool { return w.Status().InFlight == 0 })
	done, failed := w.Finished()
	if len(done)+len(failed) != 2 {
		t.Fatalf("kept %v %+v, want 2 results", done, failed)
	}
	if got := w.Status().DroppedResults; got != 3 {
		t.Fatalf("dropped %d, want 3", got)
	}
}
