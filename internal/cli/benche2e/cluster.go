package benche2e

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/node"
	"github.com/kvflow/kvflow/internal/verify"
	"github.com/kvflow/kvflow/stages/plan"
)

// tag is the verify pattern of the prefill pool.
const tag = 0x6b76666c6f77

// cluster is one prefill instance and one decode instance in this process,
// on loopback: real TCP transfer engines, real ZMQ side channels.
type cluster struct {
	w       Workload
	kvPort  int
	prefill []*node.Node // by device index
	decode  []*node.Node // by tp rank
	regs    []*prometheus.Registry
	col     *collector
}

func (w Workload) config(role config.Role, rank, kvPort int, pool, local int) config.Config {
	c := config.Default()
	kv := &c.KVTransfer
	kv.KVConnectorExtraConfig.Prefill = config.Parallel{TPSize: w.PrefillTP, DPSize: 1, PPSize: 1}
	kv.KVConnectorExtraConfig.Decode = config.Parallel{TPSize: w.DecodeTP, DPSize: 1, PPSize: 1}
	kv.KVPort = config.Port(kvPort)
	nb := local
	if role == config.Prefill {
		kv.KVRole, kv.EngineID = config.KVProducer, "P"
		nb = pool
	} else {
		kv.KVRole, kv.EngineID = config.KVConsumer, "D"
		kv.KVPort = config.Port(kvPort + 1000)
	}
	c.Model = config.Model{NumLayers: w.Layers, NumKVHeads: w.KVHeads, HeadDim: w.HeadDim, BlockSize: w.BlockSize, DType: "bf16", NumBlocks: nb}
	c.Rank = config.Rank{TP: rank}
	c.Node.MetricsAddr = ""
	c.Cache.NoHugePages = true
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

func startCluster(w Workload, log *slog.Logger) (*cluster, error) {
	var last error
	for range 8 {
		kvPort := 20000 + rand.IntN(28000)
		c, err := tryCluster(w, kvPort, log)
		if err == nil {
			return c, nil
		}
		last = err
	}
	return nil, last
}

func tryCluster(w Workload, kvPort int, log *slog.Logger) (_ *cluster, err error) {
	_, local, pool := w.requests()
	c := &cluster{w: w, kvPort: kvPort, col: newCollector()}
	defer func() {
		if err != nil {
			c.close()
		}
	}()
	for r := range w.PrefillTP {
		n, err := node.Start(w.config(config.Prefill, r, kvPort, pool, local), node.Deps{Logger: log})
		if err != nil {
			return nil, fmt.Errorf("prefill rank %d: %w", r, err)
		}
		c.prefill = append(c.prefill, n)
	}
	for r := range w.DecodeTP {
		reg := prometheus.NewRegistry()
		n, err := node.Start(w.config(config.Decode, r, kvPort, pool, local), node.Deps{Logger: log, Registerer: reg, OnFinish: c.col.finish})
		if err != nil {
			return nil, fmt.Errorf("decode rank %d: %w", r, err)
		}
		c.decode = append(c.decode, n)
		c.regs = append(c.regs, reg)
	}
	// Fill the prefill pool once; every request reads from it.
	ids := seq(0, pool)
	for _, p := range c.prefill {
		verify.FillBlocks(p.Device, p.Shape.NumLayers, p.Device.Layout().NumParts(), plan.DeviceIndex(p.Config.Topology().Prefill, p.Config.Self()), ids, tag)
	}
	// Fault the decode caches in, so neither mode pays the first touch.
	for _, d := range c.decode {
		data := d.Device.Data()
		for i := 0; i < len(data); i += 4096 {
			data[i] = 0
		}
	}
	return c, nil
}

func (c *cluster) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, n := range append(append([]*node.Node(nil), c.decode...), c.prefill...) {
		n.Close(ctx)
	}
}

// params are a request's kv_transfer_params.
func (c *cluster) params(r reqSpec) decode.KVTransferParams {
	return decode.KVTransferParams{RemoteBlockIDs: r.remote, RemoteEngineID: "P", RemoteHost: "127.0.0.1",
		RemotePort: c.kvPort, RemotePCPSize: 1, RemoteDCPSize: 1}
}

// rowBytes is one token's bytes of each part on a prefill rank.
func (c *cluster) rowBytes() []int {
	p := c.prefill[0]
	l := p.Device.Layout()
	out := make([]int, l.NumParts())
	for i := range out {
		out[i] = l.BlockLen(i) / p.Shape.BlockSize
	}
	return out
}

// clear zeroes a request's local blocks on every decode rank.
func (c *cluster) clear(r reqSpec) {
	for _, d := range c.decode {
		for l := range d.Shape.NumLayers {
			for p := range d.Device.Layout().NumParts() {
				for _, b := range r.local {
					clear(d.Device.Block(l, p, b))
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
		pl, err := plan.PlanRequest(d.Config.Topology(), d.Config.Self(), plan.Request{ID: id, LocalBlockIDs: r.local,
			RemoteBlockIDs: r.remote, RemoteHost: "127.0.0.1", RemotePort: c.kvPort, RemoteEngineID: "P", RemotePCPSize: 1, RemoteDCPSize: 1})
		if err != nil {
			return bad, err
		}
		n, err := verify.Check(d.Device, pl, c.rowBytes(), tag)
		bad += n
		if first == nil && err != nil {
			first = fmt.Errorf("decode rank %d: %w", d.Config.Rank.TP, err)
		}
	}
	return bad, first
}

// collector gathers decode results: a request is finished when every
// decode rank reported it.
type collector struct {
	mu   sync.Mutex
	reqs map[string]*pending
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
	c.mu.Unlock()
	return p
}

func (c *collector) forget(ids []string) {
	c.mu.Lock()
	for _, id := range ids {
		delete(c.reqs, id)
	}
	c.mu.Unlock()
}

func (c *collector) finish(res decode.Result) {
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.reqs[res.RequestID]
	if p == nil || p.left == 0 {
		return
	}
	p.left--
	p.bytes += res.Bytes
	if res.Err != nil && p.err == nil {
		p.err = res.Err
	}
	if p.left == 0 {
		p.finished = now
		close(p.done)
	}
}

// result reads a finished request (after done is closed).
func (c *collector) result(p *pending) (time.Time, uint64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return p.finished, p.bytes, p.err
}
