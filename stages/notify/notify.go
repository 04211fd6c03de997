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

// BatchSender is a Sender that can also deliver a DONE in kvflow's batched
// done_batch_msg, shared with other DONEs to the same endpoint (the side
// channel's Client). The stage uses it only for remote ranks whose
// metadata advertised it (job.Meta.BatchDone); a Sender without it (a
// wrapper, a test double) always sends plain DONEs.
type BatchSender interface {
	Sender
	SendDoneBatched(ctx context.Context, endpoint, reqID string) error
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
	bs   BatchSender // s, when it batches; nil otherwise
	opts Options
	log  *slog.Logger

	sent, undelivered prometheus.Counter
	batched           prometheus.Counter
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
	st.bs, _ = s.(BatchSender)
	dones := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_notify_done_messages_total",
		Help: "DONE_RECVINGs (one per request and remote task, plain or in a batch) by result (acked, undelivered).",
	}, []string{"result"})
	st.sent, st.undelivered = dones.WithLabelValues("acked"), dones.WithLabelValues("undelivered")
	st.batched = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_notify_batched_dones_total",
		Help: "DONE_RECVINGs sent through batched done_batch_msg (peers advertising batch_done), whatever their result; messages and ids per message are in kvflow_sidechannel_done_batch_ids.",
	})
	if opts.Registerer != nil {
		for _, c := range []prometheus.Collector{dones, st.batched} {
			if err := opts.Registerer.Register(c); err != nil {
				return nil, err
			}
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
		send := s.s.SendDone
		// Metas is short when the job failed before its handshake ended:
		// those ranks get plain DONEs.
		if s.bs != nil && i < len(j.Metas) && j.Metas[i].BatchDone {
			send = s.bs.SendDoneBatched
			s.batched.Inc()
		}
		wg.Go(func() {
			if err := send(ctx, ep, j.Req.ID); err != nil {
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
