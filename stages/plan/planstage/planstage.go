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

// Process sets j.Plan.
func (s Stage) Process(ctx context.Context, j *job.Job) error {
	p, err := plan.PlanRequest(s.Topology, s.Self, j.Req)
	if err != nil {
		return fmt.Errorf("plan request %q: %w", j.Req.ID, err)
	}
	j.Plan = p
	j.Metas = make([]job.Meta, len(p.Tasks))
	return nil
}
