package decode_test

import (
	"fmt"
	"net"
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

// closedPort is a loopback port nothing listens on (connect refused).
func closedPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	return port
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

func errorsIsPeerDown(err error) bool { return err != nil && strings.Contains(err.Error(), "peer down") }

// TestDeadPeerTimeToFailMeasure logs how long requests to a dead prefill
// rank take before it is marked down, with the default per-attempt
// timeouts (1 s): closed port and blackhole. Measurement only (-run it by
// name; skipped in -short).
func TestDeadPeerTimeToFailMeasure(t *testing.T) {
	if testing.Short() {
		t.Skip("measurement")
	}
	r := startRig(t, 1, []bool{false}, 0)
	r.timeToFail(closedPort(t), "closed port")
	r.timeToFail(newBlackhole(t).port(), "blackhole")
}
