package benche2e

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"time"

	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/stagehist"
)

// loadBatch is the most requests of one load call.
const loadBatch = 64

// Modes.
const (
	ModePipeline = "kvflow" // every request loaded as it arrives
	ModeSerial   = "serial" // one request at a time: load, wait for done, next
)

// Options configures one workload's benchmark.
type Options struct {
	Workload Workload
	// MaxMem caps the caches of both sides together (bytes).
	MaxMem int64
	// Verify is how many requests per run are checked byte by byte
	// (evenly spread); < 0 checks all.
	Verify int
	// Modes to run, in order; empty = kvflow then serial.
	Modes []string
	// Rounds repeats Modes (< 1 = once), each round after a raw TCP
	// stream (RawBytes > 0): figures taken minutes apart on a shared
	// machine differ by a third, so every ratio is formed within a round
	// and the report keeps the median of the rounds'.
	Rounds int
	// RawBytes is the payload of the raw TCP ceiling (0 skips it).
	RawBytes int64
	// Timeout bounds one run.
	Timeout time.Duration
	Logger  *slog.Logger
	// Process, if set, runs the workers as `kvflow serve` processes
	// driven through their control sockets; nil runs them in this
	// process.
	Process *Process
}

// Latency summarises request latencies (arrival to the last decode rank's
// done).
type Latency struct {
	Count int           `json:"count"`
	P50   time.Duration `json:"p50_ns"`
	P99   time.Duration `json:"p99_ns"`
	Max   time.Duration `json:"max_ns"`
}

// StageLatency is one decode stage's processing time from the workers'
// kvflow_stage_duration_seconds histograms (bucket-interpolated).
type StageLatency struct {
	Stage string  `json:"stage"`
	Count float64 `json:"count"`
	P50   float64 `json:"p50_s"`
	P99   float64 `json:"p99_s"`
}

// RunReport is one mode's figures.
type RunReport struct {
	Mode      string        `json:"mode"`
	Round     int           `json:"round"` // from 0
	Requests  int           `json:"requests"`
	Failed    int           `json:"failed"`
	Bytes     uint64        `json:"bytes"`
	Wall      time.Duration `json:"wall_ns"`
	GBps      float64       `json:"gb_per_s"`
	ReqPerSec float64       `json:"requests_per_s"`
	All       Latency       `json:"latency"`
	Long      *Latency      `json:"latency_long,omitempty"`  // mixed only
	Short     *Latency      `json:"latency_short,omitempty"` // mixed only
	// Slowpeer only: the stalled rank's requests (all expected to fail;
	// not in the other figures, which are the healthy requests').
	Slow       *Latency       `json:"latency_slow,omitempty"`
	SlowFailed int            `json:"slow_failed,omitempty"`
	Stages     []StageLatency `json:"stages"`
	Verified   int            `json:"verified_requests"`
	BadBytes   int64          `json:"bad_bytes"`
	FirstErr   string         `json:"first_error,omitempty"`
}

// Report is one workload's result.
type Report struct {
	Workload Workload `json:"workload"`
	// Workers says how the workers ran (processes, in-process, netns).
	Workers    string `json:"workers"`
	CacheBytes int64  `json:"cache_bytes"`
	BlockBytes int64  `json:"block_bytes"`
	// RawSamples are 1-connection raw TCP streams, one before each round
	// and one after the last (0: that stream failed): round r's ceiling
	// is the mean of samples r and r+1, the streams just around it. On a shared machine one
	// stream's figure swings by a third from minute to minute, and a
	// ratio against a ceiling measured minutes away with it.
	RawSamples []float64 `json:"raw_tcp_1conn_samples_gb_per_s,omitempty"`
	// RawTCP1 is the median of RawSamples (for display).
	RawTCP1 float64     `json:"raw_tcp_1conn_gb_per_s"`
	RawTCP4 float64     `json:"raw_tcp_4conn_gb_per_s"`
	Rounds  int         `json:"rounds"`
	Runs    []RunReport `json:"runs"`
	// Ratios are kvflow / serial, the median over the rounds of each
	// round's ratio (of its fastest run of each mode); latency ratios
	// below 1 are better.
	Ratios map[string]float64 `json:"ratios_kvflow_over_serial,omitempty"`
	// OfRaw is kvflow GB/s / the 1-connection raw TCP ceiling, the
	// median over the rounds of each round's (fastest) kvflow run against
	// its round's ceiling.
	OfRaw float64 `json:"kvflow_over_raw_tcp,omitempty"`
	// RoundRatios and OfRawRounds are the rounds' own ratios, in round
	// order, that Ratios and OfRaw are the medians of.
	RoundRatios map[string][]float64 `json:"round_ratios,omitempty"`
	OfRawRounds []float64            `json:"kvflow_over_raw_tcp_rounds,omitempty"`
}

// Bench runs one workload: it sizes it (o.Workload.Layers may come back
// changed), starts the cluster, runs each mode, verifies and reports.
func Bench(ctx context.Context, o Options) (*Report, error) {
	w := o.Workload
	total, err := w.Size(o.MaxMem)
	if err != nil {
		return nil, err
	}
	if err := w.checkConfigs(); err != nil {
		return nil, err
	}
	if len(o.Modes) == 0 {
		o.Modes = []string{ModePipeline, ModeSerial}
	}
	if w.Slow > 0 {
		// The healthy requests alone, then with the stalled rank's.
		o.Modes = []string{ModeAlone, ModePipeline}
	}
	if o.Timeout <= 0 {
		o.Timeout = 5 * time.Minute
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	rounds := max(o.Rounds, 1)
	rep := &Report{Workload: w, CacheBytes: total, BlockBytes: w.BlockBytes(), Rounds: rounds}
	if o.RawBytes > 0 {
		if rep.RawTCP4, err = RawTCP(o.RawBytes, 4); err != nil {
			return nil, err
		}
	}
	// A raw stream that fails before the first round fails the
	// workload (the ceiling is unmeasurable here); a later one is logged
	// and counted as 0 (no ceiling for the rounds around it) rather than
	// throwing the finished runs away.
	rawSample := func(first bool) error {
		if o.RawBytes <= 0 {
			return nil
		}
		v, err := RawTCP(o.RawBytes, 1)
		if err != nil {
			if first {
				return err
			}
			log.Warn("bench e2e: raw TCP stream failed; its rounds have no ceiling", "workload", w.Name, "err", err)
			v = 0
		}
		rep.RawSamples = append(rep.RawSamples, v)
		return nil
	}
	var c *cluster
	if o.Process != nil {
		c, err = startProc(ctx, w, o.Process, log)
	} else {
		c, err = startInProc(w, log)
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		return nil, fmt.Errorf("bench e2e: start workers: %w", err)
	}
	defer c.close()
	if w.Slow > 0 {
		stop, err := c.startSlowPeer(ctx)
		if err != nil {
			return nil, fmt.Errorf("bench e2e: start the stalled rank: %w", err)
		}
		defer stop()
	}
	rep.Workers = c.be.describe()
	reqs, _, _ := w.requests()
	// Warm up: handshakes cached, engine connections open. Processes map
	// the shm caches themselves, so their first touch of each page would
	// fall on the first measured run: there the warm-up moves every
	// request once (all at once, unmeasured).
	r0 := reqs[0]
	warm, wmode := []reqSpec{{blocks: 1, local: r0.local[:1], remote: r0.remote[:1]}}, ModeSerial
	if o.Process != nil {
		warm, wmode = healthy(reqs), ModePipeline
		for i := range warm {
			warm[i].arrival = 0
		}
	}
	if r, err := c.run(ctx, "warmup", wmode, warm, 0, o.Timeout); err != nil {
		return nil, fmt.Errorf("bench e2e: warm-up: %w", err)
	} else if r.Failed > 0 {
		return nil, fmt.Errorf("bench e2e: warm-up: %d of %d requests failed; first: %s", r.Failed, r.Requests, r.FirstErr)
	}
	// Rounds: a raw stream, then each mode; a last raw stream closes the
	// final round. The workers stay up and idle while the raw streams
	// run, as they are around every run.
	k := 0
	for round := range rounds {
		if err := rawSample(round == 0); err != nil {
			return nil, err
		}
		for _, m := range o.Modes {
			r, err := c.run(ctx, fmt.Sprintf("%s%d", m, k), m, reqs, o.Verify, o.Timeout)
			if err != nil {
				return nil, fmt.Errorf("bench e2e: %s %s round %d: %w", w.Name, m, round+1, err)
			}
			k++
			r.Round = round
			rep.Runs = append(rep.Runs, *r)
		}
	}
	if err := rawSample(false); err != nil {
		return nil, err
	}
	var streams []float64
	for _, v := range rep.RawSamples {
		if v > 0 {
			streams = append(streams, v)
		}
	}
	if len(streams) > 0 {
		rep.RawTCP1 = median(streams)
	}
	rep.ratios()
	return rep, nil
}

// median of v (not empty).
func median(v []float64) float64 {
	w := slices.Clone(v)
	slices.Sort(w)
	n := len(w)
	if n%2 == 1 {
		return w[n/2]
	}
	return (w[n/2-1] + w[n/2]) / 2
}

// Typical is mode's median run by wall time (of two, the faster), or
// nil: the run the tables show for that mode.
func (rep *Report) Typical(mode string) *RunReport {
	var rs []*RunReport
	for i := range rep.Runs {
		if rep.Runs[i].Mode == mode {
			rs = append(rs, &rep.Runs[i])
		}
	}
	if len(rs) == 0 {
		return nil
	}
	slices.SortStableFunc(rs, func(a, b *RunReport) int { return cmp.Compare(a.Wall, b.Wall) })
	return rs[(len(rs)-1)/2]
}

// ceiling is round r's raw TCP ceiling: the mean of the streams before
// and after it that succeeded (0 without one).
func (rep *Report) ceiling(r int) float64 {
	var sum float64
	var k int
	for _, i := range []int{r, r + 1} {
		if i < len(rep.RawSamples) && rep.RawSamples[i] > 0 {
			sum += rep.RawSamples[i]
			k++
		}
	}
	if k == 0 {
		return 0
	}
	return sum / float64(k)
}

func (rep *Report) ratios() {
	div := func(a, b float64) float64 {
		if b == 0 {
			return math.NaN()
		}
		return a / b
	}
	lat := func(a, b *Latency, p99 bool) float64 {
		if p99 {
			return div(float64(a.P99), float64(b.P99))
		}
		return div(float64(a.P50), float64(b.P50))
	}
	var ofRaw []float64
	per := map[string][]float64{}
	for round := range rep.Rounds {
		// With several runs of a mode in one round, its fastest.
		var kv, se, al *RunReport
		for i := range rep.Runs {
			r := &rep.Runs[i]
			if r.Round != round {
				continue
			}
			switch {
			case r.Mode == ModePipeline && (kv == nil || r.Wall < kv.Wall):
				kv = r
			case r.Mode == ModeSerial && (se == nil || r.Wall < se.Wall):
				se = r
			case r.Mode == ModeAlone && (al == nil || r.Wall < al.Wall):
				al = r
			}
		}
		if kv != nil && al != nil {
			// slowpeer: the healthy requests with the stalled rank's
			// among them, over the same alone (latency: below 1 is better).
			for k, v := range map[string]float64{
				"healthy_latency_p50":    lat(&kv.All, &al.All, false),
				"healthy_latency_p99":    lat(&kv.All, &al.All, true),
				"healthy_requests_per_s": div(kv.ReqPerSec, al.ReqPerSec),
			} {
				if !math.IsNaN(v) && !math.IsInf(v, 0) {
					per[k] = append(per[k], v)
				}
			}
		}
		if c := rep.ceiling(round); kv != nil && c > 0 {
			ofRaw = append(ofRaw, kv.GBps/c)
		}
		if kv == nil || se == nil {
			continue
		}
		// A ratio a round cannot form (a zero denominator: nothing of
		// that class finished) is left out of that round, not a NaN
		// that would sort first into the median and break --json.
		add := func(k string, v float64) {
			if !math.IsNaN(v) && !math.IsInf(v, 0) {
				per[k] = append(per[k], v)
			}
		}
		add("gb_per_s", div(kv.GBps, se.GBps))
		add("requests_per_s", div(kv.ReqPerSec, se.ReqPerSec))
		add("latency_p50", lat(&kv.All, &se.All, false))
		add("latency_p99", lat(&kv.All, &se.All, true))
		if kv.Short != nil && se.Short != nil {
			add("short_latency_p50", lat(kv.Short, se.Short, false))
			add("short_latency_p99", lat(kv.Short, se.Short, true))
		}
		if kv.Long != nil && se.Long != nil {
			add("long_latency_p50", lat(kv.Long, se.Long, false))
			add("long_latency_p99", lat(kv.Long, se.Long, true))
		}
	}
	if len(ofRaw) > 0 {
		rep.OfRaw, rep.OfRawRounds = median(ofRaw), ofRaw
	}
	if len(per) > 0 {
		rep.RoundRatios = per
		rep.Ratios = make(map[string]float64, len(per))
		for k, v := range per {
			rep.Ratios[k] = median(v)
		}
	}
}

// run drives reqs through the cluster in mode and measures it.
func (c *cluster) run(ctx context.Context, prefix, mode string, reqs []reqSpec, nverify int, timeout time.Duration) (*RunReport, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	name := mode
	if mode == ModeAlone {
		reqs, mode = healthy(reqs), ModePipeline
	}
	ids := make([]string, len(reqs))
	for i := range reqs {
		ids[i] = fmt.Sprintf("%s-%d", prefix, i)
	}
	// The prefill side holds every request before decode asks.
	sends := make([]prefill.SendRequest, 0, len(reqs))
	for i, r := range reqs {
		if !r.slow { // the stalled rank is not the real prefill
			sends = append(sends, prefill.SendRequest{RequestID: ids[i], BlockIDs: r.remote})
		}
	}
	if err := c.be.send(ctx, sends); err != nil {
		return nil, err
	}
	sample := slices.DeleteFunc(sampleIdx(len(reqs), nverify), func(i int) bool { return reqs[i].slow })
	for _, i := range sample {
		c.clear(reqs[i])
	}
	pend := make([]*pending, len(reqs))
	for i := range reqs {
		pend[i] = c.col.add(ids[i], len(c.decode))
	}
	defer c.col.forget(ids)
	before := c.be.stages(ctx)
	wait := func(p *pending) error {
		select {
		case <-p.done:
			return nil
		case <-ctx.Done():
			return fmt.Errorf("waiting for requests: %w", context.Cause(ctx))
		}
	}
	start := time.Now()
	for i := 0; i < len(reqs); {
		if d := time.Until(start.Add(reqs[i].arrival)); d > 0 {
			select {
			case <-time.After(d):
			case <-ctx.Done():
				return nil, context.Cause(ctx)
			}
		}
		// kvflow: every request that has arrived, in one load (at most
		// loadBatch); serial: one.
		j := i + 1
		if mode == ModePipeline {
			now := time.Since(start)
			for j < len(reqs) && j-i < loadBatch && reqs[j].arrival <= now {
				j++
			}
		}
		lr := make([]decode.LoadRequest, 0, j-i)
		for k := i; k < j; k++ {
			lr = append(lr, decode.LoadRequest{RequestID: ids[k], LocalBlockIDs: reqs[k].local, Params: c.params(reqs[k])})
		}
		if err := c.be.load(ctx, lr); err != nil {
			return nil, err
		}
		if mode == ModeSerial {
			if err := wait(pend[i]); err != nil {
				return nil, err
			}
		}
		i = j
	}
	for _, p := range pend {
		if err := wait(p); err != nil {
			return nil, err
		}
	}
	rr := &RunReport{Mode: name, Requests: len(reqs)}
	var end time.Time
	var all, long, short, slow []time.Duration
	for i, p := range pend {
		fin, n, err := c.col.result(p)
		if reqs[i].slow {
			slow = append(slow, fin.Sub(start.Add(reqs[i].arrival)))
			rr.Requests--
			if err != nil {
				rr.SlowFailed++
			}
			continue
		}
		if fin.After(end) {
			end = fin
		}
		rr.Bytes += n
		if err != nil {
			rr.Failed++
			if rr.FirstErr == "" {
				rr.FirstErr = fmt.Sprintf("%s: %v", ids[i], err)
			}
		}
		lat := fin.Sub(start.Add(reqs[i].arrival))
		all = append(all, lat)
		if reqs[i].short {
			short = append(short, lat)
		} else {
			long = append(long, lat)
		}
	}
	rr.Wall = end.Sub(start)
	rr.GBps = float64(rr.Bytes) / rr.Wall.Seconds() / 1e9
	rr.ReqPerSec = float64(rr.Requests) / rr.Wall.Seconds()
	rr.All = summarize(all)
	if len(short) > 0 {
		s, l := summarize(short), summarize(long)
		rr.Short, rr.Long = &s, &l
	}
	if len(slow) > 0 {
		s := summarize(slow)
		rr.Slow = &s
	}
	rr.Stages = stageDelta(before, c.be.stages(ctx))
	for _, i := range sample {
		bad, err := c.check(ids[i], reqs[i])
		rr.Verified++
		rr.BadBytes += bad
		if err != nil && rr.FirstErr == "" {
			rr.FirstErr = err.Error()
		}
	}
	// Drain the workers' finished lists so long runs keep memory flat.
	c.be.drain(ctx)
	return rr, nil
}

// healthy is reqs without the stalled rank's (slowpeer).
func healthy(reqs []reqSpec) []reqSpec {
	return slices.DeleteFunc(slices.Clone(reqs), func(r reqSpec) bool { return r.slow })
}

// sampleIdx is n indices spread evenly over [0, total), all when n < 0.
func sampleIdx(total, n int) []int {
	if n < 0 || n >= total {
		return seq(0, total)
	}
	var out []int
	for k := range n {
		i := k * total / n
		if len(out) == 0 || out[len(out)-1] != i {
			out = append(out, i)
		}
	}
	return out
}

func summarize(d []time.Duration) Latency {
	if len(d) == 0 {
		return Latency{}
	}
	s := slices.Clone(d)
	slices.Sort(s)
	q := func(p float64) time.Duration {
		i := int(math.Ceil(p*float64(len(s)))) - 1
		return s[max(0, min(i, len(s)-1))]
	}
	return Latency{Count: len(s), P50: q(0.5), P99: q(0.99), Max: s[len(s)-1]}
}

func stageDelta(before, after stagehist.Set) []StageLatency {
	var out []StageLatency
	for _, l := range after.Since(before) {
		p50, p99 := l.P50, l.P99
		if math.IsNaN(p50) {
			p50, p99 = 0, 0
		}
		out = append(out, StageLatency{Stage: l.Stage, Count: l.Items, P50: p50, P99: p99})
	}
	return out
}
