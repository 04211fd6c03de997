package stitch

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

type kernel struct {
	calls [][]int
	p     int
	err   error
}

func (k *kernel) Stitch(_ context.Context, blocks []int, p int) error {
	k.calls = append(k.calls, slices.Clone(blocks))
	k.p = p
	return k.err
}

// TestProcess: the kernel runs once over the job's distinct local blocks
// when the plan needs a stitch and the read stage did not already land
// the blocks stitched; never otherwise. A kernel error fails the job.
func TestProcess(t *testing.T) {
	mk := func(p int, stitch, stitched bool) *job.Job {
		j := job.New(plan.Request{ID: "r"}, time.Unix(0, 0))
		j.Plan = plan.Plan{P: p, Stitch: stitch}
		for q := range p {
			j.Plan.Tasks = append(j.Plan.Tasks, plan.Task{P: p, HeadSlot: q, LocalBlockIDs: []int{3, 1, 3}})
		}
		j.Stitched = stitched
		return j
	}
	for _, c := range []struct {
		name string
		j    *job.Job
		want [][]int
	}{
		{"P 2", mk(2, true, false), [][]int{{3, 1}}},
		{"fused into the read", mk(2, true, true), nil},
		{"P 1", mk(1, false, false), nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			k := &kernel{}
			if err := (Stage{Kernel: k}).Process(context.Background(), c.j); err != nil {
				t.Fatal(err)
			}
			if !slices.EqualFunc(k.calls, c.want, slices.Equal) {
				t.Fatalf("kernel calls %v, want %v", k.calls, c.want)
			}
		})
	}
	boom := errors.New("boom")
	if err := (Stage{Kernel: &kernel{err: boom}}).Process(context.Background(), mk(2, true, false)); !errors.Is(err, boom) {
		t.Fatalf("got %v, want the kernel's error", err)
	}
}
