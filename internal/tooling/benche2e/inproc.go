package benche2e

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/node"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/tooling/stagehist"
	"github.com/kvflow/kvflow/internal/tooling/testkit"
)

// inproc runs the workers as nodes in this process (node.Start per rank:
// real TCP transfer engines and ZMQ side channels on loopback). Results
// reach the collector from the decode nodes' OnFinish, stage histograms
// come from their registries.
type inproc struct {
	prefill []*node.Node
	decode  []*node.Node
	regs    []*prometheus.Registry
}

func startInProc(w Workload, log *slog.Logger) (*cluster, error) {
	var c *cluster
	_, err := testkit.OnFreePort(nil, func(kvPort int) (err error) {
		c, err = tryInProc(w, kvPort, log)
		return err
	})
	return c, err
}

func tryInProc(w Workload, kvPort int, log *slog.Logger) (_ *cluster, err error) {
	_, local, pool := w.requests()
	be := &inproc{}
	c := &cluster{w: w, kvPort: kvPort, host: "127.0.0.1", col: newCollector(), be: be}
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
		be.prefill = append(be.prefill, n)
		c.prefill = append(c.prefill, rank{cfg: n.Config, dev: n.Device})
	}
	finish := func(res decode.Result) { c.col.finish(res.RequestID, res.Bytes, res.Err, time.Now()) }
	for r := range w.DecodeTP {
		reg := prometheus.NewRegistry()
		n, err := node.Start(w.config(config.Decode, r, kvPort, pool, local), node.Deps{Logger: log, Registerer: reg, OnFinish: finish})
		if err != nil {
			return nil, fmt.Errorf("decode rank %d: %w", r, err)
		}
		be.decode = append(be.decode, n)
		be.regs = append(be.regs, reg)
		c.decode = append(c.decode, rank{cfg: n.Config, dev: n.Device})
	}
	c.prepare()
	return c, nil
}

func (b *inproc) describe() string { return "in-process workers on loopback (node.Start per rank)" }

func (b *inproc) send(ctx context.Context, reqs []prefill.SendRequest) error {
	for _, p := range b.prefill {
		for i, err := range p.Prefill.Send(reqs) {
			if err != nil {
				return fmt.Errorf("prefill send %s: %w", reqs[i].RequestID, err)
			}
		}
	}
	return nil
}

func (b *inproc) load(ctx context.Context, reqs []decode.LoadRequest) error {
	for _, d := range b.decode {
		for i, err := range d.Decode.Load(ctx, reqs) {
			if err != nil {
				return fmt.Errorf("load %s: %w", reqs[i].RequestID, err)
			}
		}
	}
	return nil
}

func (b *inproc) stages(ctx context.Context) stagehist.Set {
	out := stagehist.Set{}
	for _, reg := range b.regs {
		if mfs, err := reg.Gather(); err == nil {
			out.Add(mfs)
		}
	}
	return out
}

// drain empties the finished lists so long runs keep memory flat (decode
// results already reached the collector).
func (b *inproc) drain(ctx context.Context) {
	for _, d := range b.decode {
		d.Decode.Finished()
	}
	for _, p := range b.prefill {
		p.Prefill.Finished()
	}
}

func (b *inproc) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, n := range append(append([]*node.Node(nil), b.decode...), b.prefill...) {
		n.Close(ctx)
	}
}
