package peers

import (
	"errors"
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// TestMaxPeersBoundsDownPeers: endpoints come from requests (a client
// names its prefill), so a stream of requests naming distinct dead
// endpoints, each failing DownAfter times, must not grow the records (and
// /debug/peers) past MaxPeers: with no idle up peer to forget, the least
// recently used idle down peer goes (it is re-learned if named again).
func TestMaxPeersBoundsDownPeers(t *testing.T) {
	const maxPeers = 8
	tr, err := New(Options{DownAfter: 1, ProbeInterval: time.Hour, MaxPeers: maxPeers, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 1000 {
		ep := fmt.Sprintf("10.0.%d.%d:5000", i/256, i%256)
		tr.Begin(ep)
		tr.End(ep, errors.New("connection refused"))
	}
	if n := len(tr.Snapshot()); n > maxPeers {
		t.Fatalf("%d peer records, MaxPeers %d", n, maxPeers)
	}
	rec := httptest.NewRecorder()
	tr.ServeHTTP(rec, httptest.NewRequest("GET", "/debug/peers", nil))
	if n := rec.Body.Len(); n > maxPeers*2048 {
		t.Fatalf("/debug/peers is %d bytes for %d peers at most", n, maxPeers)
	}
}
