package prefill

import (
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/internal/sidechannel"
)

// TestDebugKV: /debug/kv lists every held request with its blocks, age,
// DONEs and grant state, oldest first; the gauge counts those held past
// HeldAgeAlert; a request freed by its DONE leaves the list.
func TestDebugKV(t *testing.T) {
	var mu sync.Mutex
	now := time.Unix(10000, 0)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	reg := prometheus.NewRegistry()
	g := &grants{open: map[int]int{}, reading: make(chan struct{})}
	close(g.reading)
	w, err := New(Options{Topology: tp1, Metadata: sidechannel.Metadata{NumBlocks: 64}, Grants: g, HeldAgeAlert: time.Minute,
		Now: clock, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	w.Send([]SendRequest{{RequestID: "old", BlockIDs: []int{1, 2, 3}}})
	advance(90 * time.Second)
	w.Send([]SendRequest{{RequestID: "new"}, {RequestID: "done", BlockIDs: []int{9}}})
	if err := w.Done("done"); err != nil {
		t.Fatal(err)
	}
	advance(time.Second)
	rec := httptest.NewRecorder()
	w.ServeHTTP(rec, httptest.NewRequest("GET", "/debug/kv", nil))
	var body struct {
		HeldAgeAlertS float64 `json:"held_age_alert_s"`
		Held          []struct {
			RequestID     string   `json:"request_id"`
			Blocks        int      `json:"blocks"`
			AgeS          float64  `json:"age_s"`
			ExpectedDones int      `json:"expected_dones"`
			DonesSeen     int      `json:"dones_seen"`
			AbortInS      *float64 `json:"abort_in_s"`
			Grant         string   `json:"grant"`
			PastAlertAge  bool     `json:"past_alert_age"`
		} `json:"held"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatalf("%v: %s", err, rec.Body)
	}
	if len(body.Held) != 2 || body.HeldAgeAlertS != 60 {
		t.Fatalf("/debug/kv: %s", rec.Body)
	}
	old, nw := body.Held[0], body.Held[1]
	if old.RequestID != "old" || old.Blocks != 3 || old.AgeS != 91 || old.ExpectedDones != 1 || old.DonesSeen != 0 ||
		old.Grant != "blocks" || !old.PastAlertAge || old.AbortInS == nil || *old.AbortInS != 480-91 {
		t.Errorf("old: %+v", old)
	}
	if nw.RequestID != "new" || nw.Blocks != 0 || nw.Grant != "all" || nw.PastAlertAge {
		t.Errorf("new: %+v", nw)
	}
	if got := testutil.ToFloat64(w.heldPastGauge()); got != 1 {
		t.Errorf("held past age %v, want 1", got)
	}
	if n, err := testutil.GatherAndCount(reg, "kvflow_tracker_requests_held_past_age"); err != nil || n != 1 {
		t.Errorf("gauge registered: %d, %v", n, err)
	}
}

// TestDebugKVBounded: with many held requests /debug/kv lists the oldest
// DebugKVLimit (or ?limit=), says how many are held in all, and refuses
// a limit that is not a count.
func TestDebugKVBounded(t *testing.T) {
	w, err := New(Options{Topology: tp1, Metadata: sidechannel.Metadata{NumBlocks: 64}, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	const held = DebugKVLimit + 500
	reqs := make([]SendRequest, held)
	for i := range reqs {
		reqs[i] = SendRequest{RequestID: fmt.Sprintf("req-%06d", i), BlockIDs: []int{i % 64}}
	}
	w.Send(reqs)
	for _, tc := range []struct {
		query string
		code  int
		n     int
	}{{"", 200, DebugKVLimit}, {"?limit=7", 200, 7}, {"?limit=0", 200, 0}, {"?limit=999999999", 200, held}, {"?limit=-1", 400, 0}, {"?limit=x", 400, 0}} {
		rec := httptest.NewRecorder()
		w.ServeHTTP(rec, httptest.NewRequest("GET", "/debug/kv"+tc.query, nil))
		if rec.Code != tc.code {
			t.Fatalf("%q: status %d, want %d", tc.query, rec.Code, tc.code)
		}
		if tc.code != 200 {
			continue
		}
		var body struct {
			Total     int               `json:"total"`
			Truncated bool              `json:"truncated"`
			Held      []json.RawMessage `json:"held"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
			t.Fatalf("%q: %v", tc.query, err)
		}
		if len(body.Held) != tc.n || body.Total != held || body.Truncated != (tc.n < held) {
			t.Errorf("%q: %d listed, total %d, truncated %v; want %d of %d", tc.query, len(body.Held), body.Total, body.Truncated, tc.n, held)
		}
	}
}
