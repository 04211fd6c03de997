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

// Process stitches j's blocks when its plan needs it and the read stage
// did not already land them stitched (job.Job.Stitched).
func (s Stage) Process(ctx context.Context, j *job.Job) error {
	if !j.Plan.Stitch || j.Plan.P <= 1 || j.Stitched {
		return nil
	}
	blocks := j.StitchBlocks()
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
