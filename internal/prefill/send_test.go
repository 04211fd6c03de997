package prefill

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/stages/plan"
)

// oneToOne is TP 1 → TP 1: the decode rank reads this worker, one DONE.
var oneToOne = plan.Topology{Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 1, PP: 1, DP: 1},
	Model: plan.Model{NumLayers: 4, NumKVHeads: 8}}

func newOneToOne(t *testing.T, now func() time.Time) *Worker {
	t.Helper()
	w, err := New(Options{Topology: oneToOne, Metadata: sidechannel.Metadata{NumBlocks: 64}, Now: now,
		Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// TestSendValidation: each bad send is a per-request error naming the
// field and the value; the good requests of the same message are held.
func TestSendValidation(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	sec := float64(now.Unix())
	cases := []struct {
		name string
		req  SendRequest
		want string // "" = accepted
	}{
		{"now", SendRequest{RequestID: "a", DelayStartTime: sec}, ""},
		{"zero is now", SendRequest{RequestID: "b"}, ""},
		{"the past", SendRequest{RequestID: "c", DelayStartTime: sec - 3600}, ""},
		{"inside the skew", SendRequest{RequestID: "d", DelayStartTime: sec + 59}, ""},
		{"eleven days ahead", SendRequest{RequestID: "e", DelayStartTime: sec + 11*86400}, "delay_start_time: 1.7009504e+09 is 950400 s in the future"},
		{"1e300", SendRequest{RequestID: "f", DelayStartTime: 1e300}, "delay_start_time: 1e+300 is"},
		{"NaN", SendRequest{RequestID: "g", DelayStartTime: math.NaN()}, "delay_start_time: NaN is not a time"},
		{"+Inf", SendRequest{RequestID: "h", DelayStartTime: math.Inf(1)}, "delay_start_time: +Inf is not a time"},
		{"negative", SendRequest{RequestID: "i", DelayStartTime: -1}, "delay_start_time: -1 is not a time"},
		{"duplicate of a held request", SendRequest{RequestID: "a"}, `send "a": request_id: already held`},
		{"empty id", SendRequest{}, "request_id: empty"},
		{"block out of range", SendRequest{RequestID: "j", BlockIDs: []int{64}}, "block_ids: 64 out of range [0, 64)"},
	}
	w := newOneToOne(t, func() time.Time { return now })
	reqs := make([]SendRequest, len(cases))
	for i, c := range cases {
		reqs[i] = c.req
	}
	errs := w.Send(reqs)
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			switch {
			case c.want == "" && errs[i] != nil:
				t.Fatalf("refused: %v", errs[i])
			case c.want != "" && (errs[i] == nil || !strings.Contains(errs[i].Error(), c.want)):
				t.Fatalf("error %v, want one containing %q", errs[i], c.want)
			}
		})
	}
	if got := w.Status()["held"]; got != 4 {
		t.Errorf("held %v, want the 4 accepted", got)
	}
	// A request sent again after it was freed is neither an error nor
	// held again (the seed's re-send after DONE; §5b.9: reported once).
	w.Done("b")
	w.Finished()
	if errs := w.Send([]SendRequest{{RequestID: "b"}}); errs[0] != nil {
		t.Fatalf("send after free: %v", errs[0])
	}
	if got := w.Status()["held"]; got != 3 {
		t.Errorf("held %v after re-send of a freed request, want 3", got)
	}
}

// TestDrain: a draining worker refuses every send with ErrDraining and
// returns from Drain once its held requests ended and the engine
// collected them; at the deadline it returns an error naming what is
// still held. Deterministic time: synctest.
func TestDrain(t *testing.T) {
	t.Run("ends when the last held request is DONE'd and collected", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			w := newOneToOne(t, time.Now)
			w.Send([]SendRequest{{RequestID: "a"}, {RequestID: "b"}, {RequestID: "c"}})
			ended := make(chan error, 1)
			go func() { ended <- w.Drain(context.Background(), time.Second) }()
			synctest.Wait()
			if errs := w.Send([]SendRequest{{RequestID: "new"}}); !errors.Is(errs[0], ErrDraining) {
				t.Fatalf("send while draining: %v", errs[0])
			}
			if !w.Draining() || w.Status()["draining"] != true {
				t.Fatal("not draining")
			}
			w.Done("a")
			w.Abort([]string{"b"})
			time.Sleep(time.Minute)
			select {
			case err := <-ended:
				t.Fatalf("drain ended with c still held: %v", err)
			default:
			}
			w.Done("c")
			time.Sleep(100 * time.Millisecond)
			select {
			case err := <-ended:
				t.Fatalf("drain ended before the engine collected: %v", err)
			default:
			}
			if got := w.Finished(); len(got) != 3 {
				t.Fatalf("finished %v", got)
			}
			if err := <-ended; err != nil {
				t.Fatal(err)
			}
		})
	})
	t.Run("an engine that never collects: ends after collect", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			w := newOneToOne(t, time.Now)
			w.Send([]SendRequest{{RequestID: "a"}})
			w.Done("a")
			start := time.Now()
			if err := w.Drain(context.Background(), time.Second); err != nil {
				t.Fatal(err)
			}
			if d := time.Since(start); d < time.Second {
				t.Fatalf("returned after %v, before collect", d)
			}
		})
	})
	t.Run("deadline", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			w := newOneToOne(t, time.Now)
			w.Send([]SendRequest{{RequestID: "a"}, {RequestID: "b"}})
			ctx, cancel := context.WithTimeout(context.Background(), 25*time.Second)
			defer cancel()
			err := w.Drain(ctx, time.Second)
			if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "2 requests still held") {
				t.Fatalf("drain: %v", err)
			}
		})
	})
	t.Run("nothing held", func(t *testing.T) {
		w := newOneToOne(t, time.Now)
		if err := w.Drain(context.Background(), time.Second); err != nil {
			t.Fatal(err)
		}
	})
}

// TestLeaseExpiryCounted: a renewed request whose renewals stop is freed
// one TTL after the last one, long before the abort timeout, and counted
// as a lease expiry.
func TestLeaseExpiryCounted(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	w, err := New(Options{Topology: oneToOne, Metadata: sidechannel.Metadata{NumBlocks: 64}, Now: func() time.Time { return now },
		AbortTimeout: 600 * time.Second, LeaseTTL: 10 * time.Second, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	w.Send([]SendRequest{{RequestID: "leased"}, {RequestID: "never"}})
	if err := w.Renew([]string{"leased"}); err != nil {
		t.Fatal(err)
	}
	now = now.Add(11 * time.Second)
	if got := w.Finished(); len(got) != 1 || got[0] != "leased" {
		t.Fatalf("finished %v, want [leased]", got)
	}
	if got := counterValue(t, w.leaseEnds); got != 1 {
		t.Errorf("kvflow_prefill_lease_expired_total %v", got)
	}
	if got := counterValue(t, w.freed.WithLabelValues("expired")); got != 1 {
		t.Errorf("kvflow_prefill_freed_total{reason=expired} %v", got)
	}
	if st := w.Status(); st["held"] != 1 || st["leased"] != 0 {
		t.Errorf("status %v", st)
	}
}

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	return testutil.ToFloat64(c)
}
