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

// Nothing on the per-item path touches a Prometheus counter or gauge: the
// item counts, busy workers, queue depth, blocked time and in-flight count
// live in the pipeline's own atomics (each written by one goroutine where
// the item rate makes it matter) and scrapeCollector turns them into
// metrics at scrape time. Only the histograms are observed directly, and
// those on sampled items when a saturated stage's items are fast (see
// timeEvery).
type metrics struct {
	queueDepth    *prometheus.Desc
	queueCapacity *prometheus.Desc
	blocked       *prometheus.Desc
	busy          *prometheus.Desc
	items         *prometheus.Desc
	results       *prometheus.Desc
	rejected      *prometheus.CounterVec
	duration      *prometheus.HistogramVec
	panics        *prometheus.CounterVec
	inflight      prometheus.GaugeFunc
	latency       *prometheus.HistogramVec
	keyWait       *prometheus.HistogramVec
	backlogged    *prometheus.Desc
	parked        *prometheus.Desc
	scrape        *scrapeCollector
	latencyBy     [3]prometheus.Observer
}

type stageMetrics struct {
	blocked  *blockedClock
	rejected prometheus.Counter
	duration prometheus.Observer
	panics   prometheus.Counter
	// Rare outcomes; "ok" is counted by the workers (worker.state).
	errors, skipped, canceled *atomic.Uint64
}

// scrapeCollector reads the per-stage and per-pipeline state at scrape time.
type scrapeCollector struct {
	m       *metrics
	stages  []stageGauges
	results func() (done, failed, canceled int64)
}

type stageGauges struct {
	name     string
	capacity int
	depth    func() float64
	keys     func() float64 // keys with a backlog; nil for an unkeyed stage
	parked   func() float64 // parked items; nil for an unkeyed stage
	blocked  *blockedClock
	workers  func() (ok, busy uint64)
	errors   *atomic.Uint64
	skipped  *atomic.Uint64
	canceled *atomic.Uint64
}

func (c *scrapeCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.m.queueDepth
	ch <- c.m.queueCapacity
	ch <- c.m.blocked
	ch <- c.m.busy
	ch <- c.m.items
	ch <- c.m.results
	ch <- c.m.backlogged
	ch <- c.m.parked
}

func (c *scrapeCollector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range c.stages {
		ok, busy := s.workers()
		ch <- prometheus.MustNewConstMetric(c.m.queueDepth, prometheus.GaugeValue, s.depth(), s.name)
		ch <- prometheus.MustNewConstMetric(c.m.queueCapacity, prometheus.GaugeValue, float64(s.capacity), s.name)
		ch <- prometheus.MustNewConstMetric(c.m.blocked, prometheus.CounterValue, s.blocked.seconds(), s.name)
		ch <- prometheus.MustNewConstMetric(c.m.busy, prometheus.GaugeValue, float64(busy), s.name)
		ch <- prometheus.MustNewConstMetric(c.m.items, prometheus.CounterValue, float64(ok), s.name, outcomeOK)
		ch <- prometheus.MustNewConstMetric(c.m.items, prometheus.CounterValue, float64(s.errors.Load()), s.name, outcomeError)
		ch <- prometheus.MustNewConstMetric(c.m.items, prometheus.CounterValue, float64(s.skipped.Load()), s.name, outcomeSkipped)
		ch <- prometheus.MustNewConstMetric(c.m.items, prometheus.CounterValue, float64(s.canceled.Load()), s.name, outcomeCanceled)
		if s.keys != nil {
			ch <- prometheus.MustNewConstMetric(c.m.backlogged, prometheus.GaugeValue, s.keys(), s.name)
			ch <- prometheus.MustNewConstMetric(c.m.parked, prometheus.GaugeValue, s.parked(), s.name)
		}
	}
	done, failed, canceled := c.results()
	ch <- prometheus.MustNewConstMetric(c.m.results, prometheus.CounterValue, float64(done), Done.String())
	ch <- prometheus.MustNewConstMetric(c.m.results, prometheus.CounterValue, float64(failed), Failed.String())
	ch <- prometheus.MustNewConstMetric(c.m.results, prometheus.CounterValue, float64(canceled), Canceled.String())
}

// DurationBuckets spans 50 µs (a no-op stage) to ~50 s (a large read on a
// slow link).
var DurationBuckets = prometheus.ExponentialBuckets(50e-6, 2.5, 16)

func newMetrics(reg prometheus.Registerer, inflight func() float64) (*metrics, error) {
	m := &metrics{
		queueDepth: prometheus.NewDesc("kvflow_stage_queue_depth",
			"Items waiting in the stage's input queue.", []string{"stage"}, nil),
		queueCapacity: prometheus.NewDesc("kvflow_stage_queue_capacity",
			"Capacity of the stage's input queue.", []string{"stage"}, nil),
		blocked: prometheus.NewDesc("kvflow_stage_blocked_seconds_total",
			"Time senders (the intake or the upstream stage's workers) spent blocked because this stage's queue was full (backpressure); includes sends still blocked.",
			[]string{"stage"}, nil),
		busy: prometheus.NewDesc("kvflow_stage_busy_workers",
			"Workers of the stage currently running its processing function.", []string{"stage"}, nil),
		items: prometheus.NewDesc("kvflow_stage_items_total",
			"Items handled by the stage, by outcome (ok, error, skipped, canceled).", []string{"stage", "outcome"}, nil),
		results: prometheus.NewDesc("kvflow_pipeline_items_total",
			"Items that reached the sink, by outcome (done, failed, canceled).", []string{"outcome"}, nil),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_stage_rejected_total",
			Help: "Items refused by the stage: non-blocking submissions when its queue was full, and, in a keyed stage, items of a new key beyond its max keys or over a stalled key's queue bound.",
		}, []string{"stage"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvflow_stage_duration_seconds",
			Help:    "Time one item spent in the stage's processing function. Every item is timed when the stage's worker waited for it (not saturated) or items take 20us or more; items a saturated worker takes back to back in under 20us are sampled 1 in 64 (kvflow_stage_items_total counts all).",
			Buckets: DurationBuckets,
		}, []string{"stage"}),
		panics: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvflow_stage_panics_total",
			Help: "Panics recovered in the stage's processing function (each also fails its item).",
		}, []string{"stage"}),
		keyWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvflow_stage_key_wait_seconds",
			Help:    "Time an item of a keyed stage waited in its key's queue before a worker took it (all keys together).",
			Buckets: DurationBuckets,
		}, []string{"stage"}),
		backlogged: prometheus.NewDesc("kvflow_stage_keys_backlogged",
			"Keys of a keyed stage with items waiting (a key is a peer; no per-key series).", []string{"stage"}, nil),
		parked: prometheus.NewDesc("kvflow_stage_items_parked",
			"Items of a keyed stage parked beyond their key's queue (their sender went on; bounded by the stage's park budget).", []string{"stage"}, nil),
		inflight: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvflow_pipeline_in_flight",
			Help: "Accepted items that have not yet reached the sink.",
		}, inflight),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvflow_pipeline_item_duration_seconds",
			Help:    "Time from acceptance to the sink, by outcome. Every item is timed while items take 1ms or more and when the pipeline's first stage had a worker waiting (not saturated); under load of faster items 1 in 64 is sampled (kvflow_pipeline_items_total counts all).",
			Buckets: DurationBuckets,
		}, []string{"outcome"}),
	}
	m.scrape = &scrapeCollector{m: m}
	for _, c := range []prometheus.Collector{m.rejected, m.duration, m.panics, m.inflight, m.latency, m.keyWait} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("pipeline: register metrics: %w", err)
		}
	}
	for _, o := range []Outcome{Done, Failed, Canceled} {
		m.latencyBy[o] = m.latency.WithLabelValues(o.String())
	}
	return m, nil
}

func (m *metrics) forStage(name string, capacity int, depth, keys, parked func() float64, workers func() (ok, busy uint64)) stageMetrics {
	s := stageMetrics{
		blocked:  &blockedClock{epoch: time.Now()},
		rejected: m.rejected.WithLabelValues(name),
		duration: m.duration.WithLabelValues(name),
		panics:   m.panics.WithLabelValues(name),
		errors:   new(atomic.Uint64),
		skipped:  new(atomic.Uint64),
		canceled: new(atomic.Uint64),
	}
	m.scrape.stages = append(m.scrape.stages, stageGauges{name: name, capacity: capacity, depth: depth, keys: keys, parked: parked,
		blocked: s.blocked, workers: workers, errors: s.errors, skipped: s.skipped, canceled: s.canceled})
	return s
}
