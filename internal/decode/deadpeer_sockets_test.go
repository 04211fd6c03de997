package decode_test

import (
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/node"
	"github.com/kvflow/kvflow/internal/peers"
	"github.com/kvflow/kvflow/internal/tooling/testkit"
	"github.com/kvflow/kvflow/internal/tooling/testkit/loopback"
)

// These tests run real workers on loopback (internal/tooling/testkit/
// loopback): prefill ranks that are alive, closed (connect refused) or a
// blackhole (a listener that accepts and never answers), and one decode
// worker pulling from them. They assert on counts and order, never on
// wall-clock thresholds; each logs the latencies it saw.

func sockModel() config.Model {
	return config.Model{NumLayers: 2, NumKVHeads: 4, HeadDim: 16, BlockSize: 16, DType: "bf16", NumBlocks: 32}
}

// rig is one decode worker (TP 1) reading from a prefill instance of
// prefillTP ranks at kvPort (those in alive started as real workers).
type rig struct {
	t        *testing.T
	decode   *node.Node
	prefill  []*node.Node
	reg      *prometheus.Registry
	results  chan decode.Result
	kvPort   int
	seq      int
	timeout  time.Duration
	downFter int
}

// startRig starts the prefill ranks alive[i] (of prefillTP) and a decode
// worker (handshake and notify timeouts of timeout per attempt, 3
// attempts, peers.down_after 3, a long probe interval so that no probe
// marks a dead peer up while the test looks).
func startRig(t *testing.T, prefillTP int, alive []bool, timeout time.Duration) *rig {
	t.Helper()
	r := &rig{t: t, results: make(chan decode.Result, 256), timeout: timeout, downFter: 3}
	ns, kvPort := loopback.Start(t, func(kvPort int) []config.Config {
		var cs []config.Config
		for rank := range prefillTP {
			if !alive[rank] {
				continue
			}
			c := loopback.Config(loopback.Worker{Role: config.Prefill, EngineID: "P", KVPort: kvPort,
				Prefill: loopback.TP(prefillTP), Decode: loopback.TP(1), Model: sockModel(), HandshakeTimeout: timeout})
			c.Rank.TP = rank
			cs = append(cs, c)
		}
		c := loopback.Config(loopback.Worker{Role: config.Decode, EngineID: "D", KVPort: kvPort + 1000,
			Prefill: loopback.TP(prefillTP), Decode: loopback.TP(1), Model: sockModel(), HandshakeTimeout: timeout})
		c.Peers.DownAfter = r.downFter
		c.Peers.ProbeInterval = config.Duration(time.Hour)
		return append(cs, c)
	}, func(i int) node.Deps {
		if i < countTrue(alive) {
			return node.Deps{Registerer: prometheus.NewRegistry()}
		}
		r.reg = prometheus.NewRegistry()
		return node.Deps{Registerer: r.reg, OnFinish: func(res decode.Result) { r.results <- res }}
	})
	r.prefill, r.decode, r.kvPort = ns[:len(ns)-1], ns[len(ns)-1], kvPort
	return r
}

func countTrue(bs []bool) int {
	n := 0
	for _, b := range bs {
		if b {
			n++
		}
	}
	return n
}

// load submits one request reading remote blocks [1] from the instance at
// port.
func (r *rig) load(port int) string {
	r.t.Helper()
	r.seq++
	id := fmt.Sprintf("req-%d", r.seq)
	errs := r.decode.Decode.Load(r.t.Context(), []decode.LoadRequest{{RequestID: id, LocalBlockIDs: []int{r.seq % 30},
		Params: decode.KVTransferParams{RemoteBlockIDs: []int{1}, RemoteEngineID: "P", RemoteHost: "127.0.0.1",
			RemotePort: port, RemotePCPSize: 1, RemoteDCPSize: 1}}})
	if errs[0] != nil {
		r.t.Fatalf("load %s: %v", id, errs[0])
	}
	return id
}

// wait returns the next result (a hang guard, not a timing bound).
func (r *rig) wait() decode.Result {
	r.t.Helper()
	select {
	case res := <-r.results:
		return res
	case <-time.After(60 * time.Second):
		r.t.Fatal("no result within 60 s")
	}
	return decode.Result{}
}

func (r *rig) peer(endpoint string) peers.Status {
	for _, st := range r.decode.Peers.Snapshot() {
		if st.Peer == endpoint {
			return st
		}
	}
	return peers.Status{Peer: endpoint}
}

// metric sums the decode worker's series of name whose labels include want.
func (r *rig) metric(name string, want map[string]string) float64 {
	r.t.Helper()
	mfs, err := r.reg.Gather()
	if err != nil {
		r.t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.Metric {
			if !hasLabels(m, want) {
				continue
			}
			switch {
			case m.Counter != nil:
				sum += m.Counter.GetValue()
			case m.Gauge != nil:
				sum += m.Gauge.GetValue()
			}
		}
	}
	return sum
}

func hasLabels(m *dto.Metric, want map[string]string) bool {
	for k, v := range want {
		ok := false
		for _, l := range m.Label {
			if l.GetName() == k && l.GetValue() == v {
				ok = true
			}
		}
		if !ok {
			return false
		}
	}
	return true
}

// blackhole accepts connections on a loopback port and never answers
// (it reads and drops what they send).
type blackhole struct {
	l        net.Listener
	accepted atomic.Int64
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    []net.Conn
}

func newBlackhole(t *testing.T) *blackhole {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &blackhole{l: l}
	b.wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			b.accepted.Add(1)
			b.mu.Lock()
			b.conns = append(b.conns, c)
			b.mu.Unlock()
			b.wg.Go(func() {
				buf := make([]byte, 4096)
				for {
					if _, err := c.Read(buf); err != nil {
						return
					}
				}
			})
		}
	})
	t.Cleanup(func() {
		l.Close()
		b.mu.Lock()
		for _, c := range b.conns {
			c.Close()
		}
		b.mu.Unlock()
		b.wg.Wait()
	})
	return b
}

func (b *blackhole) port() int { return b.l.Addr().(*net.TCPAddr).Port }

// timeToFail sends requests one at a time to a dead prefill rank at port
// until one fails with peer_down, logging each request's latency; it
// returns the latencies of the requests before that one.
func (r *rig) timeToFail(port int, what string) []time.Duration {
	r.t.Helper()
	var lats []time.Duration
	start := time.Now()
	for i := range 2 * r.downFter {
		id := r.load(port)
		res := r.wait()
		if res.RequestID != id || res.Err == nil {
			r.t.Fatalf("%s: request %d: %+v, want %s failed", what, i, res, id)
		}
		if errorsIsPeerDown(res.Err) {
			r.t.Logf("%s: request %d failed at once (peer down) after %v; %v after the first request began; earlier requests took %v",
				what, i, res.Latency, time.Since(start).Round(time.Millisecond), lats)
			return lats
		}
		lats = append(lats, res.Latency)
		r.t.Logf("%s: request %d failed after %v: %v", what, i, res.Latency.Round(time.Millisecond), res.Err)
	}
	r.t.Fatalf("%s: never marked down after %d requests", what, 2*r.downFter)
	return nil
}

func errorsIsPeerDown(err error) bool {
	return err != nil && strings.Contains(err.Error(), "peer down")
}

// TestDeadPeerTimeToFailMeasure logs how long requests to a dead prefill
// rank take until it is marked down, with the default per-attempt
// timeouts (1 s): closed port, then blackhole. A measurement, not a test
// (about 10 s): it runs only with KVFLOW_MEASURE=1.
func TestDeadPeerTimeToFailMeasure(t *testing.T) {
	if os.Getenv("KVFLOW_MEASURE") == "" {
		t.Skip("a measurement: KVFLOW_MEASURE=1 runs it")
	}
	r := startRig(t, 1, []bool{false}, 0)
	r.timeToFail(testkit.ClosedPort(t), "closed port")
	r.timeToFail(newBlackhole(t).port(), "blackhole")
}

// TestBlameOnlyTheDeadRank: a decode rank that reads two prefill ranks
// (prefill TP 2 → decode TP 1), one alive and one whose port is closed:
// its requests fail, and only the dead rank degrades (down after
// peers.down_after requests); the live rank, whose handshake and DONEs
// were fine, records no failure.
func TestBlameOnlyTheDeadRank(t *testing.T) {
	r := startRig(t, 2, []bool{true, false}, 0)
	live, dead := fmt.Sprintf("127.0.0.1:%d", r.kvPort), fmt.Sprintf("127.0.0.1:%d", r.kvPort+1)
	if c, err := net.Dial("tcp", dead); err == nil {
		c.Close()
		t.Skipf("%s (prefill rank 1's port) is taken by another process", dead)
	}
	for i := range r.downFter {
		id := r.load(r.kvPort)
		res := r.wait()
		if res.RequestID != id || res.Err == nil || !strings.Contains(res.Err.Error(), dead) {
			t.Fatalf("request %d: %+v, want %s failed naming %s", i, res, id, dead)
		}
		t.Logf("request %d failed after %v: %v", i, res.Latency, res.Err)
	}
	if st := r.peer(dead); st.State != peers.Down || st.Consecutive != r.downFter {
		t.Errorf("dead rank: %+v, want down after %d failures", st, r.downFter)
	}
	st := r.peer(live)
	if st.State != peers.Up || st.Failures != 0 || st.Consecutive != 0 {
		t.Errorf("live rank: %+v, want up with no failure", st)
	}
	t.Logf("live rank: %d successes (its DONEs), %d failures", st.Successes, st.Failures)
	id := r.load(r.kvPort)
	if res := r.wait(); res.RequestID != id || !errorsIsPeerDown(res.Err) || !strings.Contains(res.Err.Error(), dead) {
		t.Fatalf("after down: %+v, want peer down naming %s", res, dead)
	}
	if st := r.peer(live); st.Failures != 0 {
		t.Errorf("live rank after the peer_down request: %+v", st)
	}
}

// TestDeadPeerClosedPort: requests to a prefill rank whose port refuses
// connections fail without waiting out a single attempt's timeout (the
// handshake's reach of the port is refused), send it no DONE (nothing
// listens there), and mark it down after peers.down_after of them; the
// next request fails at once with peer_down. Default timeouts (1 s per
// attempt, 3 attempts), which none of them waits for.
func TestDeadPeerClosedPort(t *testing.T) {
	r := startRig(t, 1, []bool{false}, 0)
	lats := r.timeToFail(testkit.ClosedPort(t), "closed port")
	if len(lats) != r.downFter {
		t.Errorf("%d requests failed before peer_down, want %d", len(lats), r.downFter)
	}
	// A request's admission also fetches a peer's metadata in the
	// background (the plan stage, for leases), also while the peer is
	// down: GET_METAs are counted by outcome, not by number.
	getMeta := func(outcome string) float64 {
		return r.metric("kvflow_sidechannel_requests_total", map[string]string{"role": "client", "op": "get_meta", "outcome": outcome})
	}
	if n := getMeta("canceled"); n < float64(r.downFter) {
		t.Errorf("%v GET_METAs canceled by the refusal, want at least %d", n, r.downFter)
	}
	for _, c := range []struct {
		name   string
		metric string
		labels map[string]string
	}{
		{"GET_METAs timed out", "kvflow_sidechannel_requests_total", map[string]string{"op": "get_meta", "outcome": "timeout"}},
		{"GET_METAs answered", "kvflow_sidechannel_requests_total", map[string]string{"op": "get_meta", "outcome": "ok"}},
		{"attempts timed out", "kvflow_sidechannel_socket_resets_total", map[string]string{"reason": "timeout"}},
		{"DONEs sent", "kvflow_sidechannel_requests_total", map[string]string{"role": "client", "op": "done"}},
		{"batched DONEs sent", "kvflow_sidechannel_requests_total", map[string]string{"role": "client", "op": "done_batch"}},
	} {
		if got := r.metric(c.metric, c.labels); got != 0 {
			t.Errorf("%s: %v, want 0", c.name, got)
		}
	}
	// Each request refused skips its DONE; the one to the down peer is
	// not sent either (undelivered, as every DONE to a down peer).
	for result, want := range map[string]int{"skipped_refused": r.downFter, "undelivered": 1, "acked": 0} {
		if got := r.metric("kvflow_notify_done_messages_total", map[string]string{"result": result}); got != float64(want) {
			t.Errorf("DONEs %s: %v, want %d", result, got, want)
		}
	}
}

// TestDeadPeerBlackhole: requests to a prefill rank that accepts
// connections and never answers wait out the handshake's attempts (a
// timeout retries: a slow peer may still answer), but requests waiting
// together share that one fetch, and each sends its DONE to the silent
// side channel with one attempt, not three; their failures mark the rank
// down and the next request fails at once.
func TestDeadPeerBlackhole(t *testing.T) {
	const attempt = 200 * time.Millisecond
	r := startRig(t, 1, []bool{false}, attempt)
	bh := newBlackhole(t)
	const n = 4
	ids := map[string]bool{}
	for range n {
		ids[r.load(bh.port())] = true
	}
	for range n {
		res := r.wait()
		if !ids[res.RequestID] || res.Err == nil || !strings.Contains(res.Err.Error(), "no reply after 3 attempts") {
			t.Fatalf("%+v: want one of %v failed with no reply after all 3 attempts", res, ids)
		}
		delete(ids, res.RequestID)
		t.Logf("%s failed after %v: %v", res.RequestID, res.Latency, res.Err)
	}
	for _, c := range []struct {
		name   string
		metric string
		labels map[string]string
		want   float64
	}{
		{"GET_METAs (one fetch shared)", "kvflow_sidechannel_requests_total", map[string]string{"role": "client", "op": "get_meta"}, 1},
		{"GET_METAs timed out", "kvflow_sidechannel_requests_total", map[string]string{"role": "client", "op": "get_meta", "outcome": "timeout"}, 1},
		// A DONE goes out with one attempt (cut by its deadline, outcome
		// canceled), or not at all once the rank is down.
		{"DONEs that waited out every attempt", "kvflow_sidechannel_requests_total", map[string]string{"role": "client", "op": "done", "outcome": "timeout"}, 0},
		{"batched DONEs sent", "kvflow_sidechannel_requests_total", map[string]string{"role": "client", "op": "done_batch"}, 0},
		{"undelivered DONEs", "kvflow_notify_done_messages_total", map[string]string{"result": "undelivered"}, n},
	} {
		if got := r.metric(c.metric, c.labels); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
	if got := r.metric("kvflow_sidechannel_requests_total", map[string]string{"role": "client", "op": "done"}); got > n {
		t.Errorf("%v DONE calls, want at most one per request (%d)", got, n)
	}
	ep := fmt.Sprintf("127.0.0.1:%d", bh.port())
	if st := r.peer(ep); st.State != peers.Down {
		t.Fatalf("blackhole rank after %d failures: %+v, want down", n, st)
	}
	t.Logf("blackhole accepted %d connections (attempts and the reach)", bh.accepted.Load())
	id := r.load(bh.port())
	if res := r.wait(); res.RequestID != id || !errorsIsPeerDown(res.Err) {
		t.Fatalf("after down: %+v, want peer down", res)
	}
}
