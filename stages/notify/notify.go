package notify

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/stages/job"
)

// Sender sends DONE_RECVING for reqID to the side channel at endpoint and
// waits for the ACK.
type Sender interface {
	SendDone(ctx context.Context, endpoint, reqID string) error
}

// Options configures the stage.
type Options struct {
	// Timeout bounds the DONE/ACK exchanges of one job. 5 s: the side
	// channel client retries 3 × 1 s; the job's bytes are already in place.
	Timeout    time.Duration
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// Stage is the notify stage.
type Stage struct {
	s    Sender
	opts Options
	log  *slog.Logger

	sent, undelivered prometheus.Counter
}

// New makes the stage.
func New(s Sender, opts Options) (*Stage, error) {
	if opts.Timeout <= 0 {
		opts.Timeout = 5 * time.Second
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	st := &Stage{s: s, opts: opts, log: log.With("component", "stage/notify")}
	dones := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_notify_done_messages_total",
		Help: "DONE_RECVING messages by result (acked, undelivered).",
	}, []string{"result"})
	st.sent, st.undelivered = dones.WithLabelValues("acked"), dones.WithLabelValues("undelivered")
	if opts.Registerer != nil {
		if err := opts.Registerer.Register(dones); err != nil {
			return nil, err
		}
	}
	return st, nil
}

// Process notifies after a successful job.
func (s *Stage) Process(ctx context.Context, j *job.Job) error {
	s.notify(ctx, j)
	return nil
}

// ProcessFailed notifies after a failed job too: the prefill side must free
// its blocks. The job's cause is kept; notify adds no error of its own.
func (s *Stage) ProcessFailed(ctx context.Context, j *job.Job, cause error) error {
	s.notify(ctx, j)
	return nil
}

func (s *Stage) notify(ctx context.Context, j *job.Job) {
	if len(j.Plan.Tasks) == 0 {
		return // failed before planning: no remote rank knows of it
	}
	// Not bound to the job's abort: an aborted job must still free the
	// prefill side's blocks.
	ctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	var wg sync.WaitGroup
	for i := range j.Plan.Tasks {
		ep := j.HandshakeEndpoint(i)
		wg.Go(func() {
			if err := s.s.SendDone(ctx, ep, j.Req.ID); err != nil {
				s.undelivered.Inc()
				j.DoneUndelivered.Add(1)
				s.log.Warn("DONE not delivered", "request_id", j.Req.ID, "endpoint", ep, "task", i, "err", err)
				return
			}
			s.sent.Inc()
		})
	}
	wg.Wait()
}
