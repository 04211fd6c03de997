package decode

import (
	"context"

	"github.com/kvflow/kvflow/pipeline"
	"github.com/kvflow/kvflow/stages/job"
)

// What a stage may do besides Process, each written in the stage that
// does it; the worker only calls them, in the chain's order.
type (
	// admitter acts on a request as the worker admits it, on the
	// caller's goroutine before it is submitted (the plan stage plans and
	// leases it), and forgets it if it is not submitted after all.
	admitter interface {
		Admit(j *job.Job)
		Unadmit(j *job.Job)
	}
	// ender acts on a request that ended, before the worker records its
	// result (the plan stage drops its leases; notify owes the DONEs of
	// a request canceled before it).
	ender interface {
		End(r pipeline.Result[*job.Job])
	}
	// closer shuts the stage down once the pipeline is closed (notify
	// sends the DONEs owed; the plan stage stops its fetches and
	// renewals). Stages close last first.
	closer interface {
		Close(ctx context.Context)
	}
)

// hooks are the chain's stages' hooks, in chain order.
type hooks struct {
	admitters []admitter
	enders    []ender
	closers   []closer
}

func (h *hooks) add(st pipeline.Stage[*job.Job]) {
	if a, ok := st.(admitter); ok {
		h.admitters = append(h.admitters, a)
	}
	if e, ok := st.(ender); ok {
		h.enders = append(h.enders, e)
	}
	if c, ok := st.(closer); ok {
		h.closers = append(h.closers, c)
	}
}

func (h *hooks) admit(j *job.Job) {
	for _, a := range h.admitters {
		a.Admit(j)
	}
}

func (h *hooks) unadmit(j *job.Job) {
	for _, a := range h.admitters {
		a.Unadmit(j)
	}
}

func (h *hooks) end(r pipeline.Result[*job.Job]) {
	for _, e := range h.enders {
		e.End(r)
	}
}

// close closes the stages, last first.
func (h *hooks) close(ctx context.Context) {
	for i := len(h.closers) - 1; i >= 0; i-- {
		h.closers[i].Close(ctx)
	}
}
