package pipeline

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Per-stage outcome label values of kvflow_stage_items_total.
const (
	outcomeOK       = "ok"       // Process returned nil
	outcomeError    = "error"    // Process returned an error (or panicked)
	outcomeSkipped  = "skipped"  // a failed item passed over this healthy-only stage
	outcomeCanceled = "canceled" // the pipeline was canceled while the item was here
)

var stageOutcomes = []string{outcomeOK, outcomeError, outcomeSkipped, outcomeCanceled}

type metrics struct {
	queueDepth    *prometheus.Desc
	queueCapacity *prometheus.Desc
	blocked       *prometheus.Desc
	rejected      *prometheus.CounterVec
	duration      *prometheus.HistogramVec
	items         *prometheus.CounterVec
	busy          *prometheus.Desc
	panics        *prometheus.CounterVec
	inflight      prometheus.GaugeFunc
	results       *prometheus.CounterVec
	latency       *prometheus.HistogramVec
	gauges        *queueCollector
	resultBy      [3]prometheus.Counter
	latencyBy     [3]prometheus.Observer
}

type stageMetrics struct {
	blocked  *blockedClock
	rejected prometheus.Counter
	duration prometheus.Observer
	busy     *atomic.Int64
	panics   prometheus.Counter
	outcomes map[string]prometheus.Counter
	ok, err  prometheus.Counter // outcomes["ok"], outcomes["error"]: the hot ones
}

func (s stageMetrics) outcome(o string) prometheus.Counter {
	switch o {
	case outcomeOK:
		return s.ok
	case outcomeError:
		return s.err
	}
	return s.outcomes[o]
}

// queueCollector reads queue depth from the channels at scrape time.
type queueCollector struct {
	m      *metrics
	stages []queueGauge
}

type queueGauge struct {
	name     string
	capacity int
	depth    func() float64
	blocked  *blockedClock
	busy     *atomic.Int64
}

func (c *queueCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.m.queueDepth
	ch <- c.m.queueCapacity
	ch <- c.m.blocked
	ch <- c.m.busy
}

func (c *queueCollector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range c.stages {
		ch <- prometheus.MustNewConstMetric(c.m.queueDepth, prometheus.GaugeValue, s.depth(), s.name)
		ch <- prometheus.MustNewConstMetric(c.m.queueCapacity, prometheus.GaugeValue, float64(s.capacity), s.name)
		ch <- prometheus.MustNewConstMetric(c.m.blocked, prometheus.CounterValue, s.blocked.seconds(), s.name)
		ch <- prometheus.MustNewConstMetric(c.m.busy, prometheus.GaugeValue, float64(s.busy.Load()), s.name)
	}
}

// DurationBuckets spans 50 µs (a no-op stage) to ~50 s (a large read on a
// slow link).
var DurationBuckets = prometheus.ExponentialBuckets(50e-6, 2.5, 16)

func newMetrics(reg prometheus.Registerer, stages []string, inflight *atomic.Int64) (*metrics, error) {
	m := &metrics{
		queueDepth: prometheus.NewDesc("kvflow_stage_queue_depth",
			"Items waiting in the stage's input queue.", []string{"stage"}, nil),
		queueCapacity: prometheus.NewDesc("kvflow_stage_queue_capacity",
			"Capacity of the stage's input queue.", []string{"stage"}, nil),
		blocked: prometheus.NewDesc("kvflow_stage_blocked_seconds_total",
			"Time senders (the intake or the upstream stage's workers) spent blocked because this stage's queue was full (backpressure); includes sends still blocked.",
			[]string{"stage"}, nil),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_stage_rejected_total",
			Help: "Non-blocking submissions rejected because the stage's queue was full.",
		}, []string{"stage"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvflow_stage_duration_seconds",
			Help:    "Time one item spent in the stage's processing function.",
			Buckets: DurationBuckets,
		}, []string{"stage"}),
		items: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_stage_items_total",
			Help: "Items handled by the stage, by outcome (ok, error, skipped, canceled).",
		}, []string{"stage", "outcome"}),
		busy: prometheus.NewDesc("kvflow_stage_busy_workers",
			"Workers of the stage currently running its processing function.", []string{"stage"}, nil),
		panics: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_stage_panics_total",
			Help: "Panics recovered in the stage's processing function (each also fails its item).",
		}, []string{"stage"}),
		inflight: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvflow_pipeline_in_flight",
			Help: "Accepted items that have not yet reached the sink.",
		}, func() float64 { return float64(inflight.Load()) }),
		results: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_pipeline_items_total",
			Help: "Items that reached the sink, by outcome (done, failed, canceled).",
		}, []string{"outcome"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvflow_pipeline_item_duration_seconds",
			Help:    "Time from acceptance to the sink, by outcome.",
			Buckets: DurationBuckets,
		}, []string{"outcome"}),
	}
	m.gauges = &queueCollector{m: m}
	for _, c := range []prometheus.Collector{m.rejected, m.duration, m.items, m.panics, m.inflight, m.results, m.latency} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("pipeline: register metrics: %w", err)
		}
	}
	for _, o := range []Outcome{Done, Failed, Canceled} {
		m.resultBy[o] = m.results.WithLabelValues(o.String())
		m.latencyBy[o] = m.latency.WithLabelValues(o.String())
	}
	return m, nil
}

func (m *metrics) forStage(name string, capacity int, depth func() float64) stageMetrics {
	bc := &blockedClock{epoch: time.Now()}
	busy := new(atomic.Int64)
	m.gauges.stages = append(m.gauges.stages, queueGauge{name: name, capacity: capacity, depth: depth, blocked: bc, busy: busy})
	s := stageMetrics{
		blocked:  bc,
		rejected: m.rejected.WithLabelValues(name),
		duration: m.duration.WithLabelValues(name),
		busy:     busy,
		panics:   m.panics.WithLabelValues(name),
		outcomes: map[string]prometheus.Counter{},
	}
	for _, o := range stageOutcomes {
		s.outcomes[o] = m.items.WithLabelValues(name, o)
	}
	s.ok, s.err = s.outcomes[outcomeOK], s.outcomes[outcomeError]
	return s
}

func (m *metrics) ended(o Outcome, d time.Duration) {
	m.resultBy[o].Inc()
	m.latencyBy[o].Observe(d.Seconds())
}
