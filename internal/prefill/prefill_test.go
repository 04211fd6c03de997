package prefill

import (
	"fmt"
	"maps"
	"reflect"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/stages/notify/tracker"
	"github.com/kvflow/kvflow/stages/plan"
)

// grants counts the open grants of every block (Grant +1, Revoke -1).
// With reading set, a revoke's completion waits until reading is closed
// (a read of the blocks still in flight).
type grants struct {
	mu      sync.Mutex
	open    map[int]int
	all     int
	reading chan struct{}
}

func (g *grants) Grant(blocks []int) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, b := range blocks {
		g.open[b]++
	}
	return nil
}

func (g *grants) Revoke(blocks []int) (<-chan struct{}, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, b := range blocks {
		if g.open[b]--; g.open[b] == 0 {
			delete(g.open, b)
		}
	}
	if g.reading != nil {
		return g.reading, nil
	}
	done := make(chan struct{})
	close(done)
	return done, nil
}

func (g *grants) GrantAll() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.all++
	return nil
}

func (g *grants) RevokeAll() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.all--
	return nil
}

func (g *grants) openBlocks() map[int]int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return maps.Clone(g.open)
}

// splitTopo is §5b.5's deployment: remote_dcp/dcp = 2, so two decode
// ranks read every prefill rank of a request large enough.
var splitTopo = plan.Topology{
	Prefill: plan.Parallel{TP: 4, PP: 1, DP: 1, DCP: 2},
	Decode:  plan.Parallel{TP: 4, PP: 1, DP: 1},
	Model:   plan.Model{NumLayers: 8, NumKVHeads: 8},
}

func newWorker(t *testing.T, g *grants) *Worker {
	t.Helper()
	w, err := New(Options{Topology: splitTopo, Self: plan.Rank{}, Metadata: sidechannel.Metadata{NumBlocks: 64},
		Grants: g, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// TestEarlyDonesAndGrants: DONEs that arrive before the engine's send free
// a request only once every decode rank reading this worker sent its own
// (§5b.5; the seed frees on the first), and no path leaves a read grant
// open once the request is not held.
func TestEarlyDonesAndGrants(t *testing.T) {
	big := []int{1, 2, 3, 4, 5, 6, 7, 8}
	type step struct {
		op   string // done, send, fin
		id   string
		blks []int
		want []string // fin: the ids reported
	}
	cases := []struct {
		name  string
		steps []step
	}{
		{"two early DONEs: reported once the send finds them, holding nothing", []step{
			{op: "done", id: "r"},
			{op: "fin", want: []string{}}, // not sent: never reported by itself
			{op: "done", id: "r"},
			{op: "fin", want: []string{}},
			{op: "send", id: "r", blks: big}, // grant opened and closed at once
			{op: "fin", want: []string{"r"}},
			{op: "fin", want: []string{}},
		}},
		{"one early DONE, then the send: freed by the send", []step{
			{op: "done", id: "r"},
			{op: "send", id: "r", blks: big},
			{op: "fin", want: []string{}}, // held: one DONE still due
			{op: "done", id: "r"},
			{op: "fin", want: []string{"r"}},
		}},
		{"send after the request finished: no grant left open", []step{
			{op: "send", id: "r", blks: big},
			{op: "done", id: "r"},
			{op: "done", id: "r"},
			{op: "fin", want: []string{"r"}},
			{op: "send", id: "r", blks: big},
			{op: "fin", want: []string{}},
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			g := &grants{open: map[int]int{}}
			w := newWorker(t, g)
			for i, s := range c.steps {
				switch s.op {
				case "done":
					if err := w.Done(s.id); err != nil {
						t.Fatalf("step %d: done %s: %v", i, s.id, err)
					}
				case "send":
					if errs := w.Send([]SendRequest{{RequestID: s.id, BlockIDs: s.blks}}); errs[0] != nil {
						t.Fatalf("step %d: send %s: %v", i, s.id, errs[0])
					}
				case "fin":
					if got := w.Finished(); !reflect.DeepEqual(got, s.want) {
						t.Fatalf("step %d: finished %v, want %v", i, got, s.want)
					}
				}
			}
			if open := g.openBlocks(); len(open) != 0 {
				t.Errorf("grants left open after the request ended: %v", open)
			}
		})
	}
}

// TestEarlyQuorumFollowsTopology: the quorum is the DONE count of a
// request every decode rank reads, per rank and request id.
func TestEarlyQuorumFollowsTopology(t *testing.T) {
	topos := []struct {
		name string
		topo plan.Topology
		want int
	}{
		{"split: remote dcp 2", splitTopo, 2},
		{"TP 1 → 1", plan.Topology{Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 1, PP: 1, DP: 1},
			Model: plan.Model{NumLayers: 4, NumKVHeads: 8}}, 1},
	}
	for _, c := range topos {
		t.Run(c.name, func(t *testing.T) {
			q := earlyQuorum(c.topo, plan.Rank{})
			for _, id := range []string{"a", "b", "req-1"} {
				if got := q(id); got != c.want {
					t.Errorf("quorum(%q) = %d, want %d", id, got, c.want)
				}
			}
		})
	}
}

var tp1 = plan.Topology{Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1}, Decode: plan.Parallel{TP: 1, PP: 1, DP: 1},
	Model: plan.Model{NumLayers: 4, NumKVHeads: 8}}

// TestFreedAfterReadsEnd: a request freed while a read of its blocks is
// still in flight is reported to the engine only once that read has ended
// (the revoke completed); Finished never waits for it, and the request is
// reported exactly once.
func TestFreedAfterReadsEnd(t *testing.T) {
	g := &grants{open: map[int]int{}, reading: make(chan struct{})}
	w, err := New(Options{Topology: tp1, Metadata: sidechannel.Metadata{NumBlocks: 64}, Grants: g})
	if err != nil {
		t.Fatal(err)
	}
	if errs := w.Send([]SendRequest{{RequestID: "r", BlockIDs: []int{1, 2}}}); errs[0] != nil {
		t.Fatal(errs[0])
	}
	if err := w.Done("r"); err != nil {
		t.Fatal(err)
	}
	if got := w.Finished(); len(got) != 0 {
		t.Fatalf("reported while a read is in flight: %v", got)
	}
	if len(g.openBlocks()) != 0 {
		t.Fatal("grant not revoked at once")
	}
	if st := w.Status(); st["uncollected"] != 1 {
		t.Fatalf("status %v: want 1 uncollected", st)
	}
	close(g.reading)
	if got := w.Finished(); !reflect.DeepEqual(got, []string{"r"}) {
		t.Fatalf("finished %v after the read ended", got)
	}
	if got := w.Finished(); len(got) != 0 {
		t.Fatalf("reported twice: %v", got)
	}
}

// TestGrantModes: a send without block ids opens every block while its
// request is held under GrantsAuto, and nothing under GrantsStrict.
func TestGrantModes(t *testing.T) {
	for _, c := range []struct {
		name     string
		mode     GrantMode
		wantOpen int
	}{{"auto", GrantsAuto, 1}, {"strict", GrantsStrict, 0}} {
		t.Run(c.name, func(t *testing.T) {
			g := &grants{open: map[int]int{}}
			w, err := New(Options{Topology: tp1, Metadata: sidechannel.Metadata{NumBlocks: 64}, Grants: g, GrantMode: c.mode})
			if err != nil {
				t.Fatal(err)
			}
			w.Send([]SendRequest{{RequestID: "a"}, {RequestID: "b", BlockIDs: []int{3}}})
			if g.all != c.wantOpen || g.open[3] != 1 {
				t.Fatalf("all %d open %v", g.all, g.open)
			}
			w.Done("a")
			w.Done("b")
			if got := w.Finished(); len(got) != 2 {
				t.Fatalf("finished %v", got)
			}
			if g.all != 0 || len(g.open) != 0 {
				t.Fatalf("left open: all %d, blocks %v", g.all, g.open)
			}
		})
	}
}

// TestUnknownDoneFlood: 8,192 DONEs for ids the engine never sent (one
// done_batch_msg's worth) reach the engine as nothing; what is kept is
// bounded, and the drops are counted.
func TestUnknownDoneFlood(t *testing.T) {
	reg := prometheus.NewRegistry()
	w, err := New(Options{Topology: tp1, Metadata: sidechannel.Metadata{NumBlocks: 64}, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 8192 {
		w.Done(fmt.Sprintf("forged-%d", i))
	}
	if got := w.Finished(); len(got) != 0 {
		t.Fatalf("%d DONEs for unknown ids reported as done_sending", len(got))
	}
	if st := w.Status(); st["early_dones"] != tracker.DefaultMaxEarly {
		t.Fatalf("early DONEs kept: %v", st["early_dones"])
	}
	want := float64(8192 - tracker.DefaultMaxEarly)
	if got := gatherCounter(t, reg, "kvflow_prefill_early_dones_dropped_total", "capacity"); got != want {
		t.Fatalf("dropped (capacity) %v, want %v", got, want)
	}
}

func gatherCounter(t *testing.T, reg *prometheus.Registry, name, reason string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && l.GetValue() == reason {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("no %s{reason=%q}", name, reason)
	return 0
}
