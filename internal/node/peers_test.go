package node

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/peers"
)

// debugPeers fetches /debug/peers from n's tracker.
func debugPeers(t *testing.T, n *Node) map[string]peers.Status {
	t.Helper()
	rec := httptest.NewRecorder()
	n.Peers.ServeHTTP(rec, httptest.NewRequest("GET", "/debug/peers", nil))
	var body struct {
		Peers []peers.Status `json:"peers"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatalf("/debug/peers: %v: %s", err, rec.Body)
	}
	out := map[string]peers.Status{}
	for _, p := range body.Peers {
		out[p.Peer] = p
	}
	return out
}

// TestPeerDownAndBack: a prefill rank killed is marked down after
// peers.down_after failed requests; requests to it then fail at once
// (peer_down, naming the peer) instead of waiting for timeouts; once it
// is restarted, the probe marks it up within about one probe interval
// and requests to it succeed.
func TestPeerDownAndBack(t *testing.T) {
	const probe = 300 * time.Millisecond
	c := startCluster(t, topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}, func(role string, cfg *config.Config) {
		cfg.Peers.DownAfter = 3
		cfg.Peers.ProbeInterval = config.Duration(probe)
	})
	d := c.decode[0]
	if r := pull(t, c, c.prefill[0], "warm", []int{1}, []int{1}, true); r.Err != nil {
		t.Fatalf("warm-up: %v", r.Err)
	}
	endpoint := fmt.Sprintf("127.0.0.1:%d", c.kvPort)
	if st := debugPeers(t, d)[endpoint]; st.State != peers.Up || st.Successes == 0 {
		t.Fatalf("before the kill: %+v", st)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	c.prefill[0].Close(ctx)
	cancel()

	// Three requests fail (the read: the transfer engine's port is gone;
	// the re-fetch of the metadata: its side-channel port refuses at once)
	// and mark the peer down.
	var slowest time.Duration
	for i := range 3 {
		if err := load(t, d, fmt.Sprint("dead-", i), []int{2 + i}, []int{2}, c.kvPort, "P"); err != nil {
			t.Fatal(err)
		}
	}
	for range 3 {
		r := waitResult(t, c, 30*time.Second)
		if r.Err == nil {
			t.Fatalf("%s: done from a dead prefill", r.RequestID)
		}
		slowest = max(slowest, r.Latency)
	}
	st := debugPeers(t, d)[endpoint]
	if st.State != peers.Down || len(st.RecentFailures) == 0 || st.LastError == "" {
		t.Fatalf("after 3 failures: %+v", st)
	}
	if got := counter(t, c.regs[d], "kvflow_peers_transitions_total", map[string]string{"to": "down"}); got != 1 {
		t.Fatalf("transitions to down %v, want 1", got)
	}

	// While down: at once, with the reason.
	if err := load(t, d, "fast-fail", []int{6}, []int{2}, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	r := waitResult(t, c, 30*time.Second)
	if r.Err == nil || !strings.Contains(r.Err.Error(), "peer down") || !strings.Contains(r.Err.Error(), endpoint) {
		t.Fatalf("request to a down peer: %+v", r)
	}
	// Its failure came from the health check, before any fetch or read
	// (peer_down): no wall-clock comparison with the failures before,
	// which a closed port makes as quick (the refused re-fetch).
	t.Logf("while down: failed after %v (the failures that marked it down took up to %v): %v", r.Latency, slowest, r.Err)

	// Back: the probe finds it.
	p := restartPrefill(t, c, 0, true)
	back := time.Now()
	for debugPeers(t, d)[endpoint].State != peers.Up {
		if time.Since(back) > 20*probe { // a hang guard, not a timing bound
			t.Fatalf("peer still down %v after its restart: %+v", time.Since(back), debugPeers(t, d)[endpoint])
		}
		time.Sleep(10 * time.Millisecond)
	}
	upAfter := time.Since(back)
	if r := pull(t, c, p, "again", []int{7}, []int{3}, true); r.Err != nil {
		t.Fatalf("after the restart: %v", r.Err)
	}
	t.Logf("marked up %v after the restart (probe interval %v); request after it succeeded", upAfter, probe)
	if got := counter(t, c.regs[d], "kvflow_peers_transitions_total", map[string]string{"to": "up"}); got != 1 {
		t.Fatalf("transitions to up %v, want 1", got)
	}
}
