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

// validatingKernel also validates (hw/npu's Host does).
type validatingKernel struct {
	kernel
	validated [][]int
	verr      error
}

func (k *validatingKernel) ValidateStitch(blocks []int, p int) error {
	k.validated = append(k.validated, slices.Clone(blocks))
	return k.verr
}

// A job landed stitched is validated, not stitched, when the kernel can
// validate; an invalid one fails as it would have unfused.
func TestProcessFusedValidates(t *testing.T) {
	j := job.New(plan.Request{ID: "r"}, time.Unix(0, 0))
	j.Plan = plan.Plan{P: 2, Stitch: true, Tasks: []plan.Task{{P: 2, LocalBlockIDs: []int{5, 6}}, {P: 2, HeadSlot: 1, LocalBlockIDs: []int{5, 6}}}}
	j.Stitched = true
	k := &validatingKernel{}
	if err := (Stage{Kernel: k}).Process(context.Background(), j); err != nil {
		t.Fatal(err)
	}
	if len(k.calls) != 0 || len(k.validated) != 1 || !slices.Equal(k.validated[0], []int{5, 6}) {
		t.Fatalf("stitched %v, validated %v", k.calls, k.validated)
	}
	bad := errors.New("heads do not split")
	if err := (Stage{Kernel: &validatingKernel{verr: bad}}).Process(context.Background(), j); !errors.Is(err, bad) {
		t.Fatalf("got %v, want the validation error", err)
	}
}
