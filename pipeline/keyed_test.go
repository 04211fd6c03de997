package pipeline

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// kitem is an item of a keyed test pipeline.
type kitem struct {
	id  int
	key string
}

// keyedChain is a two-stage pipeline: a keyed stage running fn, then an
// unkeyed "after" stage that sees failures.
func keyedChain(t *testing.T, reg prometheus.Registerer, sc StageConfig[*kitem], sink func(Result[*kitem])) *Pipeline[*kitem] {
	t.Helper()
	sc.Name = "k"
	sc.Key = func(it *kitem) string { return it.key }
	p, err := New(Config[*kitem]{
		Stages: []StageConfig[*kitem]{
			{Name: "intake", Workers: 1, Capacity: 256, Stage: StageFunc[*kitem](func(context.Context, *kitem) error { return nil })},
			sc,
			{Name: "after", Workers: 1, Capacity: 4, SeesFailed: true, Stage: StageFunc[*kitem](func(context.Context, *kitem) error { return nil })},
		},
		Sink:       sink,
		Registerer: reg,
	})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestKeyedSlowKeyDoesNotHoldOthers: a key whose items never finish holds
// KeyWorkers workers and KeyQueue places, then parks its items until the
// park budget (Capacity) is spent; beyond, its sender blocks until the key
// is stalled, and its further items are then refused at once with
// ErrKeyStalled; items of other keys, sent after it, pass by.
func TestKeyedSlowKeyDoesNotHoldOthers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		release := make(chan struct{})
		var mu sync.Mutex
		var results []Result[*kitem]
		reg := prometheus.NewRegistry()
		p := keyedChain(t, reg, StageConfig[*kitem]{Workers: 4, Capacity: 16, KeyWorkers: 2, KeyQueue: 8, KeyStall: time.Second,
			Stage: StageFunc[*kitem](func(ctx context.Context, it *kitem) error {
				if it.key == "slow" {
					select {
					case <-release:
					case <-ctx.Done():
						return ctx.Err()
					}
				}
				return nil
			})}, func(r Result[*kitem]) { mu.Lock(); results = append(results, r); mu.Unlock() })
		ctx := context.Background()
		for i := range 40 {
			if err := p.Submit(ctx, &kitem{id: i, key: "slow"}); err != nil {
				t.Fatal(err)
			}
		}
		if err := p.Submit(ctx, &kitem{id: 100, key: "fast"}); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		// 2 running, 8 waiting, 16 parked, the intake worker blocked on the 27th.
		if got := testutil.ToFloat64(prometheusGauge(t, reg, "kvflow_stage_keys_backlogged", "k")); got != 1 {
			t.Fatalf("keys backlogged %v, want 1", got)
		}
		mu.Lock()
		n := len(results)
		mu.Unlock()
		if n != 0 {
			t.Fatalf("%d results before the stall: %+v", n, results)
		}
		start := time.Now()
		time.Sleep(time.Second) // fake time: the slow key is now stalled
		synctest.Wait()
		mu.Lock()
		var fastAt int
		refused := 0
		for i, r := range results {
			switch {
			case r.Item.key == "fast":
				if r.Outcome != Done {
					t.Fatalf("fast: %v %v", r.Outcome, r.Err)
				}
				fastAt = i
			case errors.Is(r.Err, ErrKeyStalled):
				refused++
				if r.Stage != "k" || !strings.Contains(r.Err.Error(), `key "slow"`) {
					t.Fatalf("refusal names stage %q, err %v", r.Stage, r.Err)
				}
			default:
				t.Fatalf("unexpected result %+v", r)
			}
		}
		mu.Unlock()
		if refused != 14 {
			t.Fatalf("%d refused, want 14 (40 - 2 running - 8 waiting - 16 parked)", refused)
		}
		if time.Since(start) > time.Second {
			t.Fatalf("fast item ended %v after the stall", time.Since(start))
		}
		_ = fastAt
		close(release)
		if err := p.Close(ctx); err != nil {
			t.Fatal(err)
		}
		if len(results) != 41 {
			t.Fatalf("%d results, want 41", len(results))
		}
	})
}

// prometheusGauge finds the series of name with stage="stage" in reg.
func prometheusGauge(t *testing.T, reg *prometheus.Registry, name, stage string) prometheus.Collector {
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
				if l.GetName() == "stage" && l.GetValue() == stage {
					return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name}, func() float64 {
						if m.Gauge != nil {
							return m.GetGauge().GetValue()
						}
						return float64(m.GetHistogram().GetSampleCount())
					})
				}
			}
		}
	}
	t.Fatalf("no %s{stage=%q}", name, stage)
	return nil
}

// TestKeyedGlobalBound: a keyed stage still holds at most Capacity items
// waiting, all keys together: the sender blocks beyond, as for an unkeyed
// stage, and the blocked time is counted.
func TestKeyedGlobalBound(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		release := make(chan struct{})
		reg := prometheus.NewRegistry()
		p, err := New(Config[*kitem]{
			Stages: []StageConfig[*kitem]{{Name: "k", Workers: 2, Capacity: 4, Key: func(it *kitem) string { return it.key },
				Stage: StageFunc[*kitem](func(ctx context.Context, it *kitem) error { <-release; return nil })}},
			Sink:       func(Result[*kitem]) {},
			Registerer: reg,
		})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		for i := range 6 { // 2 running, 4 waiting (4 distinct keys)
			if err := p.Submit(ctx, &kitem{id: i, key: fmt.Sprint(i % 4)}); err != nil {
				t.Fatal(err)
			}
			synctest.Wait()
		}
		if err := p.TrySubmit(&kitem{id: 6, key: "new"}); !errors.Is(err, ErrFull) {
			t.Fatalf("TrySubmit on a full keyed stage: %v, want ErrFull", err)
		}
		done := make(chan error)
		go func() { done <- p.Submit(ctx, &kitem{id: 7, key: "other"}) }()
		synctest.Wait()
		select {
		case err := <-done:
			t.Fatalf("Submit returned %v on a full stage", err)
		default:
		}
		time.Sleep(time.Second)
		if got := testutil.ToFloat64(prometheusGauge(t, reg, "kvflow_stage_queue_depth", "k")); got != 4 {
			t.Fatalf("depth %v, want 4", got)
		}
		close(release)
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if err := p.Close(ctx); err != nil {
			t.Fatal(err)
		}
	})
}

// TestKeyedMaxKeys: items naming more distinct keys than MaxKeys are
// refused with ErrTooManyKeys (and the key count), never queued.
func TestKeyedMaxKeys(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		release := make(chan struct{})
		var mu sync.Mutex
		var refused []Result[*kitem]
		p := keyedChain(t, nil, StageConfig[*kitem]{Workers: 2, Capacity: 64, MaxKeys: 3,
			Stage: StageFunc[*kitem](func(ctx context.Context, it *kitem) error { <-release; return nil })},
			func(r Result[*kitem]) {
				if r.Err != nil {
					mu.Lock()
					refused = append(refused, r)
					mu.Unlock()
				}
			})
		ctx := context.Background()
		for i := range 1000 {
			if err := p.Submit(ctx, &kitem{id: i, key: fmt.Sprint("peer-", i)}); err != nil {
				t.Fatal(err)
			}
		}
		synctest.Wait()
		mu.Lock()
		if len(refused) != 997 {
			t.Fatalf("%d refused, want 997", len(refused))
		}
		for _, r := range refused {
			if !errors.Is(r.Err, ErrTooManyKeys) || !strings.Contains(r.Err.Error(), "3 keys waiting or running, max 3") {
				t.Fatalf("refusal: %v", r.Err)
			}
		}
		mu.Unlock()
		close(release)
		p.Close(ctx)
	})
}

// TestKeyedCloseDeadline: items waiting in key queues when Close's
// deadline passes end as Canceled, each once.
func TestKeyedCloseDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := map[int]int{}
		var mu sync.Mutex
		var outcomes [3]int
		p := keyedChain(t, nil, StageConfig[*kitem]{Workers: 2, Capacity: 32, KeyWorkers: 1,
			Stage: StageFunc[*kitem](func(ctx context.Context, it *kitem) error {
				<-ctx.Done()
				return ctx.Err()
			})},
			func(r Result[*kitem]) { mu.Lock(); c[r.Item.id]++; outcomes[r.Outcome]++; mu.Unlock() })
		for i := range 20 {
			if err := p.Submit(context.Background(), &kitem{id: i, key: fmt.Sprint(i % 3)}); err != nil {
				t.Fatal(err)
			}
		}
		synctest.Wait()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if err := p.Close(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Close: %v", err)
		}
		if len(c) != 20 || outcomes[Canceled] != 20 {
			t.Fatalf("results %v, outcomes %v", c, outcomes)
		}
		for id, n := range c {
			if n != 1 {
				t.Fatalf("item %d ended %d times", id, n)
			}
		}
	})
}

func TestKeyedValidate(t *testing.T) {
	st := StageFunc[*kitem](func(context.Context, *kitem) error { return nil })
	key := func(it *kitem) string { return it.key }
	cases := []struct {
		name string
		sc   StageConfig[*kitem]
		want string
	}{
		{"options without key", StageConfig[*kitem]{KeyWorkers: 2}, "without a key"},
		{"key workers above workers", StageConfig[*kitem]{Key: key, KeyWorkers: 5}, "key workers must be"},
		{"key queue above capacity", StageConfig[*kitem]{Key: key, KeyQueue: 9}, "key queue must be"},
		{"negative stall", StageConfig[*kitem]{Key: key, KeyStall: -1}, "key stall"},
		{"negative max keys", StageConfig[*kitem]{Key: key, MaxKeys: -1}, "max keys"},
		{"key park below -1", StageConfig[*kitem]{Key: key, KeyPark: -2}, "key park"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sc := tc.sc
			sc.Name, sc.Workers, sc.Capacity, sc.Stage = "k", 4, 8, st
			p, err := New(Config[*kitem]{Stages: []StageConfig[*kitem]{sc}, Sink: func(Result[*kitem]) {}})
			if err == nil {
				p.Close(context.Background())
				t.Fatal("accepted")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%v, want %q", err, tc.want)
			}
		})
	}
}

// keyedProperties runs one randomized keyed pipeline and checks that every
// item ends exactly once, that each key's items start in the order they
// were submitted (with KeyWorkers 1), and that no more than KeyWorkers items of one key run at
// once.
func keyedProperties(t *testing.T, seed uint64, items, keys, workers, keyWorkers, capacity, keyQueue, keyPark int) {
	rng := rand.New(rand.NewPCG(seed, 7))
	var mu sync.Mutex
	running := map[string]int{}
	next := map[string]int{} // next sequence number expected to start, per key
	seq := make([]int, items)
	perKey := map[string]int{}
	keyOf := make([]string, items)
	for i := range items {
		k := fmt.Sprint("k", rng.IntN(keys))
		keyOf[i] = k
		seq[i] = perKey[k]
		perKey[k]++
	}
	failEvery := 1 + rng.IntN(5)
	ended := make([]int, items)
	var problems []string
	stage := StageFunc[*kitem](func(ctx context.Context, it *kitem) error {
		mu.Lock()
		running[it.key]++
		if running[it.key] > keyWorkers {
			problems = append(problems, fmt.Sprintf("%d items of %s running, limit %d", running[it.key], it.key, keyWorkers))
		}
		// Items are taken in order; with one slot per key they also start
		// in order (with more, two workers race from take to Process).
		if keyWorkers == 1 && seq[it.id] != next[it.key] {
			problems = append(problems, fmt.Sprintf("item %d of %s started as #%d, want #%d", it.id, it.key, seq[it.id], next[it.key]))
		}
		next[it.key]++
		mu.Unlock()
		if it.id%7 == 0 {
			runtime.Gosched()
		}
		mu.Lock()
		running[it.key]--
		mu.Unlock()
		if it.id%failEvery == 0 {
			return errors.New("boom")
		}
		return nil
	})
	p, err := New(Config[*kitem]{
		Stages: []StageConfig[*kitem]{
			{Name: "k", Workers: workers, Capacity: capacity, Key: func(it *kitem) string { return it.key },
				KeyWorkers: keyWorkers, KeyQueue: keyQueue, KeyPark: keyPark, Stage: stage},
			{Name: "after", Workers: 2, Capacity: 2, SeesFailed: true, Stage: StageFunc[*kitem](func(context.Context, *kitem) error { return nil })},
		},
		Sink: func(r Result[*kitem]) { mu.Lock(); ended[r.Item.id]++; mu.Unlock() },
	})
	if err != nil {
		t.Fatal(err)
	}
	// One submitter: per-key FIFO is the submission order.
	for i := range items {
		if err := p.Submit(context.Background(), &kitem{id: i, key: keyOf[i]}); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	for i, n := range ended {
		if n != 1 {
			problems = append(problems, fmt.Sprintf("item %d ended %d times", i, n))
		}
	}
	if len(problems) > 0 {
		t.Fatalf("seed %d: %s", seed, strings.Join(problems[:min(len(problems), 5)], "; "))
	}
}

// TestKeyedProperties: randomized shapes (see keyedProperties).
func TestKeyedProperties(t *testing.T) {
	for seed := range uint64(30) {
		rng := rand.New(rand.NewPCG(seed, 1))
		workers := 1 + rng.IntN(6)
		capacity := 1 + rng.IntN(16)
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			kw := 1 + rng.IntN(workers)
			if seed%2 == 0 {
				kw = 1 // FIFO checked
			}
			keyedProperties(t, seed, 200+rng.IntN(400), 1+rng.IntN(12), workers, kw, capacity, 1+rng.IntN(capacity), rng.IntN(capacity+2)-1)
		})
	}
}

// FuzzKeyed drives keyedProperties with fuzzed shapes.
func FuzzKeyed(f *testing.F) {
	f.Add(uint64(1), uint8(50), uint8(3), uint8(4), uint8(2), uint8(8), uint8(4), uint8(0))
	f.Add(uint64(2), uint8(200), uint8(1), uint8(1), uint8(1), uint8(1), uint8(1), uint8(1))
	f.Add(uint64(3), uint8(250), uint8(2), uint8(3), uint8(1), uint8(4), uint8(1), uint8(9))
	f.Fuzz(func(t *testing.T, seed uint64, items, keys, workers, keyWorkers, capacity, keyQueue, keyPark uint8) {
		w := 1 + int(workers)%8
		c := 1 + int(capacity)%32
		keyedProperties(t, seed, 1+int(items), 1+int(keys)%20, w, 1+int(keyWorkers)%w, c, 1+int(keyQueue)%c, int(keyPark)%40-1)
	})
}

// keyedRun collects a keyed chain's results.
type keyedRun struct {
	mu  sync.Mutex
	got []Result[*kitem]
}

func (r *keyedRun) sink(res Result[*kitem]) { r.mu.Lock(); r.got = append(r.got, res); r.mu.Unlock() }

func (r *keyedRun) results() []Result[*kitem] {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Result[*kitem](nil), r.got...)
}

// wedgedStage: items of key "slow" wait for release (or the pipeline's
// cancellation), but for those numbered 2000 and up, which take own; the
// others take d each (fake time under synctest).
func wedgedStage(release <-chan struct{}, d, own time.Duration) StageFunc[*kitem] {
	return func(ctx context.Context, it *kitem) error {
		if it.key == "slow" && it.id >= 2000 {
			time.Sleep(own)
			return nil
		}
		if it.key == "slow" {
			select {
			case <-release:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		time.Sleep(d)
		return nil
	}
}

// TestKeyedParkedNotHeld: a wedged key's overflow within the park budget
// is parked: the sender goes on at once (no fake time passes), an item of
// another key sent after them all ends first, and nothing is refused, even
// long after the stall time; when the key recovers, every parked item runs,
// in order.
func TestKeyedParkedNotHeld(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		release := make(chan struct{})
		var run keyedRun
		var mu sync.Mutex
		var order []int
		st := wedgedStage(release, 0, 0)
		p := keyedChain(t, nil, StageConfig[*kitem]{Workers: 4, Capacity: 16, KeyWorkers: 1, KeyQueue: 8, KeyPark: 20, KeyStall: time.Second,
			Stage: StageFunc[*kitem](func(ctx context.Context, it *kitem) error {
				if it.key == "slow" {
					mu.Lock()
					order = append(order, it.id)
					mu.Unlock()
				}
				return st(ctx, it)
			})}, run.sink)
		ctx := context.Background()
		start := time.Now()
		for i := range 29 { // 1 running, 8 waiting, 20 parked
			if err := p.Submit(ctx, &kitem{id: i, key: "slow"}); err != nil {
				t.Fatal(err)
			}
		}
		if err := p.Submit(ctx, &kitem{id: 100, key: "fast"}); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		got := run.results()
		if len(got) != 1 || got[0].Item.key != "fast" || got[0].Outcome != Done {
			t.Fatalf("results %+v, want the fast item done", got)
		}
		if d := time.Since(start); d != 0 {
			t.Fatalf("the fast item waited %v behind the wedged key", d)
		}
		time.Sleep(10 * time.Second) // far past the stall: parked items are never refused
		synctest.Wait()
		if n := len(run.results()); n != 1 {
			t.Fatalf("%d results while wedged, want 1", n)
		}
		close(release)
		if err := p.Close(ctx); err != nil {
			t.Fatal(err)
		}
		for _, r := range run.results() {
			if r.Outcome != Done {
				t.Fatalf("%d: %v %v", r.Item.id, r.Outcome, r.Err)
			}
		}
		for i, id := range order {
			if id != i {
				t.Fatalf("slow items started in order %v", order)
			}
		}
	})
}

// TestKeyedAdaptiveStall: a key is stalled after KeyStallFactor times the
// recent service time (its own; the stage's while it has none), within
// [MinKeyStall, KeyStall]; only then, and only beyond the park budget, are
// its items refused.
func TestKeyedAdaptiveStall(t *testing.T) {
	cases := []struct {
		name    string
		history time.Duration // service time of the stage's earlier items
		own     time.Duration // of the key's first 5 items (0: none)
		stall   time.Duration
		want    time.Duration // when the overflow is refused
	}{
		{"no history: KeyStall", 0, 0, 10 * time.Second, 10 * time.Second},
		{"fast stage: floor", time.Millisecond, 0, 10 * time.Second, MinKeyStall},
		{"slower stage: factor", 20 * time.Millisecond, 0, 10 * time.Second, KeyStallFactor * 20 * time.Millisecond},
		{"slow stage: KeyStall", 2 * time.Second, 0, 10 * time.Second, 10 * time.Second},
		// One item of the key wedges (keeping the key), its next 5 take
		// 100 ms each, one at a time, ending at 100..500 ms; then its
		// overflow is refused 8 x 100 ms after its last good end (not
		// 8 x the stage's 1 ms).
		{"key's own history", time.Millisecond, 100 * time.Millisecond, 10 * time.Second, 500*time.Millisecond + KeyStallFactor*100*time.Millisecond},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				release := make(chan struct{})
				var run keyedRun
				p := keyedChain(t, nil, StageConfig[*kitem]{Workers: 4, Capacity: 8, KeyWorkers: 2, KeyQueue: 4, KeyPark: 4, KeyStall: tc.stall,
					Stage: wedgedStage(release, tc.history, tc.own)}, run.sink)
				ctx := context.Background()
				if tc.history > 0 {
					for i := range 20 {
						if err := p.Submit(ctx, &kitem{id: 1000 + i, key: "a"}); err != nil {
							t.Fatal(err)
						}
					}
					time.Sleep(time.Minute)
					synctest.Wait()
				}
				start := time.Now()
				wantRefused := 10
				if tc.own > 0 {
					for _, id := range []int{500, 2000, 2001, 2002, 2003, 2004} {
						if err := p.Submit(ctx, &kitem{id: id, key: "slow"}); err != nil {
							t.Fatal(err)
						}
					}
					time.Sleep(time.Second)
					synctest.Wait()
					wantRefused = 11 // item 500 is one of the 2 running
				}
				for i := range 20 { // 2 running, 4 waiting, 4 parked, 10 refused
					if err := p.Submit(ctx, &kitem{id: i, key: "slow"}); err != nil {
						t.Fatal(err)
					}
				}
				var at time.Duration
				for {
					synctest.Wait()
					n := 0
					for _, r := range run.results() {
						if errors.Is(r.Err, ErrKeyStalled) {
							n++
						}
					}
					if n > 0 {
						if n != wantRefused {
							t.Fatalf("%d refused at once, want %d", n, wantRefused)
						}
						at = time.Since(start)
						break
					}
					time.Sleep(time.Millisecond)
				}
				if at < tc.want || at > tc.want+time.Millisecond {
					t.Fatalf("refused after %v, want %v", at, tc.want)
				}
				close(release)
				if err := p.Close(ctx); err != nil {
					t.Fatal(err)
				}
			})
		})
	}
}

// TestKeyedBusyKeyBlocks: one busy key (every item takes a while, none
// wedged), far more items than its queue and park budget: the sender
// blocks (backpressure), and nothing is refused: the key makes progress
// well within KeyStallFactor times its service time.
func TestKeyedBusyKeyBlocks(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var run keyedRun
		p := keyedChain(t, nil, StageConfig[*kitem]{Workers: 2, Capacity: 4, KeyQueue: 2, KeyPark: 2, KeyStall: time.Second,
			Stage: StageFunc[*kitem](func(ctx context.Context, it *kitem) error {
				time.Sleep(time.Duration(1+it.id%5) * 10 * time.Millisecond)
				return nil
			})}, run.sink)
		ctx := context.Background()
		for i := range 300 {
			if err := p.Submit(ctx, &kitem{id: i, key: "busy"}); err != nil {
				t.Fatal(err)
			}
		}
		if err := p.Close(ctx); err != nil {
			t.Fatal(err)
		}
		got := run.results()
		if len(got) != 300 {
			t.Fatalf("%d results, want 300", len(got))
		}
		for _, r := range got {
			if r.Outcome != Done {
				t.Fatalf("%d: %v %v", r.Item.id, r.Outcome, r.Err)
			}
		}
	})
}
