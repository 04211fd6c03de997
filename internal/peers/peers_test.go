package peers

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestDownProbeUp: DownAfter failures in a row mark a peer down (a success
// in between resets the count); Check then fails at once naming it; the
// probe, at most once per interval, marks it up when it answers.
func TestDownProbeUp(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var answer atomic.Bool
		var probes atomic.Int32
		reg := prometheus.NewRegistry()
		tr, err := New(Options{DownAfter: 3, ProbeInterval: time.Second, Registerer: reg,
			Probe: func(ctx context.Context, ep string) error {
				probes.Add(1)
				if !answer.Load() {
					return errors.New("no answer")
				}
				return nil
			}})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { tr.Run(ctx); close(done) }()
		fail := errors.New("read timeout")
		const ep = "10.0.0.1:5000"
		for _, err := range []error{fail, fail, nil, fail, fail} {
			tr.Begin(ep)
			tr.End(ep, err)
		}
		if err := tr.Check(ep); err != nil {
			t.Fatalf("down after 2 failures in a row: %v", err)
		}
		tr.Begin(ep)
		tr.End(ep, fail)
		err = tr.Check(ep)
		if !errors.Is(err, ErrPeerDown) || !strings.Contains(err.Error(), ep) || !strings.Contains(err.Error(), "read timeout") {
			t.Fatalf("Check on a down peer: %v", err)
		}
		if got := testutil.ToFloat64(tr.down); got != 1 {
			t.Fatalf("kvflow_peers_down %v", got)
		}
		time.Sleep(3500 * time.Millisecond)
		synctest.Wait()
		if n := probes.Load(); n < 2 || n > 4 {
			t.Fatalf("%d probes in 3.5 intervals", n)
		}
		if tr.Check(ep) == nil {
			t.Fatal("up without an answer")
		}
		answer.Store(true)
		time.Sleep(time.Second)
		synctest.Wait()
		if err := tr.Check(ep); err != nil {
			t.Fatalf("not up one interval after it answers: %v", err)
		}
		if got := testutil.ToFloat64(tr.transitions.WithLabelValues("up")); got != 1 {
			t.Fatalf("transitions to up %v", got)
		}
		rec := httptest.NewRecorder()
		tr.ServeHTTP(rec, httptest.NewRequest("GET", "/debug/peers", nil))
		for _, want := range []string{`"peer": "10.0.0.1:5000"`, `"state": "up"`, `"recent_failures"`, `"last_probe"`} {
			if !strings.Contains(rec.Body.String(), want) {
				t.Errorf("/debug/peers lacks %s: %s", want, rec.Body)
			}
		}
		cancel()
		<-done
	})
}

// TestMaxPeers: records are bounded; idle up peers are forgotten first,
// down peers are kept.
func TestMaxPeers(t *testing.T) {
	tr, err := New(Options{DownAfter: 1, MaxPeers: 4})
	if err != nil {
		t.Fatal(err)
	}
	tr.Begin("down")
	tr.End("down", errors.New("x"))
	for i := range 1000 {
		ep := fmt.Sprint("p", i)
		tr.Begin(ep)
		tr.End(ep, nil)
	}
	snap := tr.Snapshot()
	if len(snap) > 4 {
		t.Fatalf("%d records kept, max 4", len(snap))
	}
	if tr.Check("down") == nil {
		t.Fatal("down peer forgotten")
	}
}
