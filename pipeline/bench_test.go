package pipeline

import (
	"context"
	"sync"
	"testing"
)

const benchStages, benchWorkers, benchCapacity = 5, 1, 64

// BenchmarkChain measures the per-item cost of a 5-stage no-op pipeline
// ("pipeline") against a hand-written chain of goroutines and channels with
// the same stage count, workers and capacities ("handwritten").
func BenchmarkChain(b *testing.B) {
	b.Run("pipeline", func(b *testing.B) {
		var stages []StageConfig[int]
		for i := range benchStages {
			stages = append(stages, StageConfig[int]{Name: string(rune('a' + i)), Workers: benchWorkers, Capacity: benchCapacity,
				Stage: StageFunc[int](func(context.Context, int) error { return nil })})
		}
		var wg sync.WaitGroup
		p, err := New(Config[int]{Stages: stages, Sink: func(Result[int]) { wg.Done() }})
		if err != nil {
			b.Fatal(err)
		}
		ctx := context.Background()
		wg.Add(b.N)
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			p.Submit(ctx, i)
		}
		wg.Wait()
		b.StopTimer()
		p.Close(ctx)
	})
	b.Run("handwritten", func(b *testing.B) {
		chans := make([]chan int, benchStages+1)
		for i := range chans {
			chans[i] = make(chan int, benchCapacity)
		}
		workers := make([]sync.WaitGroup, benchStages)
		for s := range benchStages {
			for range benchWorkers {
				workers[s].Add(1)
				go func() {
					defer workers[s].Done()
					for v := range chans[s] {
						chans[s+1] <- v
					}
				}()
			}
		}
		var wg sync.WaitGroup
		wg.Add(b.N)
		go func() {
			for range chans[benchStages] {
				wg.Done()
			}
		}()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			chans[0] <- i
		}
		wg.Wait()
		b.StopTimer()
		for s := range benchStages {
			close(chans[s])
			workers[s].Wait()
		}
		close(chans[benchStages])
	})
}

// BenchmarkKeyedStage compares one no-op stage, keyed (4 keys, round
// robin) and unkeyed, with the same workers and capacity: the keyed
// path's cost per item (a mutex, a condition variable and a slot per
// key). kvflow keys only stages whose items wait on a peer for a
// millisecond or more.
func BenchmarkKeyedStage(b *testing.B) {
	for _, keys := range []int{0, 4, 1} {
		name := "unkeyed"
		switch keys {
		case 4:
			name = "keyed"
		case 1:
			name = "keyed-1key" // one busy key: its queue fills, senders block or park
		}
		b.Run(name, func(b *testing.B) {
			sc := StageConfig[int]{Name: "s", Workers: 2, Capacity: benchCapacity,
				Stage: StageFunc[int](func(context.Context, int) error { return nil })}
			switch keys {
			case 4:
				sc.Key = func(i int) string { return keys4[i&3] }
			case 1:
				sc.Key = func(int) string { return "a" }
				sc.KeyQueue = max(1, benchCapacity/2)
			}
			var wg sync.WaitGroup
			p, err := New(Config[int]{Stages: []StageConfig[int]{sc}, Sink: func(Result[int]) { wg.Done() }})
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			wg.Add(b.N)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				p.Submit(ctx, i)
			}
			wg.Wait()
			b.StopTimer()
			p.Close(ctx)
		})
	}
}

var keys4 = [4]string{"a", "b", "c", "d"}
