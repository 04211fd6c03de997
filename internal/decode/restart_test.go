package decode

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvflow/kvflow/internal/peers"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/read"
)

var errConnLost = errors.New("peer closed the connection")

// restartingPeer is one prefill rank that can restart: GET_META answers its
// current process (transfer-engine port and boot epoch, counted), and the
// transfer serves reads from the current process's session only; a read
// from an older one fails as a lost connection. Reads wait for gate when
// it is set.
type restartingPeer struct {
	mu    sync.Mutex
	port  int
	epoch uint64
	gate  chan struct{}

	fetches atomic.Int32
	waiting atomic.Int32 // reads blocked on gate
}

func newRestartingPeer(boot time.Time) *restartingPeer {
	return &restartingPeer{port: 17000, epoch: uint64(boot.UnixNano())}
}

// restart replaces the process: a new port and boot epoch.
func (p *restartingPeer) restart(boot time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.port++
	p.epoch = uint64(boot.UnixNano())
}

func (p *restartingPeer) GetMeta(context.Context, string) (job.Meta, error) {
	p.fetches.Add(1)
	p.mu.Lock()
	defer p.mu.Unlock()
	return job.Meta{EngineID: "P", TERPCPort: p.port, BaseAddrs: []uint64{1 << 20, 1<<20 + 4096}, NumBlocks: 8, BootEpoch: p.epoch}, nil
}

func (p *restartingPeer) BatchRead(ctx context.Context, session string, _ *read.Batch) error {
	p.mu.Lock()
	gate, live := p.gate, fmt.Sprintf("127.0.0.1:%d", p.port)
	p.mu.Unlock()
	if gate != nil {
		p.waiting.Add(1)
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
		p.mu.Lock()
		live = fmt.Sprintf("127.0.0.1:%d", p.port)
		p.mu.Unlock()
	}
	if session != live {
		return fmt.Errorf("%s: %w", session, errConnLost)
	}
	return nil
}

func (p *restartingPeer) Capabilities() read.Capabilities {
	return read.Capabilities{Classify: func(err error) read.Failure {
		return read.Failure{ConnLost: errors.Is(err, errConnLost)}
	}}
}

// bootEra moves synctest's clock, which starts at 2000-01-01, to 2026:
// the restarting peer's boot epochs are taken from the clock, and stages/read
// reads an epoch before 2017 as no boot time at all.
func bootEra() {
	time.Sleep(time.Until(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)))
}

// tick lets a millisecond pass on synctest's clock, where steps taken
// without a wait happen at one instant: the metadata cached, the restart
// and the admissions happen in this order at distinct times, as on a real
// clock.
func tick() { time.Sleep(time.Millisecond) }

func restartWorker(t *testing.T, p *restartingPeer, opts ...func(*Options)) *Worker {
	t.Helper()
	w, _ := admissionWorker(t, p, nil, new(atomic.Int32), DefaultStageSizes(), append([]func(*Options){func(o *Options) {
		o.Transfer = p
	}}, opts...)...)
	return w
}

func loadN(t *testing.T, w *Worker, prefix string, n int) []string {
	t.Helper()
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%d", prefix, i)
		mustLoad(t, w, loadReq(ids[i], portPeer))
	}
	return ids
}

// The prefill rank restarts after its metadata was cached and before 16
// requests to it are admitted (they were prefilled by the new process):
// each request's first read fails on the old session, and all of them
// together cost one GET_META; each is read again and ends done.
func TestRestartBeforeAdmissionOneRefetch(t *testing.T) {
	// On synctest's clock: no wall-clock deadline decides it.
	synctest.Test(t, testRestartBeforeAdmissionOneRefetch)
}

func testRestartBeforeAdmissionOneRefetch(t *testing.T) {
	bootEra()
	p := newRestartingPeer(time.Now().Add(-time.Hour))
	w := restartWorker(t, p)
	warm(t, w)
	tick()
	p.restart(time.Now())
	tick()
	ids := loadN(t, w, "r", 16)
	done, failed := waitEnded(t, w, ids...)
	if len(done) != len(ids) {
		t.Fatalf("done %d of %d; failed %+v", len(done), len(ids), failed)
	}
	if n := p.fetches.Load(); n != 2 {
		t.Fatalf("%d GET_METAs, want 2 (the first, and one re-fetch for all 16 failed reads)", n)
	}
}

// The rank restarts after 16 requests were admitted (their reads held
// until then): they were prefilled by the old process, whose blocks are
// gone. Each fails, naming the restart, and is never read from the new
// process; one GET_META serves them all.
func TestRestartAfterAdmissionFails(t *testing.T) {
	// On synctest's clock: the reads are all held when the peer restarts.
	synctest.Test(t, testRestartAfterAdmissionFails)
}

func testRestartAfterAdmissionFails(t *testing.T) {
	bootEra()
	p := newRestartingPeer(time.Now().Add(-time.Hour))
	// Every read worker may read this one peer.
	w := restartWorker(t, p, func(o *Options) {
		o.Peers = peers.DefaultConfig()
		o.Peers.ReadWorkers = DefaultStageSizes().Read.Workers
	})
	warm(t, w)
	tick()
	gate := make(chan struct{})
	p.mu.Lock()
	p.gate = gate
	p.mu.Unlock()
	ids := loadN(t, w, "r", 16)
	// Every read stage worker (or every request, when there are more
	// workers) holds a read on the old session once the worker is idle.
	synctest.Wait()
	if n := p.waiting.Load(); n < int32(min(len(ids), DefaultStageSizes().Read.Workers)) {
		t.Fatalf("%d reads started", n)
	}
	tick()
	p.restart(time.Now())
	close(gate)
	done, failed := waitEnded(t, w, ids...)
	if len(done) != 0 {
		t.Fatalf("requests held by the old process ended done: %v", done)
	}
	for _, f := range failed {
		if !strings.Contains(f.Reason, "prefill peer restarted") || !strings.Contains(f.Reason, "after this request was admitted") {
			t.Fatalf("%s: reason %q does not name the restart", f.RequestID, f.Reason)
		}
	}
	if n := p.fetches.Load(); n != 2 {
		t.Fatalf("%d GET_METAs, want 2", n)
	}
}

// A retry is a read like any other: past the prefill's abort timeout, at a
// rank without a lease, it is refused as a stale read.
func TestRetryRefusedPastAbortTimeout(t *testing.T) {
	// On synctest's clock: the read runs exactly 2×abort past its start.
	synctest.Test(t, testRetryRefusedPastAbortTimeout)
}

func testRetryRefusedPastAbortTimeout(t *testing.T) {
	bootEra()
	const abort = 50 * time.Millisecond
	p := newRestartingPeer(time.Now().Add(-time.Hour))
	w := restartWorker(t, p, func(o *Options) { o.PeerAbortTimeout = abort })
	warm(t, w)
	tick()
	p.restart(time.Now())
	tick()
	gate := make(chan struct{})
	p.mu.Lock()
	p.gate = gate
	p.mu.Unlock()
	mustLoad(t, w, loadReq("slow", portPeer))
	synctest.Wait()
	if p.waiting.Load() < 1 {
		t.Fatal("read did not start")
	}
	time.Sleep(2 * abort) // the first read runs past the abort timeout
	p.mu.Lock()
	p.gate = nil
	p.mu.Unlock()
	close(gate)
	_, failed := waitEnded(t, w, "slow")
	if len(failed) != 1 || !strings.Contains(failed[0].Reason, "past the prefill's abort timeout") {
		t.Fatalf("failed %+v, want the retry refused as stale", failed)
	}
	if n := w.counter(t, "kvflow_decode_stale_reads_refused_total", ""); n != 1 {
		t.Fatalf("%v stale reads refused, want 1", n)
	}
}
