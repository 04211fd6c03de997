package benche2e

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/tooling/stagehist"
	"github.com/kvflow/kvflow/internal/tooling/testkit/loopback"
	"github.com/kvflow/kvflow/internal/tooling/verify"
	"github.com/kvflow/kvflow/stages/plan"
)

// tag is the verify pattern of the prefill pool.
const tag = 0x6b76666c6f77

// cluster is one prefill instance and one decode instance — `kvflow
// serve` processes (proc.go) or nodes in this process (inproc.go) — with
// their caches reachable from here.
type cluster struct {
	w      Workload
	kvPort int // the prefill instance's kv_port
	// slowPort is the stalled rank's side channel (slowpeer; 0: none).
	slowPort int
	host     string // the prefill host decode dials
	prefill  []rank // by device index
	decode   []rank // by tp rank
	col      *collector
	be       backend
}

// rank is one worker's config and cache (its own, or the shm file mapped
// here).
type rank struct {
	cfg config.Config
	dev npu.Device
}

// backend is how requests reach the workers.
type backend interface {
	// send hands every prefill rank the requests to hold.
	send(ctx context.Context, reqs []prefill.SendRequest) error
	// load starts reqs on every decode rank; results reach the collector.
	load(ctx context.Context, reqs []decode.LoadRequest) error
	// stages sums the decode ranks' stage histograms.
	stages(ctx context.Context) stagehist.Set
	// drain empties the prefill ranks' finished lists.
	drain(ctx context.Context)
	// describe is a line for the report.
	describe() string
	close()
}

func (w Workload) config(role config.Role, rank, kvPort int, pool, local int) config.Config {
	lw := loopback.Worker{Role: role, EngineID: "P", KVPort: kvPort,
		Prefill: loopback.TP(w.PrefillTP), Decode: loopback.TP(w.DecodeTP),
		Model: config.Model{NumLayers: w.Layers, NumKVHeads: w.KVHeads, HeadDim: w.HeadDim, BlockSize: w.BlockSize, DType: "bf16", NumBlocks: pool}}
	if role == config.Decode {
		lw.EngineID, lw.KVPort, lw.Model.NumBlocks = "D", kvPort+1000, local
	}
	c := loopback.Config(lw)
	c.Rank = config.Rank{TP: rank}
	if w.Slow > 0 && role == config.Decode {
		// The stalled rank's reads end at this timeout, so a run ends.
		c.Read.Timeout = config.Duration(SlowReadTimeout)
	}
	if w.TEBackend != "" {
		c.Node.TEBackend = w.TEBackend
	}
	if w.TEBackend == config.BackendMooncake {
		c.Node.Mooncake.Protocol = "tcp" // loopback: no RDMA here
		if role == config.Prefill {
			c.Read.Grants = config.GrantsOff // Mooncake has none: say so, not warn
		}
	}
	return c
}

// checkConfigs validates every worker's configuration without starting
// anything (bad TP pairs are usage errors).
func (w Workload) checkConfigs() error {
	_, local, pool := w.requests()
	var errs []error
	for r := range w.PrefillTP {
		if err := w.config(config.Prefill, r, 30000, pool, local).Validate(); err != nil {
			errs = append(errs, fmt.Errorf("prefill rank %d: %w", r, err))
			break
		}
	}
	for r := range w.DecodeTP {
		if err := w.config(config.Decode, r, 30000, pool, local).Validate(); err != nil {
			errs = append(errs, fmt.Errorf("decode rank %d: %w", r, err))
			break
		}
	}
	return errors.Join(errs...)
}

// prepare fills the prefill pool once (every request reads from it) and
// faults the decode caches in, so neither mode pays the first touch.
func (c *cluster) prepare() {
	_, _, pool := c.w.requests()
	ids := seq(0, pool)
	var wg sync.WaitGroup
	for _, p := range c.prefill {
		wg.Go(func() {
			verify.FillBlocks(p.dev, c.w.Layers, p.dev.Layout().NumParts(), plan.DeviceIndex(p.cfg.Topology().Prefill, p.cfg.Self()), ids, tag)
		})
	}
	for _, d := range c.decode {
		wg.Go(func() {
			l := d.dev.Layout()
			for layer := range l.Shape().NumLayers {
				for part := range l.NumParts() {
					data := d.dev.Bytes(layer, part)
					for i := 0; i < len(data); i += 4096 {
						data[i] = 0
					}
				}
			}
		})
	}
	wg.Wait()
}

func (c *cluster) close() {
	if c.be != nil {
		c.be.close()
	}
}

// params are a request's kv_transfer_params.
func (c *cluster) params(r reqSpec) decode.KVTransferParams {
	if r.slow {
		return decode.KVTransferParams{RemoteBlockIDs: r.remote, RemoteEngineID: "S", RemoteHost: "127.0.0.1",
			RemotePort: c.slowPort, RemotePCPSize: 1, RemoteDCPSize: 1}
	}
	return decode.KVTransferParams{RemoteBlockIDs: r.remote, RemoteEngineID: "P", RemoteHost: c.host,
		RemotePort: c.kvPort, RemotePCPSize: 1, RemoteDCPSize: 1}
}

// rowBytes is one token's bytes of each part on a prefill rank.
func (c *cluster) rowBytes() []int {
	p := c.prefill[0]
	l := p.dev.Layout()
	out := make([]int, l.NumParts())
	for i := range out {
		out[i] = l.BlockLen(i) / c.w.BlockSize
	}
	return out
}

// decodeBlockBytes is one block of a decode rank's cache (all layers).
func (c *cluster) decodeBlockBytes() uint64 {
	d := c.decode[0]
	return uint64(d.dev.Layout().Size() / int64(d.cfg.Model.NumBlocks))
}

// clear zeroes a request's local blocks on every decode rank.
func (c *cluster) clear(r reqSpec) {
	for _, d := range c.decode {
		for l := range c.w.Layers {
			for p := range d.dev.Layout().NumParts() {
				for _, b := range r.local {
					clear(d.dev.Block(l, p, b))
				}
			}
		}
	}
}

// check verifies a request's bytes on every decode rank.
func (c *cluster) check(id string, r reqSpec) (int64, error) {
	var bad int64
	var first error
	for _, d := range c.decode {
		pl, err := plan.PlanRequest(d.cfg.Topology(), d.cfg.Self(), plan.Request{ID: id, LocalBlockIDs: r.local,
			RemoteBlockIDs: r.remote, RemoteHost: c.host, RemotePort: c.kvPort, RemoteEngineID: "P", RemotePCPSize: 1, RemoteDCPSize: 1})
		if err != nil {
			return bad, err
		}
		n, err := verify.Check(d.dev, pl, c.rowBytes(), tag)
		bad += n
		if first == nil && err != nil {
			first = fmt.Errorf("decode rank %d: %w", d.cfg.Rank.TP, err)
		}
	}
	return bad, first
}

// collector gathers decode results: a request is finished when every
// decode rank reported it.
type collector struct {
	mu   sync.Mutex
	reqs map[string]*pending
	open int // pending requests not finished
}

type pending struct {
	left     int
	err      error
	bytes    uint64
	finished time.Time
	done     chan struct{}
}

func newCollector() *collector { return &collector{reqs: map[string]*pending{}} }

func (c *collector) add(id string, ranks int) *pending {
	p := &pending{left: ranks, done: make(chan struct{})}
	c.mu.Lock()
	c.reqs[id] = p
	c.open++
	c.mu.Unlock()
	return p
}

// outstanding is the number of requests added and not finished.
func (c *collector) outstanding() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.open
}

func (c *collector) forget(ids []string) {
	c.mu.Lock()
	for _, id := range ids {
		if p := c.reqs[id]; p != nil && p.left > 0 {
			c.open--
		}
		delete(c.reqs, id)
	}
	c.mu.Unlock()
}

// finish records one decode rank's result of request id, seen at now.
func (c *collector) finish(id string, bytes uint64, err error, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.reqs[id]
	if p == nil || p.left == 0 {
		return
	}
	p.left--
	p.bytes += bytes
	if err != nil && p.err == nil {
		p.err = err
	}
	if p.left == 0 {
		p.finished = now
		c.open--
		close(p.done)
	}
}

// failAll ends every pending request with err (the workers can no longer
// be asked).
func (c *collector) failAll(err error) {
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.reqs {
		if p.left > 0 {
			p.left = 0
			p.err = err
			p.finished = now
			c.open--
			close(p.done)
		}
	}
}

// result reads a finished request (after done is closed).
func (c *collector) result(p *pending) (time.Time, uint64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return p.finished, p.bytes, p.err
}
