package pipeline

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

type item struct {
	id      int
	visited []string
	mu      sync.Mutex
}

func (it *item) visit(stage string) {
	it.mu.Lock()
	it.visited = append(it.visited, stage)
	it.mu.Unlock()
}

type collector struct {
	mu      sync.Mutex
	results map[int][]Result[*item]
	count   atomic.Int64
}

func newCollector() *collector { return &collector{results: map[int][]Result[*item]{}} }

func (c *collector) sink(r Result[*item]) {
	c.mu.Lock()
	c.results[r.Item.id] = append(c.results[r.Item.id], r)
	c.mu.Unlock()
	c.count.Add(1)
}

func noop(name string) StageConfig[*item] {
	return StageConfig[*item]{Name: name, Workers: 2, Capacity: 4, Stage: StageFunc[*item](func(ctx context.Context, it *item) error {
		it.visit(name)
		return nil
	})}
}

func TestValidate(t *testing.T) {
	sink := func(Result[*item]) {}
	ok := noop("a")
	cases := []struct {
		name string
		cfg  Config[*item]
		want []string
	}{
		{"no stages", Config[*item]{Sink: sink}, []string{"no stages"}},
		{"nil sink", Config[*item]{Stages: []StageConfig[*item]{ok}}, []string{"nil sink"}},
		{"zero workers", Config[*item]{Sink: sink, Stages: []StageConfig[*item]{{Name: "a", Workers: 0, Capacity: 1, Stage: ok.Stage}}}, []string{`"a": workers must be > 0, got 0`}},
		{"negative capacity", Config[*item]{Sink: sink, Stages: []StageConfig[*item]{{Name: "a", Workers: 1, Capacity: -3, Stage: ok.Stage}}}, []string{`"a": capacity must be > 0, got -3`}},
		{"nil stage", Config[*item]{Sink: sink, Stages: []StageConfig[*item]{{Name: "a", Workers: 1, Capacity: 1}}}, []string{`"a": nil stage`}},
		{"nil func", Config[*item]{Sink: sink, Stages: []StageConfig[*item]{{Name: "a", Workers: 1, Capacity: 1, Stage: StageFunc[*item](nil)}}}, []string{`"a": nil stage`}},
		{"duplicate and empty", Config[*item]{Sink: sink, Stages: []StageConfig[*item]{ok, ok, {Workers: 1, Capacity: 1, Stage: ok.Stage}}}, []string{`duplicate name "a"`, "empty name"}},
		{"all at once", Config[*item]{Stages: []StageConfig[*item]{{Name: "a"}}}, []string{"nil sink", "workers", "capacity", "nil stage"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p, err := New(tc.cfg)
			if err == nil {
				p.Close(context.Background())
				t.Fatal("New accepted a bad config")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

func TestSubmitAfterClose(t *testing.T) {
	c := newCollector()
	p, err := New(Config[*item]{Stages: []StageConfig[*item]{noop("a")}, Sink: c.sink})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := p.Submit(context.Background(), &item{}); !errors.Is(err, ErrClosed) {
		t.Fatalf("Submit after Close: %v, want ErrClosed", err)
	}
	if err := p.TrySubmit(&item{}); !errors.Is(err, ErrClosed) {
		t.Fatalf("TrySubmit after Close: %v, want ErrClosed", err)
	}
	if err := p.Close(context.Background()); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if c.count.Load() != 0 {
		t.Fatal("rejected items reached the sink")
	}
}

func TestDuplicateRegistration(t *testing.T) {
	reg := prometheus.NewRegistry()
	cfg := Config[*item]{Stages: []StageConfig[*item]{noop("a")}, Sink: func(Result[*item]) {}, Registerer: reg}
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close(context.Background())
	if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "register metrics") {
		t.Fatalf("second pipeline on the same registry: %v", err)
	}
}

// TestFailureRouting: an item failing in stage b skips c and d (healthy-only)
// and still visits e (SeesFailed), which gets the cause via ProcessFailed.
func TestFailureRouting(t *testing.T) {
	boom := errors.New("boom")
	var gotCause error
	var causeMu sync.Mutex
	stages := []StageConfig[*item]{noop("a"),
		{Name: "b", Workers: 1, Capacity: 1, Stage: StageFunc[*item](func(ctx context.Context, it *item) error {
			it.visit("b")
			if it.id == 1 {
				return boom
			}
			if it.id == 2 {
				panic("kaboom")
			}
			return nil
		})},
		noop("c"), noop("d"),
		{Name: "e", Workers: 1, Capacity: 1, SeesFailed: true, Stage: failAware{onFail: func(it *item, cause error) {
			causeMu.Lock()
			if it.id == 1 {
				gotCause = cause
			}
			causeMu.Unlock()
		}}},
	}
	c := newCollector()
	reg := prometheus.NewRegistry()
	p, err := New(Config[*item]{Stages: stages, Sink: c.sink, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := p.Submit(context.Background(), &item{id: i}); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	want := map[int]struct {
		outcome Outcome
		visited string
		stage   string
	}{
		0: {Done, "a b c d e", ""},
		1: {Failed, "a b e!", "b"},
		2: {Failed, "a b e!", "b"},
	}
	for id, w := range want {
		rs := c.results[id]
		if len(rs) != 1 {
			t.Fatalf("item %d reached the sink %d times", id, len(rs))
		}
		r := rs[0]
		if r.Outcome != w.outcome || r.Stage != w.stage || strings.Join(r.Item.visited, " ") != w.visited {
			t.Errorf("item %d: outcome %v stage %q visited %q; want %v %q %q", id, r.Outcome, r.Stage, r.Item.visited, w.outcome, w.stage, w.visited)
		}
	}
	if !errors.Is(c.results[1][0].Err, boom) || !errors.Is(gotCause, boom) {
		t.Errorf("cause lost: sink %v, stage e %v", c.results[1][0].Err, gotCause)
	}
	if !strings.Contains(c.results[2][0].Err.Error(), `stage "b" panicked: kaboom`) {
		t.Errorf("panic not reported: %v", c.results[2][0].Err)
	}
	if got := value(t, reg, "kvflow_stage_items_total", "stage", "c", "outcome", outcomeSkipped); got != 2 {
		t.Errorf("skipped at c = %v, want 2", got)
	}
	if got := testutil.ToFloat64(p.m.panics.WithLabelValues("b")); got != 1 {
		t.Errorf("panics at b = %v, want 1", got)
	}
	if got := value(t, reg, "kvflow_pipeline_items_total", "outcome", "failed"); got != 2 {
		t.Errorf("failed results = %v, want 2", got)
	}
}

// TestFailureRoutingMiddle: a SeesFailed stage in the middle of the chain
// passes a failed item on to the next stage that sees failed items, not to
// the healthy-only stage right after it; healthy items visit every stage.
func TestFailureRoutingMiddle(t *testing.T) {
	boom := errors.New("boom")
	sees := func(name string) StageConfig[*item] {
		st := noop(name)
		st.SeesFailed = true
		return st
	}
	stages := []StageConfig[*item]{noop("a"),
		{Name: "b", Workers: 1, Capacity: 1, Stage: StageFunc[*item](func(ctx context.Context, it *item) error {
			it.visit("b")
			if it.id%2 == 1 {
				return boom
			}
			return nil
		})},
		sees("c"), noop("d"), sees("e"), noop("f"),
	}
	c := newCollector()
	reg := prometheus.NewRegistry()
	p, err := New(Config[*item]{Stages: stages, Sink: c.sink, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	const n = 200
	for i := range n {
		if err := p.Submit(context.Background(), &item{id: i}); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	for id := range n {
		rs := c.results[id]
		if len(rs) != 1 {
			t.Fatalf("item %d reached the sink %d times", id, len(rs))
		}
		r := rs[0]
		want, outcome, stage := "a b c d e f", Done, ""
		if id%2 == 1 {
			want, outcome, stage = "a b c e", Failed, "b"
		}
		if got := strings.Join(r.Item.visited, " "); got != want || r.Outcome != outcome || r.Stage != stage {
			t.Fatalf("item %d: visited %q outcome %v stage %q; want %q %v %q", id, got, r.Outcome, r.Stage, want, outcome, stage)
		}
	}
	for _, s := range []string{"d", "f"} {
		if got := value(t, reg, "kvflow_stage_items_total", "stage", s, "outcome", outcomeSkipped); got != n/2 {
			t.Errorf("skipped at %s = %v, want %d", s, got, n/2)
		}
	}
	for _, s := range []string{"a", "c", "e"} {
		if got := value(t, reg, "kvflow_stage_items_total", "stage", s, "outcome", outcomeOK); got != n {
			t.Errorf("ok at %s = %v, want %d", s, got, n)
		}
	}
}

type failAware struct{ onFail func(*item, error) }

func (f failAware) Process(ctx context.Context, it *item) error { it.visit("e"); return nil }
func (f failAware) ProcessFailed(ctx context.Context, it *item, cause error) error {
	it.visit("e!")
	f.onFail(it, cause)
	return nil
}

// TestBackpressure: with the last stage stalled, every upstream queue fills
// to capacity, the depth gauges read capacity, blocked time grows and
// TrySubmit reports full. Then the stall is released and everything drains.
func TestBackpressure(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		release := make(chan struct{})
		stalled := StageConfig[*item]{Name: "last", Workers: 1, Capacity: 2, Stage: StageFunc[*item](func(ctx context.Context, it *item) error {
			select {
			case <-release:
			case <-ctx.Done():
			}
			return nil
		})}
		stages := []StageConfig[*item]{noop("s1"), noop("s2"), stalled}
		reg := prometheus.NewRegistry()
		c := newCollector()
		p, err := New(Config[*item]{Stages: stages, Sink: c.sink, Registerer: reg})
		if err != nil {
			t.Fatal(err)
		}
		// Capacity of the system: each queue, plus one item per worker
		// (held in Process or blocked sending).
		n := 0
		for {
			if err := p.TrySubmit(&item{id: n}); err != nil {
				if !errors.Is(err, ErrFull) {
					t.Fatal(err)
				}
				break
			}
			n++
			synctest.Wait()
		}
		synctest.Wait()
		time.Sleep(3 * time.Second) // fake time: upstream workers stay blocked
		synctest.Wait()
		depth := gather(t, reg, "kvflow_stage_queue_depth")
		capacity := gather(t, reg, "kvflow_stage_queue_capacity")
		for _, s := range []string{"s1", "s2", "last"} {
			if depth[s] != capacity[s] || depth[s] == 0 {
				t.Errorf("stage %s depth %v, capacity %v", s, depth[s], capacity[s])
			}
		}
		blocked := gather(t, reg, "kvflow_stage_blocked_seconds_total")
		if blocked["last"] < 2.9 || blocked["s2"] < 2.9 {
			t.Errorf("blocked seconds %v: want >= 3 at the stalled stages", blocked)
		}
		if got := testutil.ToFloat64(p.m.rejected.WithLabelValues("s1")); got != 1 {
			t.Errorf("rejections %v, want 1", got)
		}
		if p.InFlight() != n {
			t.Errorf("in flight %d, want %d", p.InFlight(), n)
		}
		close(release)
		if err := p.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
		if int(c.count.Load()) != n {
			t.Fatalf("sink got %d, want %d", c.count.Load(), n)
		}
	})
}

func gather(t *testing.T, reg *prometheus.Registry, name string) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			var stage string
			for _, l := range m.GetLabel() {
				if l.GetName() == "stage" {
					stage = l.GetValue()
				}
			}
			switch {
			case m.Gauge != nil:
				out[stage] = m.GetGauge().GetValue()
			case m.Counter != nil:
				out[stage] = m.GetCounter().GetValue()
			}
		}
	}
	return out
}

// value is the value of the one gauge or counter named name whose labels
// include the given name, value pairs.
func value(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for i := 0; i < len(labels); i += 2 {
				found := false
				for _, l := range m.GetLabel() {
					found = found || l.GetName() == labels[i] && l.GetValue() == labels[i+1]
				}
				if !found {
					continue metric
				}
			}
			switch {
			case m.Gauge != nil:
				out = append(out, m.GetGauge().GetValue())
			case m.Counter != nil:
				out = append(out, m.GetCounter().GetValue())
			}
		}
	}
	if len(out) != 1 {
		t.Fatalf("%s%v: %d series, want 1", name, labels, len(out))
	}
	return out[0]
}

// TestCountsExactWhenIdle: workers publish their counts lazily (see
// worker), but once the pipeline is idle every count is exact, without
// Close: per-stage ok counts, busy workers, results and in-flight.
func TestCountsExactWhenIdle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var stages []StageConfig[*item]
		for i := range 4 {
			st := noop(fmt.Sprint("s", i))
			st.Workers, st.Capacity = 1+i%2, 64
			stages = append(stages, st)
		}
		reg := prometheus.NewRegistry()
		c := newCollector()
		p, err := New(Config[*item]{Stages: stages, Sink: c.sink, Registerer: reg})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close(context.Background())
		total := 0
		for _, n := range []int{1, publishEvery - 1, 5 * publishEvery, 3} {
			for i := range n {
				if err := p.Submit(context.Background(), &item{id: total + i}); err != nil {
					t.Fatal(err)
				}
			}
			total += n
			synctest.Wait() // every worker waits for its next item: idle
			if got := int(c.count.Load()); got != total {
				t.Fatalf("sink got %d, want %d", got, total)
			}
			for _, st := range stages {
				if got := value(t, reg, "kvflow_stage_items_total", "stage", st.Name, "outcome", outcomeOK); got != float64(total) {
					t.Errorf("after %d items: ok at %s = %v", total, st.Name, got)
				}
				if got := value(t, reg, "kvflow_stage_busy_workers", "stage", st.Name); got != 0 {
					t.Errorf("after %d items: busy at %s = %v", total, st.Name, got)
				}
			}
			if got := value(t, reg, "kvflow_pipeline_items_total", "outcome", "done"); got != float64(total) {
				t.Errorf("after %d items: done = %v", total, got)
			}
			if got := value(t, reg, "kvflow_pipeline_in_flight"); got != 0 || p.InFlight() != 0 {
				t.Errorf("after %d items: in flight %v (%d)", total, got, p.InFlight())
			}
		}
	})
}

// TestCloseDeadline: Close drains what it can; at the deadline the stuck
// items are canceled and still reach the sink exactly once.
func TestCloseDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		slow := StageConfig[*item]{Name: "slow", Workers: 1, Capacity: 8, Stage: StageFunc[*item](func(ctx context.Context, it *item) error {
			select {
			case <-time.After(time.Second):
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		})}
		c := newCollector()
		p, err := New(Config[*item]{Stages: []StageConfig[*item]{noop("a"), slow, noop("z")}, Sink: c.sink})
		if err != nil {
			t.Fatal(err)
		}
		for i := range 6 {
			if err := p.Submit(context.Background(), &item{id: i}); err != nil {
				t.Fatal(err)
			}
		}
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 2500*time.Millisecond)
		defer cancel()
		err = p.Close(ctx)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Close: %v, want deadline exceeded", err)
		}
		if el := time.Since(start); el != 2500*time.Millisecond {
			t.Errorf("Close took %v, want exactly the 2.5s deadline", el)
		}
		var done, canceled int
		for id := range 6 {
			rs := c.results[id]
			if len(rs) != 1 {
				t.Fatalf("item %d ended %d times", id, len(rs))
			}
			switch rs[0].Outcome {
			case Done:
				done++
			case Canceled:
				canceled++
				if !errors.Is(rs[0].Err, ErrCanceled) {
					t.Errorf("canceled item %d err %v", id, rs[0].Err)
				}
			default:
				t.Errorf("item %d: %v", id, rs[0].Outcome)
			}
		}
		if done != 2 || canceled != 4 {
			t.Errorf("done %d canceled %d, want 2 and 4", done, canceled)
		}
	})
}

// TestSubmitBlocksUntilClose: a Submit blocked on a full queue returns
// ErrClosed when Close begins, and its ctx error when ctx ends.
func TestSubmitBlocked(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		release := make(chan struct{})
		st := StageConfig[*item]{Name: "a", Workers: 1, Capacity: 1, Stage: StageFunc[*item](func(ctx context.Context, it *item) error {
			<-release
			return nil
		})}
		c := newCollector()
		p, _ := New(Config[*item]{Stages: []StageConfig[*item]{st}, Sink: c.sink})
		p.Submit(context.Background(), &item{id: 0})
		synctest.Wait()
		p.Submit(context.Background(), &item{id: 1}) // fills the queue
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if err := p.Submit(ctx, &item{id: 2}); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("blocked Submit: %v", err)
		}
		errc := make(chan error)
		go func() { errc <- p.Submit(context.Background(), &item{id: 3}) }()
		synctest.Wait()
		closed := make(chan error)
		go func() { closed <- p.Close(context.Background()) }()
		if err := <-errc; !errors.Is(err, ErrClosed) {
			t.Fatalf("Submit during Close: %v", err)
		}
		close(release)
		if err := <-closed; err != nil {
			t.Fatal(err)
		}
		if c.count.Load() != 2 {
			t.Fatalf("sink got %d, want 2", c.count.Load())
		}
	})
}

// TestRandomized: thousands of items through 5 stages with random errors,
// panics, delays and a cancellation at a random moment. Every accepted item
// reaches the sink exactly once with a consistent outcome, and no goroutine
// outlives Close.
func TestRandomized(t *testing.T) {
	before := runtime.NumGoroutine()
	for round := range 8 {
		t.Run(fmt.Sprint("round", round), func(t *testing.T) {
			seed := uint64(round) * 7919
			rng := rand.New(rand.NewPCG(seed, 1))
			const n = 2000
			var mu sync.Mutex
			plan := make([][5]int, n) // per item per stage: 0 ok, 1 error, 2 panic, 3 delay
			for i := range plan {
				for s := range 5 {
					switch r := rng.IntN(100); {
					case r < 3:
						plan[i][s] = 1
					case r < 4:
						plan[i][s] = 2
					case r < 10:
						plan[i][s] = 3
					}
				}
			}
			var stages []StageConfig[*item]
			for s := range 5 {
				name := fmt.Sprint("s", s)
				stages = append(stages, StageConfig[*item]{
					Name: name, Workers: 1 + rng.IntN(4), Capacity: 1 + rng.IntN(16), SeesFailed: s == 4,
					Stage: StageFunc[*item](func(ctx context.Context, it *item) error {
						it.visit(name)
						switch plan[it.id][s] {
						case 1:
							return fmt.Errorf("err at %s", name)
						case 2:
							panic("panic at " + name)
						case 3:
							select {
							case <-time.After(time.Duration(rand.IntN(200)) * time.Microsecond):
							case <-ctx.Done():
								return ctx.Err()
							}
						}
						return nil
					}),
				})
			}
			c := newCollector()
			p, err := New(Config[*item]{Stages: stages, Sink: c.sink, Registerer: prometheus.NewRegistry()})
			if err != nil {
				t.Fatal(err)
			}
			cancelAt := rng.IntN(n)
			deadline := time.Duration(rng.IntN(3000)) * time.Microsecond
			accepted := map[int]bool{}
			var wg sync.WaitGroup
			for g := range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := g; i < n; i += 4 {
						var err error
						if i%3 == 0 {
							err = p.TrySubmit(&item{id: i})
						} else {
							err = p.Submit(context.Background(), &item{id: i})
						}
						if err == nil {
							mu.Lock()
							accepted[i] = true
							mu.Unlock()
						} else if !errors.Is(err, ErrFull) && !errors.Is(err, ErrClosed) {
							t.Errorf("submit %d: %v", i, err)
						}
						if i == cancelAt {
							go func() {
								ctx, cancel := context.WithTimeout(context.Background(), deadline)
								defer cancel()
								p.Close(ctx)
							}()
						}
					}
				}()
			}
			wg.Wait()
			p.Close(context.Background())
			c.mu.Lock()
			defer c.mu.Unlock()
			for id, rs := range c.results {
				if !accepted[id] {
					t.Fatalf("item %d reached the sink but was never accepted", id)
				}
				if len(rs) != 1 {
					t.Fatalf("item %d reached the sink %d times", id, len(rs))
				}
			}
			for id := range accepted {
				rs := c.results[id]
				if len(rs) != 1 {
					t.Fatalf("accepted item %d reached the sink %d times", id, len(rs))
				}
				r := rs[0]
				// Expected outcome if not canceled: first failing stage.
				firstFail := -1
				for s := range 5 {
					if plan[id][s] == 1 || plan[id][s] == 2 {
						firstFail = s
						break
					}
				}
				switch r.Outcome {
				case Done:
					if firstFail >= 0 && firstFail < 5 {
						t.Fatalf("item %d done but plan fails at s%d", id, firstFail)
					}
				case Failed:
					if r.Stage != fmt.Sprint("s", firstFail) {
						t.Fatalf("item %d failed at %q, plan says s%d", id, r.Stage, firstFail)
					}
					// A failed item must still visit s4 (SeesFailed).
					if v := r.Item.visited; v[len(v)-1] != "s4" {
						t.Fatalf("failed item %d did not visit s4: %v", id, v)
					}
				case Canceled:
					if !errors.Is(r.Err, ErrCanceled) {
						t.Fatalf("canceled item %d err %v", id, r.Err)
					}
				}
			}
		})
	}
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if g := runtime.NumGoroutine(); g > before {
		t.Fatalf("goroutines leaked: %d before, %d after", before, g)
	}
}

// histCount is the sample count of the histogram series name{labels}.
func histCount(t *testing.T, reg *prometheus.Registry, name string, labels ...string) uint64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for i := 0; i < len(labels); i += 2 {
				found := false
				for _, l := range m.GetLabel() {
					found = found || l.GetName() == labels[i] && l.GetValue() == labels[i+1]
				}
				if !found {
					continue metric
				}
			}
			n += m.GetHistogram().GetSampleCount()
		}
	}
	return n
}

// At low traffic (each item submitted once the pipeline is idle again)
// every item is timed, also in stages far faster than the sampling
// threshold: the latency histograms count what the item counters count
// from the first item on (they used to stay empty until the 64th).
func TestLowTrafficEveryItemTimed(t *testing.T) {
	stages := []StageConfig[*item]{noop("a"), noop("b"), noop("c")}
	reg := prometheus.NewRegistry()
	c := newCollector()
	p, err := New(Config[*item]{Stages: stages, Sink: c.sink, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close(context.Background())
	const n = 10
	deadline := time.Now().Add(30 * time.Second)
	for i := range n {
		if err := p.Submit(context.Background(), &item{id: i}); err != nil {
			t.Fatal(err)
		}
		// Idle again: the item reached the sink and no worker is busy.
		for {
			idle := int(c.count.Load()) == i+1
			for _, st := range stages {
				idle = idle && value(t, reg, "kvflow_stage_busy_workers", "stage", st.Name) == 0
			}
			if idle {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("item %d: pipeline not idle", i)
			}
			time.Sleep(time.Millisecond)
		}
		for _, st := range stages {
			if got := histCount(t, reg, "kvflow_stage_duration_seconds", "stage", st.Name); got != uint64(i+1) {
				t.Fatalf("after %d items: kvflow_stage_duration_seconds{stage=%q} count %d", i+1, st.Name, got)
			}
		}
		if got := histCount(t, reg, "kvflow_pipeline_item_duration_seconds", "outcome", "done"); got != uint64(i+1) {
			t.Fatalf("after %d items: kvflow_pipeline_item_duration_seconds{outcome=done} count %d", i+1, got)
		}
	}
}
