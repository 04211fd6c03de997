package notify

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/pipeline"
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

// Deps is what the notify stage works with.
type Deps struct {
	Sender     Sender
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// Stage is the notify stage.
type Stage struct {
	s   Sender
	bs  BatchSender // s, when it batches; nil otherwise
	cfg Config
	log *slog.Logger
	m   *metrics

	mu sync.Mutex
	// owed: requests canceled at shutdown before any DONE of theirs could
	// have left (End); Close sends their DONEs.
	owed []owed
}

// metrics are the notify stage's.
type metrics struct {
	sent, undelivered prometheus.Counter
	// skipped: DONEs not sent because the rank restarted since the
	// request was handed over (job.Job.OwesDone).
	skipped prometheus.Counter
	// refused: DONEs not sent because the rank's side-channel port
	// refused this request's GET_META connection (doneAfter).
	refused prometheus.Counter
	batched prometheus.Counter
	// shutdownDones keeps the name it had when the decode role sent
	// these DONEs itself.
	shutdownDones *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{}
	dones := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_notify_done_messages_total",
		Help: "DONE_RECVINGs (one per request and remote task, plain or in a batch) by result (acked, undelivered, skipped_restarted: not sent, the rank restarted since it handed the request over; skipped_refused: not sent, the rank's side-channel port refused the request's handshake).",
	}, []string{"result"})
	m.sent, m.undelivered = dones.WithLabelValues("acked"), dones.WithLabelValues("undelivered")
	m.skipped = dones.WithLabelValues("skipped_restarted")
	m.refused = dones.WithLabelValues("skipped_refused")
	m.batched = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_notify_batched_dones_total",
		Help: "DONE_RECVINGs sent through batched done_batch_msg (peers advertising batch_done), whatever their result; messages and ids per message are in kvflow_sidechannel_done_batch_ids.",
	})
	m.shutdownDones = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_decode_shutdown_dones_total",
		Help: "DONEs sent at shutdown for requests canceled before their notify stage (the prefill then frees their blocks at once), by result (acked, failed).",
	}, []string{"result"})
	for _, r := range []string{"acked", "failed"} {
		m.shutdownDones.WithLabelValues(r)
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{dones, m.batched, m.shutdownDones} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("notify: register metrics: %w", err)
			}
		}
	}
	return m, nil
}

// New makes the stage. The zero Config is DefaultConfig.
func New(cfg Config, d Deps) (*Stage, error) {
	if d.Sender == nil {
		return nil, errors.New("notify: nil sender")
	}
	if cfg == (Config{}) {
		cfg = DefaultConfig()
	}
	log := d.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m, err := newMetrics(d.Registerer)
	if err != nil {
		return nil, err
	}
	st := &Stage{s: d.Sender, cfg: cfg, log: log.With("component", "stage/notify"), m: m}
	st.bs, _ = d.Sender.(BatchSender)
	return st, nil
}

// Process notifies after a successful job.
func (s *Stage) Process(ctx context.Context, j *job.Job) error {
	s.notify(ctx, j, nil)
	return nil
}

// ProcessFailed notifies after a failed job too: the prefill side must free
// its blocks. The job's cause is kept; notify adds no error of its own.
func (s *Stage) ProcessFailed(ctx context.Context, j *job.Job, cause error) error {
	s.notify(ctx, j, cause)
	return nil
}

// How the DONE to one rank goes out after a job's failure (doneAfter).
const (
	doneSend = iota // with the client's attempts, as after a success
	doneOnce        // one attempt: the rank's side channel did not answer this job's GET_META
	doneSkip        // not at all: the rank's side-channel port refused this job's connection
)

// doneAfter is how the DONE to endpoint goes out after cause, the job's
// failure. A rank whose port refused the connection (job.ErrRefused) gets
// none: nothing listens there, so nothing there holds the blocks (a
// restarted prefill does not know the requests its predecessor held). A
// rank whose side channel answered none of the GET_META's attempts
// (job.ErrNoReply) gets one attempt, not all: the request does not wait
// out the same timeouts twice, while a rank that came back meanwhile
// still frees its blocks at once (one that misses it frees them at its
// abort timeout; no lease was taken, the handshake failed). Any other
// cause, or a rank whose handshake went well, gets every attempt.
func doneAfter(cause error, endpoint string) int {
	how := doneSend
	for _, pe := range job.Blame(cause) {
		if pe.Hop != job.HopHandshake || pe.Endpoint != endpoint {
			continue
		}
		switch {
		case errors.Is(pe.Err, job.ErrRefused):
			return doneSkip
		case errors.Is(pe.Err, job.ErrNoReply):
			how = doneOnce
		}
	}
	return how
}

func (s *Stage) notify(ctx context.Context, j *job.Job, cause error) {
	if len(j.Plan.Tasks) == 0 {
		return // failed before planning: no remote rank knows of it
	}
	// Not bound to the job's abort: an aborted job must still free the
	// prefill side's blocks.
	ctx, cancel := context.WithTimeout(ctx, s.cfg.JobTimeout())
	defer cancel()
	var wg sync.WaitGroup
	for i := range j.Plan.Tasks {
		if !j.OwesDone(i) {
			// The rank restarted since the request was handed over: the
			// process answering never held it (job.Job.OwesDone).
			s.m.skipped.Inc()
			s.log.Info("DONE not sent: prefill restarted since the request was handed over", "request_id", j.Req.ID,
				"endpoint", j.HandshakeEndpoint(i), "task", i, "boot_epoch", j.Metas[i].BootEpoch, "request_boot_epoch", j.RequestEpoch(i))
			continue
		}
		ep := j.HandshakeEndpoint(i)
		how := doneAfter(cause, ep)
		if how == doneSkip {
			s.m.refused.Inc()
			s.log.Info("DONE not sent: the rank's side-channel port refused this request's connection",
				"request_id", j.Req.ID, "endpoint", ep, "task", i)
			continue
		}
		send := s.s.SendDone
		// Metas is short when the job failed before its handshake ended:
		// those ranks get plain DONEs.
		if s.bs != nil && i < len(j.Metas) && j.Metas[i].BatchDone {
			send = s.bs.SendDoneBatched
			s.m.batched.Inc()
		}
		wg.Go(func() {
			ctx := ctx
			if how == doneOnce {
				// One attempt and half its backoff: the retry never starts.
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, s.cfg.Timeout.D()+s.cfg.RetryBackoff.D()/2)
				defer cancel()
			}
			if err := send(ctx, ep, j.Req.ID); err != nil {
				s.m.undelivered.Inc()
				j.DoneUndelivered.Add(1)
				s.log.Warn("DONE not delivered", "request_id", j.Req.ID, "endpoint", ep, "task", i, "err", err)
				return
			}
			s.m.sent.Inc()
		})
	}
	wg.Wait()
}

// owed names the DONEs a request canceled at shutdown still owes.
type owed struct {
	id        string
	endpoints []string
}

// End is the stage's word on a request that ended (the decode worker's
// sink calls it for every request, in stage order, so the plan stage has
// planned a request canceled before it was planned). A request canceled
// (by the worker's Close, past its drain deadline) in a stage before
// notify has sent no DONE, and its reads have stopped (a canceled batch
// returns only once the engine no longer touches its memory), so its
// DONEs are safe to send: they are owed, and Close sends them. One
// canceled in notify itself may have delivered some already (a DONE
// counted twice could free a block another decode rank still reads): it
// owes none.
func (s *Stage) End(r pipeline.Result[*job.Job]) {
	j := r.Item
	if r.Outcome != pipeline.Canceled || r.Stage == "notify" || j.Plan.Tasks == nil {
		return
	}
	// One DONE per task, as notify sends: the prefill rank counts them
	// (plan.PrefillExpectedDones counts tasks).
	o := owed{id: j.Req.ID}
	for i := range j.Plan.Tasks {
		if !j.OwesDone(i) {
			continue // as notify: never a DONE to a process that did not hold it
		}
		o.endpoints = append(o.endpoints, j.HandshakeEndpoint(i))
	}
	s.mu.Lock()
	s.owed = append(s.owed, o)
	s.mu.Unlock()
}

// ReleaseTimeout bounds the DONEs Close sends for requests canceled at
// shutdown, beyond Close's own context (which has usually ended by then).
var ReleaseTimeout = 2 * time.Second

// Close sends the DONEs owed by requests canceled at shutdown (End), at
// most 16 at a time, within ReleaseTimeout, so the prefill frees those
// blocks now rather than at its abort timeout. A prefill that misses one
// frees those blocks at its abort timeout (or lease expiry), as it would
// have anyway. Call it once the pipeline is closed.
func (s *Stage) Close(ctx context.Context) {
	s.mu.Lock()
	rel := s.owed
	s.owed = nil
	s.mu.Unlock()
	if len(rel) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ReleaseTimeout)
	defer cancel()
	var g errgroup.Group
	g.SetLimit(16)
	var acked, failed atomic.Int64
	for _, r := range rel {
		for _, ep := range r.endpoints {
			g.Go(func() error {
				if err := s.s.SendDone(ctx, ep, r.id); err != nil {
					failed.Add(1)
				} else {
					acked.Add(1)
				}
				return nil
			})
		}
	}
	g.Wait()
	s.m.shutdownDones.WithLabelValues("acked").Add(float64(acked.Load()))
	s.m.shutdownDones.WithLabelValues("failed").Add(float64(failed.Load()))
	s.log.Info("sent DONEs for requests canceled at shutdown", "requests", len(rel), "acked", acked.Load(), "failed", failed.Load())
}
