package node

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/peers"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/sidechannel"
)

// fakeSideChannel serves GET_META with md and DONE with done on a side
// channel of its own (real ZMQ sockets on loopback). It returns the port.
func fakeSideChannel(t *testing.T, md sidechannel.Metadata, done func(string) error) int {
	t.Helper()
	zctx, err := sidechannel.NewContext(sidechannel.ContextOptions{CloseTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := sidechannel.NewServer(zctx, sidechannel.ServerOptions{Addr: "127.0.0.1:0"},
		sidechannel.HandlerFuncs{MetadataFunc: func() sidechannel.Metadata { return md }, DoneFunc: done})
	if err != nil {
		zctx.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close(); zctx.Close() })
	_, port, _ := strings.Cut(srv.Addr(), ":")
	var p int
	fmt.Sscan(port, &p)
	return p
}

// isolationCluster is a TP 1→1 prefill/decode pair whose decode bounds a
// peer's stall by stall (read and notify; the default park budgets), reads
// for at most readTimeout and sends DONEs with notify's short test
// timeouts.
func isolationCluster(t *testing.T, stall, readTimeout time.Duration) *cluster {
	return startCluster(t, topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}, func(role string, c *config.Config) {
		c.Peers.ReadStall = config.Duration(stall)
		c.Peers.NotifyStall = config.Duration(stall)
		c.Read.Timeout = config.Duration(readTimeout)
	})
}

// results collects decode results by request id.
type results struct {
	mu    sync.Mutex
	got   map[string]decode.Result
	order []string // request ids in the order they ended
}

func (r *results) drain(t *testing.T, c *cluster, want int, within time.Duration) {
	t.Helper()
	deadline := time.After(within)
	for {
		r.mu.Lock()
		n := len(r.got)
		r.mu.Unlock()
		if n >= want {
			return
		}
		select {
		case res := <-c.results:
			r.mu.Lock()
			if _, dup := r.got[res.RequestID]; dup {
				t.Errorf("request %s ended twice", res.RequestID)
			}
			r.got[res.RequestID] = res
			r.order = append(r.order, res.RequestID)
			r.mu.Unlock()
		case <-deadline:
			t.Fatalf("%d of %d results within %v", n, want, within)
		}
	}
}

// aloneLatency pulls one request from the healthy prefill and returns its
// latency (the figure the healthy request under a wedged peer is held to).
func aloneLatency(t *testing.T, c *cluster, id string, block int) time.Duration {
	t.Helper()
	c.prefill[0].Prefill.Send([]prefill.SendRequest{{RequestID: id, BlockIDs: []int{block}}})
	if err := load(t, c.decode[0], id, []int{block}, []int{block}, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	r := waitResult(t, c, 10*time.Second)
	if r.Err != nil || r.RequestID != id {
		t.Fatalf("%s: %+v", id, r)
	}
	return r.Latency
}

// isolationRatio bounds the healthy request's latency under a wedged peer
// as a multiple of its latency alone, measured in the same run. Generous:
// the 150 wedged requests still take CPU (handshakes, connections, and in
// the DONE test 150 real reads ahead of it in the plan and handshake
// stages) on a shared 2-core machine: -count=10 gave 0.5-6x (reads) and
// 7-31x (DONEs); the real figures are logged. Waiting for a stall instead
// (before parking: the stall time, 100 ms in these tests then, 10 s and
// 5 s by default) is caught without timing too: it would refuse wedged
// requests as peer_stalled, or let them end before the healthy one.
const isolationRatio = 100

// checkIsolated checks what the isolation tests share: the healthy request
// succeeded, ended before every wedged one (they end only when their reads
// or DONEs time out), within isolationRatio of its latency alone, and no
// wedged request was refused as peer_stalled (150 fit in the read and
// notify stages' worker share, queue share and park budget, so none may
// be refused however slow the machine).
func checkIsolated(t *testing.T, res *results, alone time.Duration, reasons map[string]int) {
	t.Helper()
	h := res.got["healthy"]
	if h.Err != nil {
		t.Fatalf("healthy request: %v", h.Err)
	}
	if i := slices.Index(res.order, "healthy"); i != 0 {
		t.Errorf("healthy request ended #%d, after %v", i, res.order[:i])
	}
	// The ratio is logged, not asserted, on shared CI machines (a 2-core
	// box under go test -race ./... can stall any goroutine for seconds);
	// the order above is the check that holds however slow the machine.
	if h.Latency > isolationRatio*alone {
		t.Logf("healthy request took %v under a wedged peer, %.1fx its %v alone (more than %dx: a loaded machine?)",
			h.Latency, float64(h.Latency)/float64(alone), alone, isolationRatio)
	}
	if reasons["peer_stalled"] > 0 || reasons["other"] > 0 {
		t.Errorf("wedged requests refused or failed for other reasons: %v", reasons)
	}
}

// TestSlowPeerDoesNotHoldOthers: 150 requests to a wedged prefill rank (its
// side channel answers, its transfer engine port accepts connections and
// never answers) and then one to a healthy rank, over real sockets. The
// wedged rank's requests hold only its share of the read stage's workers
// and queue; the rest are parked, so the handshake stage goes on at once
// and the healthy request finishes about as fast as alone, long before the
// production stall bound (peers.read_stall, 10 s, used here); every wedged
// request fails with a timeout once read.timeout passes, none is refused.
func TestSlowPeerDoesNotHoldOthers(t *testing.T) {
	const readTimeout = 2 * time.Second
	stall := peers.DefaultConfig().ReadStall.D()
	c := isolationCluster(t, stall, readTimeout)
	aloneLatency(t, c, "warm", 1)
	alone := aloneLatency(t, c, "alone", 2)

	md := c.prefill[0].Prefill.Metadata()
	md.EngineID = "S"
	md.TERPCPort = silentPeer(t) // the transfer engine never answers
	md.Ext.LeaseTTL = 0
	wedged := fakeSideChannel(t, md, nil)

	d := c.decode[0]
	res := &results{got: map[string]decode.Result{}}
	start := time.Now()
	for i := range 150 {
		if err := load(t, d, fmt.Sprint("wedged-", i), []int{3 + i%8}, []int{1}, wedged, "S"); err != nil {
			t.Fatal(err)
		}
	}
	c.prefill[0].Prefill.Send([]prefill.SendRequest{{RequestID: "healthy", BlockIDs: []int{3}}})
	if err := load(t, d, "healthy", []int{12}, []int{3}, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	loaded := time.Since(start)
	res.drain(t, c, 151, 60*time.Second)
	reasons := map[string]int{}
	for id, r := range res.got {
		if id == "healthy" {
			continue
		}
		switch msg := fmt.Sprint(r.Err); {
		case r.Err == nil:
			reasons["done"]++
			t.Errorf("%s: done from a wedged peer", id)
		case strings.Contains(msg, "key stalled"):
			reasons["peer_stalled"]++
		case strings.Contains(msg, "deadline exceeded"), strings.Contains(msg, "timeout"):
			reasons["timeout"]++
		default:
			reasons["other"]++
			t.Logf("%s: %v", id, r.Err)
		}
	}
	h := res.got["healthy"]
	t.Logf("healthy request: %v under 150 wedged (loads took %v), %v alone (%.1fx; stall bound %v); wedged ended %v",
		h.Latency.Round(time.Microsecond), loaded.Round(time.Microsecond), alone.Round(time.Microsecond),
		float64(h.Latency)/float64(alone), stall, reasons)
	checkIsolated(t, res, alone, reasons)
}

// TestSlowDonePeerDoesNotHoldOthers: the same for DONEs. 150 requests are
// read from a prefill rank whose transfer engine works but whose side
// channel never ACKs a DONE (it answered GET_META before); a request to a
// healthy rank still ends about as fast as alone, before any of them, and
// none of them is refused (their DONEs go undelivered once notify's
// attempts time out, the bytes landed: they end done).
func TestSlowDonePeerDoesNotHoldOthers(t *testing.T) {
	const readTimeout = 5 * time.Second
	stall := peers.DefaultConfig().NotifyStall.D()
	c := isolationCluster(t, stall, readTimeout)
	slow := startCluster(t, topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}) // its prefill serves the reads
	aloneLatency(t, c, "warm", 1)
	alone := aloneLatency(t, c, "alone", 2)

	md := slow.prefill[0].Prefill.Metadata()
	md.Ext.LeaseTTL, md.Ext.BatchDone = 0, false
	hold := make(chan struct{})
	wedged := fakeSideChannel(t, md, func(string) error { <-hold; return nil })
	t.Cleanup(func() { close(hold) }) // before the server's Close (cleanups run last first)

	d := c.decode[0]
	var sends []prefill.SendRequest
	for i := range 150 {
		sends = append(sends, prefill.SendRequest{RequestID: fmt.Sprint("wedged-", i), BlockIDs: []int{1}})
	}
	slow.prefill[0].Prefill.Send(sends)
	res := &results{got: map[string]decode.Result{}}
	for i := range 150 {
		if err := load(t, d, fmt.Sprint("wedged-", i), []int{3 + i%8}, []int{1}, wedged, "P"); err != nil {
			t.Fatal(err)
		}
	}
	c.prefill[0].Prefill.Send([]prefill.SendRequest{{RequestID: "healthy", BlockIDs: []int{3}}})
	if err := load(t, d, "healthy", []int{12}, []int{3}, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	res.drain(t, c, 151, 60*time.Second)
	reasons := map[string]int{}
	for id, r := range res.got {
		switch {
		case id == "healthy":
		case r.Err == nil:
			reasons["done"]++ // its DONE went undelivered; the bytes landed
		case strings.Contains(r.Err.Error(), "key stalled"):
			reasons["peer_stalled"]++
		default:
			reasons["other"]++
			t.Logf("%s: %v", id, r.Err)
		}
	}
	h := res.got["healthy"]
	t.Logf("healthy request: %v under 150 requests with wedged DONEs, %v alone (%.1fx; stall bound %v); wedged ended %v",
		h.Latency.Round(time.Microsecond), alone.Round(time.Microsecond), float64(h.Latency)/float64(alone), stall, reasons)
	checkIsolated(t, res, alone, reasons)
}
