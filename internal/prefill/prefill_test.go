package prefill

import (
	"maps"
	"reflect"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/stages/plan"
)

// grants counts the open grants of every block (Grant +1, Revoke -1).
type grants struct {
	mu   sync.Mutex
	open map[int]int
}

func (g *grants) Grant(blocks []int) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, b := range blocks {
		g.open[b]++
	}
	return nil
}

func (g *grants) Revoke(blocks []int) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, b := range blocks {
		if g.open[b]--; g.open[b] == 0 {
			delete(g.open, b)
		}
	}
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
		{"two early DONEs: reported after the second, the late send holds nothing", []step{
			{op: "done", id: "r"},
			{op: "fin", want: []string{}}, // one of two: not freed
			{op: "done", id: "r"},
			{op: "fin", want: []string{"r"}},
			{op: "send", id: "r", blks: big}, // grant opened and closed at once
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
