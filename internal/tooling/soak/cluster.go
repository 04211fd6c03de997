package soak

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/node"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/internal/tooling/faults"
	"github.com/kvflow/kvflow/internal/tooling/testkit/loopback"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// Options shape a loopback cluster: prefill instances of PrefillTP ranks
// each, one decode instance of DecodeTP ranks, all real workers (real
// side channel over ZMQ, real TCP transfer engine, host memory caches).
type Options struct {
	// PrefillTP and DecodeTP are the instances' tensor-parallel sizes;
	// PrefillTP >= DecodeTP keeps one DONE per prefill rank. 4 and 2: a
	// stitch (P = 2) and two decode ranks reading different prefill ranks.
	PrefillTP, DecodeTP int
	// Prefills is the number of prefill instances at start. 2: one can be
	// killed while the other keeps serving.
	Prefills int
	// Layers and Blocks size the model: 2 layers keep batches small; 128
	// blocks per cache leave room for ~30 requests of up to 4 blocks.
	Layers, Blocks int
	// AbortTimeout is the prefill side's force-free timeout: a request whose
	// DONE was dropped is freed after it. 2 s: far above a request's latency
	// under the injected delays (tens of ms), short enough to wait out.
	AbortTimeout time.Duration
	// LeaseTTL is the prefill side's tracker.lease_ttl (0: leases off, the
	// default here, so the other tests see the seed's expiry alone); decode
	// workers renew at ranks that advertise it. Decode workers know
	// AbortTimeout too (decode.Options.PeerAbortTimeout): without a lease,
	// a read that would start past it fails instead of reading.
	LeaseTTL time.Duration
	// HandshakeTimeout is one side-channel attempt's timeout (3 attempts).
	// 300 ms: a dead peer fails a request within ~1.5 s.
	HandshakeTimeout time.Duration
	Logger           *slog.Logger
}

// DefaultOptions are the options the driver tests use.
func DefaultOptions() Options {
	return Options{PrefillTP: 4, DecodeTP: 2, Prefills: 2, Layers: 2, Blocks: 128,
		AbortTimeout: 2 * time.Second, HandshakeTimeout: 300 * time.Millisecond}
}

func (o Options) withDefaults() Options {
	d := DefaultOptions()
	if o.PrefillTP == 0 {
		o.PrefillTP = d.PrefillTP
	}
	if o.DecodeTP == 0 {
		o.DecodeTP = d.DecodeTP
	}
	if o.Prefills == 0 {
		o.Prefills = d.Prefills
	}
	if o.Layers == 0 {
		o.Layers = d.Layers
	}
	if o.Blocks == 0 {
		o.Blocks = d.Blocks
	}
	if o.AbortTimeout == 0 {
		o.AbortTimeout = d.AbortTimeout
	}
	if o.HandshakeTimeout == 0 {
		o.HandshakeTimeout = d.HandshakeTimeout
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o
}

// Prefill is one prefill instance: PrefillTP ranks behind kv_port Port.
type Prefill struct {
	Name  string // engine id
	Port  int
	Ranks []*node.Node
	Dead  bool
}

// DecodeRank is one decode rank: a node (its cache, engine and side-channel
// client; the node's own decode worker stays idle) and the decode worker
// of the current round, built with fault wrappers around adapters of the
// node's client and engine.
type DecodeRank struct {
	Node   *node.Node
	Worker *decode.Worker
	Faults *faults.Injector

	mu        sync.Mutex
	doneSends map[doneKey]int // SendDone calls reaching the real client
}

type doneKey struct{ endpoint, id string }

// DoneSent reports how many DONEs for request id to the side channel at
// endpoint reached the real client (after fault injection: a dropped DONE
// is not counted, a duplicated one twice).
func (d *DecodeRank) DoneSent(endpoint, id string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.doneSends[doneKey{endpoint, id}]
}

func (d *DecodeRank) forget(endpoints []string, id string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, ep := range endpoints {
		delete(d.doneSends, doneKey{ep, id})
	}
}

// Cluster is a loopback cluster.
type Cluster struct {
	Opts    Options
	Prefill []*Prefill
	Decode  []*DecodeRank
	next    int // prefill instances started
}

// Start starts a cluster; decode workers are built by Reset.
func Start(o Options) (_ *Cluster, err error) {
	o = o.withDefaults()
	c := &Cluster{Opts: o}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	for range o.Prefills {
		if _, err := c.AddPrefill(); err != nil {
			return nil, err
		}
	}
	if err := c.startDecode(); err != nil {
		return nil, fmt.Errorf("soak: start decode: %w", err)
	}
	return c, nil
}

func (c *Cluster) config(role config.Role, kvPort int, engine string) config.Config {
	o := c.Opts
	cfg := loopback.Config(loopback.Worker{Role: role, EngineID: engine, KVPort: kvPort,
		Prefill: loopback.TP(o.PrefillTP), Decode: loopback.TP(o.DecodeTP),
		Model:            config.Model{NumLayers: o.Layers, NumKVHeads: 8, HeadDim: 16, BlockSize: 16, DType: "bf16", NumBlocks: o.Blocks},
		HandshakeTimeout: o.HandshakeTimeout})
	cfg.Tracker.AbortRequestTimeout = config.Duration(o.AbortTimeout)
	cfg.Tracker.LeaseTTL = config.Duration(o.LeaseTTL)
	return cfg
}

// AddPrefill starts a new prefill instance on free ports.
func (c *Cluster) AddPrefill() (*Prefill, error) {
	name := fmt.Sprintf("P%d", c.next)
	ranks, port, err := loopback.StartRanks(nil, func(port int) []config.Config {
		cfgs := make([]config.Config, c.Opts.PrefillTP)
		for r := range cfgs {
			cfgs[r] = c.config(config.Prefill, port, name)
			cfgs[r].Rank = config.Rank{TP: r}
		}
		return cfgs
	}, func(int) node.Deps { return node.Deps{Logger: c.Opts.Logger} })
	if err != nil {
		return nil, fmt.Errorf("soak: start prefill instance: %w", err)
	}
	p := &Prefill{Name: name, Port: port, Ranks: ranks}
	c.next++
	c.Prefill = append(c.Prefill, p)
	return p, nil
}

// Kill closes every rank of p (a prefill instance dying); requests in
// flight to it must fail.
func (c *Cluster) Kill(p *Prefill) error {
	if p.Dead {
		return nil
	}
	p.Dead = true
	return loopback.CloseNodes(p.Ranks...)
}

// startDecode starts the decode instance's ranks on a free kv_port.
func (c *Cluster) startDecode() error {
	ns, _, err := loopback.StartRanks(nil, func(port int) []config.Config {
		cfgs := make([]config.Config, c.Opts.DecodeTP)
		for r := range cfgs {
			cfgs[r] = c.config(config.Decode, port, "D")
			cfgs[r].Rank = config.Rank{TP: r}
		}
		return cfgs
	}, func(int) node.Deps { return node.Deps{Logger: c.Opts.Logger} })
	if err != nil {
		return err
	}
	c.Decode = nil
	for _, n := range ns {
		c.Decode = append(c.Decode, &DecodeRank{Node: n, doneSends: map[doneKey]int{}})
	}
	return nil
}

// Reset closes the decode workers of the last round (draining them) and
// builds new ones whose stage interfaces are wrapped by an injector of
// sched(rank).
func (c *Cluster) Reset(sched func(rank int) faults.Schedule) error {
	if err := c.closeWorkers(); err != nil {
		return err
	}
	for r, d := range c.Decode {
		in, err := faults.New(sched(r))
		if err != nil {
			return err
		}
		n := d.Node
		cfg := n.Config
		w, err := decode.New(decode.Options{
			Topology:         cfg.Topology(),
			Self:             cfg.Self(),
			LocalEngineID:    cfg.KVTransfer.EngineID,
			Fetcher:          in.Fetcher(node.Fetcher(n.Client)),
			Transfer:         in.Transfer(read.Engine(n.Engine)),
			Sender:           in.Sender(sender{n.Notify, d}),
			Renewer:          n.Notify,
			PeerAbortTimeout: cfg.Tracker.AbortRequestTimeout.D(),
			Kernel:           n.Device,
			Layout:           node.CacheLayout(n.Device.Layout()),
			Local:            plan.Caches{Base: n.Device.BaseAddrs(), NumBlocks: n.Shape.NumBlocks},
			Handshake:        cfg.Handshake,
			Read:             cfg.Read,
			Notify:           cfg.Notify,
			Registerer:       prometheus.NewRegistry(),
			Logger:           c.Opts.Logger,
		})
		if err != nil {
			return err
		}
		d.Worker, d.Faults = w, in
	}
	return nil
}

func (c *Cluster) closeWorkers() error {
	var errs []error
	for _, d := range c.Decode {
		if d.Worker == nil {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		errs = append(errs, d.Worker.Close(ctx))
		cancel()
		d.Worker = nil
	}
	return errors.Join(errs...)
}

// Close stops everything.
func (c *Cluster) Close() error {
	errs := []error{c.closeWorkers()}
	for _, d := range c.Decode {
		errs = append(errs, loopback.CloseNodes(d.Node))
	}
	for _, p := range c.Prefill {
		errs = append(errs, c.Kill(p))
	}
	c.Decode, c.Prefill = nil, nil
	return errors.Join(errs...)
}

// sender is a side-channel sender that counts DONEs.
type sender struct {
	c *sidechannel.Client
	d *DecodeRank
}

func (s sender) SendDone(ctx context.Context, endpoint, reqID string) error {
	s.d.mu.Lock()
	s.d.doneSends[doneKey{endpoint, reqID}]++
	s.d.mu.Unlock()
	return s.c.SendDone(ctx, endpoint, reqID)
}
