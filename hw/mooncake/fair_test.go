package mooncake

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"runtime"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// TestSmallBatchNotBehindLarge starts a large read (256 × 1 MiB) and,
// once it is queued on the peer, a 1-op 64 KiB read on the same session
// over real loopback sockets. Lanes serve the batch with the fewest bytes
// left first, so the small one must return while most of the large one is still outstanding;
// with FIFO lanes it would wait for all the large batch's requests queued
// before it. Only ordering and progress are checked, no timings.
func TestSmallBatchNotBehindLarge(t *testing.T) {
	const (
		nBig    = 256
		bigSize = 1 << 20
		small   = 64 << 10
	)
	srv, _ := newEngine(t, testConfig())
	cli, _ := newEngine(t, testConfig())
	remote := register(t, srv, nBig*bigSize+small, 1)
	local := register(t, cli, nBig*bigSize+small, 2)
	session := srv.SessionID()

	var big []Op
	for i := range nBig {
		big = append(big, Op{Local: AddrOf(local[i*bigSize:]), Remote: AddrOf(remote[i*bigSize:]), Length: bigSize})
	}
	bigDone := make(chan error, 1)
	go func() { bigDone <- cli.BatchRead(context.Background(), session, big) }()

	// Wait until the large batch is queued and lanes have started on it.
	var bb *batch
	waitFor(t, func() bool {
		cli.mu.Lock()
		p := cli.peers[session]
		cli.mu.Unlock()
		if p == nil {
			return false
		}
		p.q.mu.Lock()
		defer p.q.mu.Unlock()
		for _, b := range p.q.ring {
			if len(b.left) == nBig && b.issued > 0 {
				bb = b
				return true
			}
		}
		return false
	})

	off := nBig * bigSize
	if err := cli.BatchRead(context.Background(), session, []Op{{Local: AddrOf(local[off:]), Remote: AddrOf(remote[off:]), Length: small}}); err != nil {
		t.Fatalf("small batch: %v", err)
	}
	left := bb.pending.Load()
	select {
	case err := <-bigDone:
		t.Fatalf("large batch returned (%v) before the small one", err)
	default:
	}
	if left <= nBig/2 {
		t.Errorf("small batch returned with only %d of %d large requests outstanding: it waited behind the large batch", left, nBig)
	}
	if !bytes.Equal(local[off:off+small], remote[off:off+small]) {
		t.Error("small batch: data mismatch")
	}
	if err := <-bigDone; err != nil {
		t.Fatalf("large batch: %v", err)
	}
	if !bytes.Equal(local[:off], remote[:off]) {
		t.Error("large batch: data mismatch")
	}
	t.Logf("small batch returned with %d of %d large requests outstanding", left, nBig)
}

// TestQueueDepthAdmission runs concurrent batches through one lane with
// QueueDepth 1 (each submitter waits for the queue to drain before it
// queues its requests) and cancels one while it waits or is queued: the
// others complete with the right bytes, the cancelled one reports its
// context error, and no goroutine is left behind.
func TestQueueDepthAdmission(t *testing.T) {
	base := runtime.NumGoroutine()
	func() {
		ccfg := testConfig()
		ccfg.Lanes, ccfg.QueueDepth = 1, 1
		srv, err := NewTCPEngine(testConfig(), prometheus.NewRegistry(), slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		defer srv.Close()
		cli, err := NewTCPEngine(ccfg, prometheus.NewRegistry(), slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		defer cli.Close()
		const nb, nops, size = 8, 16, 64 << 10
		remote := register(t, srv, nb*nops*size, 3)
		local := register(t, cli, nb*nops*size, 4)
		ctx, cancel := context.WithCancel(context.Background())
		errs := make([]error, nb)
		var wg sync.WaitGroup
		for k := range nb {
			var ops []Op
			for i := range nops {
				o := (k*nops + i) * size
				ops = append(ops, Op{Local: AddrOf(local[o:]), Remote: AddrOf(remote[o:]), Length: size})
			}
			bctx := context.Background()
			if k == nb-1 {
				bctx = ctx
			}
			wg.Go(func() { errs[k] = cli.BatchRead(bctx, srv.SessionID(), ops) })
		}
		cancel()
		wg.Wait()
		for k := range nb - 1 {
			if errs[k] != nil {
				t.Errorf("batch %d: %v", k, errs[k])
			}
			lo, hi := k*nops*size, (k+1)*nops*size
			if !bytes.Equal(local[lo:hi], remote[lo:hi]) {
				t.Errorf("batch %d: data mismatch", k)
			}
		}
		if err := errs[nb-1]; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("cancelled batch: %v, want nil or context.Canceled", err)
		}
	}()
	checkGoroutines(t, base)
}
