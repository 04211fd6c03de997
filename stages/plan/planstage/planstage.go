package planstage

import (
	"context"
	"fmt"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

// Stage plans jobs for one decode worker.
type Stage struct {
	Topology plan.Topology
	Self     plan.Rank
}

// Process sets j.Plan (Plan).
func (s Stage) Process(ctx context.Context, j *job.Job) error {
	return Plan(s.Topology, s.Self, j)
}

// Plan sets j.Plan and sizes j.Metas for it, unless j was planned already
// (the decode worker plans a request at admission to lease it at once;
// the stage then has nothing left to do).
func Plan(topo plan.Topology, self plan.Rank, j *job.Job) error {
	if j.Plan.Tasks != nil {
		return nil
	}
	p, err := plan.PlanRequest(topo, self, j.Req)
	if err != nil {
		return fmt.Errorf("plan request %q: %w", j.Req.ID, err)
	}
	j.Plan = p
	j.Metas = make([]job.Meta, len(p.Tasks))
	return nil
}
