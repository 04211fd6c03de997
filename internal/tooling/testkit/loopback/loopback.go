// Package loopback starts kvflow workers in-process on loopback for tests,
// tools and benchmarks: the configuration of a small test worker, nodes
// started on free ports and closed with a bounded wait.
//
// # Never
//
// Product code never imports it (internal/tooling's rule); it never binds
// anything but loopback and never leaves a node running past the Close or
// the test cleanup it registers.
package loopback

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/node"
	"github.com/kvflow/kvflow/internal/tooling/testkit"
)

// CloseTimeout bounds how long CloseNodes waits for the nodes to drain.
const CloseTimeout = 10 * time.Second

// Worker is a test worker's shape: the two instances' parallelism, this
// worker's side and engine, its kv_port and its model.
type Worker struct {
	Role            config.Role
	EngineID        string
	KVPort          int
	Prefill, Decode config.Parallel
	Model           config.Model
	// HandshakeTimeout sets handshake.timeout and notify.timeout
	// (kvflow's defaults when zero).
	HandshakeTimeout time.Duration
}

// Config is config.Default for w: no metrics listener, no huge pages,
// loopback side channel. Callers adjust the rest (ranks, cache, tracker).
func Config(w Worker) config.Config {
	c := config.Default()
	kv := &c.KVTransfer
	kv.KVConnectorExtraConfig.Prefill = w.Prefill
	kv.KVConnectorExtraConfig.Decode = w.Decode
	kv.KVPort = config.Port(w.KVPort)
	kv.KVRole, kv.EngineID = w.Role.KVRole(), w.EngineID
	c.Model = w.Model
	c.Node.MetricsAddr = ""
	c.Cache.NoHugePages = true
	if w.HandshakeTimeout > 0 {
		c.Handshake.Timeout = config.Duration(w.HandshakeTimeout)
		c.Notify.Timeout = config.Duration(w.HandshakeTimeout)
	}
	return c
}

// TP is a single-replica, single-stage parallelism of tp ranks.
func TP(tp int) config.Parallel { return config.Parallel{TPSize: tp, DPSize: 1, PPSize: 1} }

// CloseNodes closes ns in order, waiting at most CloseTimeout in all, and
// returns their errors joined.
func CloseNodes(ns ...*node.Node) error {
	ctx, cancel := context.WithTimeout(context.Background(), CloseTimeout)
	defer cancel()
	var errs []error
	for _, n := range ns {
		if n == nil {
			continue
		}
		if err := n.Close(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// StartRanks starts one node per config that configs(kvPort) returns (an
// instance's ranks, in order), on a free kv_port (testkit.OnFreePort):
// when a rank fails to start, the ranks already started are closed and
// another port is tried. deps gives rank i's dependencies.
func StartRanks(logf func(string, ...any), configs func(kvPort int) []config.Config, deps func(i int) node.Deps) ([]*node.Node, int, error) {
	var ns []*node.Node
	port, err := testkit.OnFreePort(logf, func(port int) error {
		ns = nil
		for i, cfg := range configs(port) {
			n, err := node.Start(cfg, deps(i))
			if err != nil {
				CloseNodes(ns...)
				ns = nil
				return err
			}
			ns = append(ns, n)
		}
		return nil
	})
	if err != nil {
		return nil, 0, err
	}
	return ns, port, nil
}

// Start is StartRanks for a test: it fails t when no port works and
// closes the nodes at the test's end, the last started first.
func Start(t testing.TB, configs func(kvPort int) []config.Config, deps func(i int) node.Deps) ([]*node.Node, int) {
	t.Helper()
	ns, port, err := StartRanks(t.Logf, configs, deps)
	if err != nil {
		t.Fatalf("start workers: %v", err)
	}
	t.Cleanup(func() {
		rev := slices.Clone(ns)
		slices.Reverse(rev)
		CloseNodes(rev...)
	})
	return ns, port
}
