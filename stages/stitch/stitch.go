package stitch

import (
	"context"
	"fmt"

	"github.com/kvflow/kvflow/stages/job"
)

// Kernel reorders blocks in place (hw/npu's Device.Stitch).
type Kernel interface {
	Stitch(ctx context.Context, blockIDs []int, p int) error
}

// Stage is the stitch stage.
type Stage struct{ Kernel Kernel }

// Validator checks a stitch request without touching memory (hw/npu's
// Host.ValidateStitch). A Kernel that has it validates the jobs the read
// stage landed stitched too, so they fail exactly as unfused ones would
// (a block listed twice, heads that do not split into P).
type Validator interface {
	ValidateStitch(blockIDs []int, p int) error
}

// Process stitches j's blocks when its plan needs it and the read stage
// did not already land them stitched (job.Job.Stitched; those are only
// validated).
func (s Stage) Process(ctx context.Context, j *job.Job) error {
	if !j.Plan.Stitch || j.Plan.P <= 1 {
		return nil
	}
	blocks := j.StitchBlocks()
	if j.Stitched {
		if v, ok := s.Kernel.(Validator); ok && len(blocks) > 0 {
			if err := v.ValidateStitch(blocks, j.Plan.P); err != nil {
				return fmt.Errorf("stitch (fused into the read) %d blocks, P=%d: %w", len(blocks), j.Plan.P, err)
			}
		}
		return nil
	}
	if len(blocks) == 0 {
		return nil
	}
	ctx, stop := j.Context(ctx)
	defer stop()
	if err := s.Kernel.Stitch(ctx, blocks, j.Plan.P); err != nil {
		return fmt.Errorf("stitch %d blocks, P=%d: %w", len(blocks), j.Plan.P, err)
	}
	return nil
}
