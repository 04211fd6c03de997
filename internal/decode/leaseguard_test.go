package decode

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/stages/conf"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/notify"
	"github.com/kvflow/kvflow/stages/plan"
)

// leaseRig is a kvflow prefill worker (tracker with leases, side channel,
// transfer engine) and a decode worker pulling from it, on loopback
// sockets. The decode's single read worker can be held by a request to a
// fake second prefill ("blocker") until unblock is closed, so a request
// to the real one waits before its read, leased and renewed, for as long
// as the test wants.
type leaseRig struct {
	t        *testing.T
	pre      *prefill.Worker
	preReg   *prometheus.Registry
	srv      *sidechannel.Server
	port     int      // the prefill's side channel
	remote   [][]byte // the prefill's caches (2 parts), 8 blocks of 64 bytes
	local    [][]byte // the decode's
	w        *Worker
	reg      *prometheus.Registry
	results  chan Result
	ended    map[string]Result // results read while waiting for another
	blocking chan struct{}     // closed when the blocker's read has started
	unblock  chan struct{}
}

const (
	rigBlockLen  = 64
	rigBlocks    = 8
	blockerPort  = 1 // the fake prefill's side channel (answered by the fetcher, never dialed)
	blockerEngTE = "127.0.0.1:2"
)

func rigMmap(t *testing.T) []byte {
	b, err := syscall.Mmap(-1, 0, 4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Munmap(b) })
	return b
}

// sideFetcher is the decode's GET_META over the side channel, and the
// blocker's metadata (no lease) without one.
type sideFetcher struct{ c *sidechannel.Client }

func (f sideFetcher) GetMeta(ctx context.Context, endpoint string) (job.Meta, error) {
	if endpoint == ep(blockerPort) {
		return job.Meta{EngineID: "B", TERPCPort: 2, BaseAddrs: []uint64{1 << 20, 1<<20 + 4096}, NumBlocks: rigBlocks}, nil
	}
	m, err := f.c.GetMeta(ctx, endpoint)
	if err != nil {
		return job.Meta{}, err
	}
	return job.Meta{EngineID: m.EngineID, TERPCPort: m.TERPCPort, BaseAddrs: m.KVCachesBaseAddr, NumBlocks: m.NumBlocks,
		BootEpoch: m.Ext.BootEpoch, LeaseTTL: m.Ext.LeaseTTL}, nil
}

func newLeaseRig(t *testing.T, ttl time.Duration) *leaseRig {
	r := &leaseRig{t: t, results: make(chan Result, 16), ended: map[string]Result{}, blocking: make(chan struct{}), unblock: make(chan struct{})}
	log := slog.New(slog.DiscardHandler)
	if testing.Verbose() {
		log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	engine := func() *mooncake.TCPEngine {
		e, err := mooncake.NewTCPEngine(mooncake.DefaultTCPConfig(), prometheus.NewRegistry(), log)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		return e
	}
	zctx := func() *sidechannel.Context {
		z, err := sidechannel.NewContext(sidechannel.ContextOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { z.Close() })
		return z
	}
	pe, de := engine(), engine()
	var bases []uint64
	for range 2 {
		b := rigMmap(t)
		if err := pe.Register(mooncake.AddrOf(b), uint64(len(b)), ""); err != nil {
			t.Fatal(err)
		}
		r.remote, bases = append(r.remote, b), append(bases, mooncake.AddrOf(b))
		l := rigMmap(t)
		if err := de.Register(mooncake.AddrOf(l), uint64(len(l)), ""); err != nil {
			t.Fatal(err)
		}
		r.local = append(r.local, l)
	}

	var err error
	r.preReg = prometheus.NewRegistry()
	r.pre, err = prefill.New(prefill.Options{
		Topology: admissionTopology(), AbortTimeout: time.Minute, LeaseTTL: ttl, Registerer: r.preReg, Logger: log,
		Metadata: sidechannel.Metadata{EngineID: "P", TERPCPort: pe.RPCPort(), KVCachesBaseAddr: bases, NumBlocks: rigBlocks},
	})
	if err != nil {
		t.Fatal(err)
	}
	pz := zctx()
	r.srv, err = sidechannel.NewServer(pz, sidechannel.ServerOptions{Addr: "127.0.0.1:0"}, r.pre)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.srv.Close() })
	if _, err := fmt.Sscanf(r.srv.Addr()[strings.LastIndexByte(r.srv.Addr(), ':')+1:], "%d", &r.port); err != nil {
		t.Fatalf("side channel address %q: %v", r.srv.Addr(), err)
	}

	co := sidechannel.DefaultClientOptions()
	co.AttemptTimeout, co.Attempts = 400*time.Millisecond, 1
	c, err := sidechannel.NewClient(zctx(), co)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	sizes := DefaultStageSizes()
	sizes.Read = StageSize{Workers: 1, Queue: 64} // the blocker holds it
	r.reg = prometheus.NewRegistry()
	r.w, err = New(Options{
		Topology: admissionTopology(),
		Fetcher:  sideFetcher{c},
		Transfer: transferFunc(func(ctx context.Context, session string, ops []plan.Op) error {
			if session == blockerEngTE {
				close(r.blocking)
				select {
				case <-r.unblock:
					return nil
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			mops := make([]mooncake.Op, len(ops))
			for i, op := range ops {
				mops[i] = mooncake.Op{Local: op.Local, Remote: op.Remote, Length: op.Len}
			}
			return de.BatchRead(ctx, session, mops)
		}),
		Sender:     c,
		Renewer:    c,
		Handshake:  handshakeConfig(5 * time.Second),
		Notify:     notify.Config{Timeout: conf.Duration(300 * time.Millisecond), Attempts: 1},
		Stages:     sizes,
		Layout:     plan.CacheLayout{BlockLen: []uint64{rigBlockLen, rigBlockLen}, CachesPerLayer: 2},
		Local:      plan.Caches{Base: []uint64{mooncake.AddrOf(r.local[0]), mooncake.AddrOf(r.local[1])}, NumBlocks: rigBlocks},
		OnFinish:   func(res Result) { r.results <- res },
		Registerer: r.reg,
		Logger:     log,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		r.w.Close(ctx)
	})
	return r
}

// fill writes pattern seed into the prefill's blocks.
func (r *leaseRig) fill(blocks []int, seed byte) {
	for k, part := range r.remote {
		for _, b := range blocks {
			for i := range rigBlockLen {
				part[b*rigBlockLen+i] = seed ^ byte(k*31+b*7+i)
			}
		}
	}
}

// landed reports whether the decode's blocks hold pattern seed.
func (r *leaseRig) landed(blocks []int, seed byte) bool {
	for k, part := range r.local {
		for _, b := range blocks {
			for i := range rigBlockLen {
				if part[b*rigBlockLen+i] != seed^byte(k*31+b*7+i) {
					return false
				}
			}
		}
	}
	return true
}

func (r *leaseRig) load(id string, port int, blocks []int) {
	r.t.Helper()
	engine := "P"
	if port == blockerPort {
		engine = "B"
	}
	mustLoad(r.t, r.w, LoadRequest{RequestID: id, LocalBlockIDs: blocks,
		Params: KVTransferParams{RemoteBlockIDs: blocks, RemoteEngineID: engine, RemoteHost: "127.0.0.1", RemotePort: port}})
}

func (r *leaseRig) result(id string) Result {
	r.t.Helper()
	if res, ok := r.ended[id]; ok {
		return res
	}
	for {
		select {
		case res := <-r.results:
			if res.RequestID == id {
				return res
			}
			r.ended[res.RequestID] = res
		case <-time.After(10 * time.Second):
			r.t.Fatalf("no result for %s", id)
		}
	}
}

// waitFreed polls the prefill until it has freed id.
func (r *leaseRig) waitFreed(id string) {
	r.t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !slices.Contains(r.pre.Finished(), id); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			r.t.Fatalf("the prefill never freed %s (status %v)", id, r.pre.Status())
		}
	}
}

func (r *leaseRig) renewed() float64 {
	return gathered(r.t, r.preReg, "kvflow_prefill_lease_renewals_total", "renewed")
}

// gathered is the value of counter name in reg (its series with a label
// valued label, when label is set).
func gathered(t *testing.T, reg *prometheus.Registry, name, label string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if label == "" || slices.ContainsFunc(m.GetLabel(), func(lp *dto.LabelPair) bool { return lp.GetValue() == label }) {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// TestLeaseGuardRealSockets: a request to a kvflow prefill with leases
// waits before its read (the only read worker is busy) while its decode
// renews the lease over the side channel.
//   - side channel lost: the prefill's side channel goes away (RENEWs
//     fail) while its transfer engine keeps serving. The prefill frees the
//     request one TTL after its last renewal and its blocks take another
//     request's bytes; the read is then refused (ErrLeaseLost), never read,
//     and the request fails. Before the guard checked leases it read the
//     other request's bytes and ended done.
//   - renewals working: the request waits as long (over a TTL), its
//     lease holds, and it is read byte for byte and done; its DONE frees it.
func TestLeaseGuardRealSockets(t *testing.T) {
	// Renewed every 500 ms; trusted for 1.2 s after an ACK, so a loaded
	// machine's delays do not end the lease of the renewed request.
	const ttl = 1500 * time.Millisecond
	for _, tc := range []struct {
		name string
		lost bool
	}{
		{"side channel lost", true},
		{"renewals working", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newLeaseRig(t, ttl)
			// Warm up: the prefill's metadata is cached (requests are leased
			// at admission and need no side channel before their read).
			r.fill([]int{1}, 0x11)
			if err := r.pre.Send([]prefill.SendRequest{{RequestID: "warm", BlockIDs: []int{1}}})[0]; err != nil {
				t.Fatal(err)
			}
			r.load("warm", r.port, []int{1})
			if res := r.result("warm"); res.Err != nil || !r.landed([]int{1}, 0x11) {
				t.Fatalf("warm-up: %v (bytes right: %v)", res.Err, r.landed([]int{1}, 0x11))
			}

			r.load("blocker", blockerPort, []int{6})
			select {
			case <-r.blocking:
			case res := <-r.results:
				t.Fatalf("blocker ended before its read: %+v", res)
			}
			r.fill([]int{3, 4}, 0x5a)
			if err := r.pre.Send([]prefill.SendRequest{{RequestID: "r", BlockIDs: []int{3, 4}}})[0]; err != nil {
				t.Fatal(err)
			}
			r.load("r", r.port, []int{3, 4})
			// The decode renews r at the prefill (the first RENEW within 5 ms).
			for deadline := time.Now().Add(5 * time.Second); r.pre.Status()["leased"] != 1; time.Sleep(5 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("r never renewed")
				}
			}
			if tc.lost {
				r.srv.Close() // RENEWs (and DONEs) fail from now; the data path works
				r.waitFreed("r")
				if n := gathered(t, r.preReg, "kvflow_prefill_lease_expired_total", ""); n != 1 {
					t.Fatalf("%v leases expired at the prefill, want 1", n)
				}
				r.fill([]int{3, 4}, 0xa5) // the freed blocks hold another request now
			} else {
				// Four more renewals at TTL/3: more than a TTL waited.
				for deadline, n0 := time.Now().Add(10*time.Second), r.renewed(); r.renewed() < n0+4; time.Sleep(5 * time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatalf("%v renewals", r.renewed())
					}
				}
			}
			close(r.unblock)
			if res := r.result("blocker"); res.Err != nil {
				t.Fatalf("blocker: %v", res.Err)
			}
			res := r.result("r")
			lost := r.w.counter(t, "kvflow_decode_lease_lost_reads_total", "")
			if !tc.lost {
				if res.Err != nil || !r.landed([]int{3, 4}, 0x5a) || lost != 0 {
					t.Fatalf("renewed request: %v (bytes right: %v), %v refused", res.Err, r.landed([]int{3, 4}, 0x5a), lost)
				}
				r.waitFreed("r") // by its DONE
				return
			}
			if res.Err == nil {
				t.Fatalf("request done after its lease ran out; bytes are the other request's: %v", r.landed([]int{3, 4}, 0xa5))
			}
			if !errors.Is(res.Err, ErrLeaseLost) || !strings.Contains(res.Err.Error(), "stage read") || lost != 1 {
				t.Fatalf("failed with %v (%v counted), want the lease named at the read stage", res.Err, lost)
			}
			if r.landed([]int{3, 4}, 0xa5) {
				t.Fatal("the refused read landed the other request's bytes")
			}
			t.Logf("refused: %v", res.Err)
		})
	}
}

// counter is gathered of w's registry: the worker's metrics and its
// stages' (the stale-read guard's are the read stage's, the shutdown
// DONEs' the notify stage's).
func (w *Worker) counter(t *testing.T, name, label string) float64 {
	t.Helper()
	return gathered(t, w.reg.(*prometheus.Registry), name, label)
}
