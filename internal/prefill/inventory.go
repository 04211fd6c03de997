package prefill

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/stages/notify/tracker"
)

// DefaultHeldAgeAlert: a request's blocks are read within seconds of its
// send; two minutes held is a decode that never came (stranded blocks),
// long before the 480 s abort timeout frees them.
const DefaultHeldAgeAlert = 120 * time.Second

// HeldRequest is one held request as /debug/kv lists it.
type HeldRequest struct {
	tracker.Held
	// Grant is what its send made readable with read grants on: "blocks"
	// (its named blocks), "all" (every block, a send without block ids
	// under read.grants auto), "none" (nothing: read.grants on without
	// block ids), or "off" (grants off: the engine serves every block).
	Grant string `json:"grant"`
}

// Inventory lists every held request, oldest first: blocks, age, expected
// and seen DONEs, lease or abort deadline, grant state.
func (w *Worker) Inventory() []HeldRequest {
	held := w.tr.Inventory(w.now())
	out := make([]HeldRequest, len(held))
	w.mu.Lock()
	defer w.mu.Unlock()
	for i, h := range held {
		out[i] = HeldRequest{Held: h, Grant: "off"}
		if w.opts.Grants == nil {
			continue
		}
		switch rec, ok := w.granted[h.RequestID]; {
		case !ok:
			out[i].Grant = "none"
		case rec.all:
			out[i].Grant = "all"
		default:
			out[i].Grant = "blocks"
		}
	}
	return out
}

func (w *Worker) heldAge() time.Duration {
	if w.opts.HeldAgeAlert > 0 {
		return w.opts.HeldAgeAlert
	}
	return DefaultHeldAgeAlert
}

// heldPastGauge is kvflow_tracker_requests_held_past_age.
func (w *Worker) heldPastGauge() prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvflow_tracker_requests_held_past_age",
		Help: "Held requests (awaiting DONEs) whose send is older than tracker.held_age_alert: blocks a decode may never free (see /debug/kv).",
	}, func() float64 { return float64(w.tr.HeldPast(w.now(), w.heldAge())) })
}

// DebugKVLimit is how many held requests /debug/kv lists by default
// (the oldest: the stranded ones); ?limit=N asks for up to
// DebugKVMaxLimit. "total" always counts every held request. A worker may
// hold 100k requests: listing them all would be tens of MB per GET.
const (
	DebugKVLimit    = 1000
	DebugKVMaxLimit = 100000
)

// ServeHTTP serves /debug/kv: the held requests as JSON (durations in
// seconds), oldest first, at most ?limit= (DebugKVLimit by default).
func (w *Worker) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	limit := DebugKVLimit
	if v := r.URL.Query().Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			http.Error(rw, fmt.Sprintf("/debug/kv: limit %q is not a count", v), http.StatusBadRequest)
			return
		}
		limit = min(n, DebugKVMaxLimit)
	}
	type entry struct {
		RequestID     string   `json:"request_id"`
		Blocks        int      `json:"blocks"`
		AgeS          float64  `json:"age_s"`
		ExpectedDones int      `json:"expected_dones"`
		DonesSeen     int      `json:"dones_seen"`
		Leased        bool     `json:"leased"`
		LeaseRemainS  *float64 `json:"lease_remaining_s,omitempty"`
		AbortInS      *float64 `json:"abort_in_s,omitempty"`
		Grant         string   `json:"grant"`
		PastAlertAge  bool     `json:"past_alert_age"`
	}
	inv := w.Inventory()
	age := w.heldAge()
	out := struct {
		HeldAgeAlertS float64 `json:"held_age_alert_s"`
		Total         int     `json:"total"`
		Truncated     bool    `json:"truncated,omitempty"`
		Held          []entry `json:"held"`
	}{HeldAgeAlertS: age.Seconds(), Total: len(inv), Truncated: len(inv) > limit}
	inv = inv[:min(len(inv), limit)]
	out.Held = make([]entry, 0, len(inv))
	for _, h := range inv {
		e := entry{RequestID: h.RequestID, Blocks: h.Blocks, AgeS: h.Age.Seconds(), ExpectedDones: h.ExpectedDones,
			DonesSeen: h.DonesSeen, Leased: h.Leased, Grant: h.Grant, PastAlertAge: h.Age > age}
		if h.Leased {
			v := h.LeaseRemaining.Seconds()
			e.LeaseRemainS = &v
		} else {
			v := h.AbortIn.Seconds()
			e.AbortInS = &v
		}
		out.Held = append(out.Held, e)
	}
	rw.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(rw)
	enc.SetIndent("", "  ")
	enc.Encode(out)
}
