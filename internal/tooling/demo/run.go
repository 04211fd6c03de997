package demo

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/tooling/verify"
	"github.com/kvflow/kvflow/stages/plan"
)

type request struct {
	id            string
	remote, local []int
	params        decode.KVTransferParams
	loaded        time.Time
	decodeDone    map[int]bool // decode tp rank → done
	prefillFreed  map[int]bool // prefill rank → freed
	failed        []string
	verified      bool
	latency       time.Duration
	bytes         int64
}

// Summary is what the demo measured.
type Summary struct {
	Requests, Done, Failed int
	Bytes                  int64 // bytes landed on decode ranks, verified
	BadBytes               int64
	Wall                   time.Duration
	// Latencies are the driver's view of each done request: from handing
	// the load to the workers to seeing it done in a finished poll. They
	// include queueing behind the requests in flight and the driver's own
	// work between polls (Fill and Check).
	Latencies []time.Duration
	// Fill and Check are the time this driver spent, in its one loop,
	// writing the prefill blocks and verifying every landed byte: part of
	// Wall, no part of kvflow's transfer.
	Fill, Check time.Duration
	// WorkerP50 and WorkerP99 (seconds, NaN without samples) are the
	// decode workers' own request latency, load to end
	// (kvflow_decode_request_duration_seconds{outcome="done"}): no driver
	// time in it.
	WorkerP50, WorkerP99 float64
	// ReadBytes and ReadSeconds are the decode workers' bytes read
	// (kvflow_read_bytes_total) and the read stage's summed item time
	// (kvflow_stage_duration_seconds{stage="read"} _sum): their ratio is
	// the transfer rate of one request while it reads.
	ReadBytes, ReadSeconds float64
	// ShmBatches and NetBatches are the decode workers' read batches by
	// path with node.te_backend shm (kvflow_shm_batches_total), and
	// ShmFallbacks the peers whose same-host claim did not hold
	// (kvflow_shm_fallbacks_total); all 0 with tcp.
	ShmBatches, NetBatches, ShmFallbacks float64
	Stages                               []StageLatency
	Failures                             []string
}

// StageLatency is one stage's p50/p99 from the decode workers' histograms.
type StageLatency struct {
	Stage    string
	P50, P99 float64
	Count    float64
}

// OK is whether the run passed.
func (s *Summary) OK() bool {
	return s.Done == s.Requests && s.Failed == 0 && s.BadBytes == 0 && len(s.Failures) == 0
}

type pool struct{ free []int }

func newPool(n int) *pool {
	p := &pool{}
	for i := n - 1; i >= 0; i-- {
		p.free = append(p.free, i)
	}
	return p
}

func (p *pool) take(n int) []int {
	if len(p.free) < n {
		return nil
	}
	out := slices.Clone(p.free[len(p.free)-n:])
	p.free = p.free[:len(p.free)-n]
	return out
}

func (p *pool) give(b []int) { p.free = append(p.free, b...) }

func (d *driver) run(ctx context.Context) (*Summary, error) {
	o := d.o
	s := &Summary{Requests: o.Requests}
	psched := newPrefillScheduler(d.prefill[0].cfg.KVTransfer.EngineID, "127.0.0.1", d.kvPort)
	// Each prefill rank's boot epoch, from its status, goes into every
	// request's kv_transfer_params (kvflow_boot_epochs), as the vLLM
	// connector's scheduler hands them.
	psched.rules.BootEpochs = make([]uint64, len(d.prefill))
	for _, p := range d.prefill {
		rep, err := p.ctl.Call(map[string]any{"op": "status"})
		if err != nil {
			return s, fmt.Errorf("demo: prefill rank %d status: %w", p.rank, err)
		}
		e, ok := rep.Status["boot_epoch"].(uint64)
		if !ok || p.rank >= len(d.prefill) {
			return s, fmt.Errorf("demo: prefill rank %d status: boot_epoch %v (%T), want an unsigned integer", p.rank, rep.Status["boot_epoch"], rep.Status["boot_epoch"])
		}
		psched.rules.BootEpochs[p.rank] = e
	}
	dsched := newDecodeScheduler()
	ppool, dpool := newPool(o.Model.NumBlocks), newPool(o.Model.NumBlocks)
	rowBytes := make([]int, d.prefill[0].cache.Layout().NumParts())
	for p := range rowBytes {
		rowBytes[p] = d.prefill[0].cache.Layout().BlockLen(p) / o.Model.BlockSize
	}
	decodeBlockBytes := d.decode[0].cache.Layout().Size() / int64(o.Model.NumBlocks)

	var bar *progressbar.ProgressBar
	if o.Progress != nil {
		bar = progressbar.NewOptions(o.Requests, progressbar.OptionSetWriter(o.Progress),
			progressbar.OptionSetDescription("pulling"), progressbar.OptionShowCount(),
			progressbar.OptionSetWidth(30), progressbar.OptionClearOnFinish(), progressbar.OptionThrottle(100*time.Millisecond))
	}
	byID := map[string]*request{}
	var inflight []*request
	next := 0
	start := time.Now()
	for s.Done+s.Failed < o.Requests {
		if err := ctx.Err(); err != nil {
			return s, fmt.Errorf("demo: %d of %d requests finished: %w", s.Done+s.Failed, o.Requests, err)
		}
		// Admit requests while both sides have blocks for them: prefill
		// "computes" (fills) its blocks, then the schedulers hand over.
		for next < o.Requests {
			nb := o.MinBlocks + d.rng.IntN(o.MaxBlocks-o.MinBlocks+1)
			remote := ppool.take(nb)
			if remote == nil {
				break
			}
			local := dpool.take(nb)
			if local == nil {
				ppool.give(remote)
				break
			}
			r := &request{id: fmt.Sprintf("demo-%04d-%x", next, d.rng.Uint32()), remote: remote, local: local,
				decodeDone: map[int]bool{}, prefillFreed: map[int]bool{}}
			// The prefill ranks "compute" their blocks in parallel, as
			// their devices would.
			t0 := time.Now()
			var fill sync.WaitGroup
			for _, p := range d.prefill {
				fill.Go(func() {
					verify.FillBlocks(p.cache, p.cache.Layout().Shape().NumLayers, p.cache.Layout().NumParts(), p.rank, remote, plan.StringToInt64Hash(r.id))
				})
			}
			fill.Wait()
			s.Fill += time.Since(t0)
			r.params = psched.requestFinished(r.id, remote, time.Now())
			dsched.updateStateAfterAlloc(r.id, local, r.params)
			byID[r.id] = r
			inflight = append(inflight, r)
			next++
		}
		// One engine step: hand the connector metadata to every worker.
		if sends := psched.buildConnectorMeta(); len(sends) > 0 {
			for _, p := range d.prefill {
				if _, err := p.ctl.Call(map[string]any{"op": "send", "requests": sends}); err != nil {
					return s, fmt.Errorf("demo: send to %s: %w", p.name, err)
				}
			}
		}
		if loads := dsched.buildConnectorMeta(); len(loads) > 0 {
			now := time.Now()
			for _, l := range loads {
				byID[l.RequestID].loaded = now
			}
			for _, w := range d.decode {
				if _, err := w.ctl.Call(map[string]any{"op": "load", "requests": loads}); err != nil {
					return s, fmt.Errorf("demo: load on %s: %w", w.name, err)
				}
			}
		}
		// get_finished on every worker.
		progressed := false
		for _, w := range d.decode {
			rep, err := w.ctl.Call(map[string]any{"op": "finished"})
			if err != nil {
				return s, fmt.Errorf("demo: finished on %s: %w", w.name, err)
			}
			dsched.finishedRecving(rep.DoneRecving)
			for _, id := range rep.DoneRecving {
				if r := byID[id]; r != nil {
					r.decodeDone[w.rank] = true
					progressed = true
				}
			}
			for _, f := range rep.FailedRecving {
				dsched.finishedRecving([]string{f.RequestID})
				if r := byID[f.RequestID]; r != nil {
					r.decodeDone[w.rank] = true
					r.failed = append(r.failed, fmt.Sprintf("%s: %s", w.name, f.Reason))
					progressed = true
				}
			}
		}
		for _, p := range d.prefill {
			rep, err := p.ctl.Call(map[string]any{"op": "finished"})
			if err != nil {
				return s, fmt.Errorf("demo: finished on %s: %w", p.name, err)
			}
			for _, id := range rep.DoneSending {
				if r := byID[id]; r != nil {
					r.prefillFreed[p.rank] = true
					progressed = true
				}
			}
		}
		// Retire requests finished on every rank of both sides.
		kept := inflight[:0]
		for _, r := range inflight {
			if len(r.decodeDone) == len(d.decode) && !r.verified {
				r.verified = true
				r.latency = time.Since(r.loaded)
				if len(r.failed) == 0 {
					s.Latencies = append(s.Latencies, r.latency)
					// Check every decode rank's blocks, ranks in parallel.
					t0 := time.Now()
					bads := make([]int64, len(d.decode))
					errs := make([]error, len(d.decode))
					var check sync.WaitGroup
					for k, w := range d.decode {
						check.Go(func() {
							pl, err := plan.PlanRequest(w.cfg.Topology(), w.cfg.Self(), plan.Request{ID: r.id, LocalBlockIDs: r.local,
								RemoteBlockIDs: r.remote, RemoteHost: r.params.RemoteHost, RemotePort: r.params.RemotePort,
								RemoteEngineID: r.params.RemoteEngineID, RemotePCPSize: 1, RemoteDCPSize: 1})
							if err != nil {
								errs[k] = fmt.Errorf("demo: plan %s: %w", r.id, err)
								bads[k] = 1
								return
							}
							bads[k], errs[k] = verify.Check(w.cache, pl, rowBytes, plan.StringToInt64Hash(r.id))
						})
					}
					check.Wait()
					s.Check += time.Since(t0)
					before := s.BadBytes
					for k := range d.decode {
						s.BadBytes += bads[k]
						if errs[k] != nil && len(s.Failures) < 5 {
							s.Failures = append(s.Failures, errs[k].Error())
						}
						s.Bytes += decodeBlockBytes * int64(len(r.local))
					}
					if s.BadBytes == before {
						s.Done++
					} else {
						s.Failed++
					}
				} else {
					s.Failed++
					if len(s.Failures) < 5 {
						s.Failures = append(s.Failures, fmt.Sprintf("%s: %v", r.id, r.failed))
					}
				}
				dpool.give(r.local)
				if bar != nil {
					bar.Add(1)
				}
			}
			if r.verified && len(r.prefillFreed) == len(d.prefill) {
				ppool.give(r.remote)
				continue
			}
			kept = append(kept, r)
		}
		inflight = kept
		if !progressed {
			time.Sleep(2 * time.Millisecond)
		}
	}
	s.Wall = time.Since(start)
	if bar != nil {
		bar.Finish()
	}
	// Wait for the prefill side to free what is left (not needed for the
	// verdict, but the demo shows frees too).
	d.workerMetrics(ctx, s)
	if d.o.TEBackend == config.BackendShm && (s.ShmBatches == 0 || s.NetBatches > 0 || s.ShmFallbacks > 0) {
		s.Failures = append(s.Failures, fmt.Sprintf("te_backend shm: %.0f batches over shared memory, %.0f over the network, %.0f fallbacks: want every batch over shared memory",
			s.ShmBatches, s.NetBatches, s.ShmFallbacks))
	}
	if !s.OK() {
		return s, errors.New("demo: verification failed")
	}
	return s, nil
}

// Quantile of durations.
func Quantile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(q * float64(len(s)-1))
	return s[i]
}
