package benche2e

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/kvflow/kvflow/internal/sidechannel"
)

// SlowReadTimeout is the decode workers' read.timeout in the slowpeer
// workload: the stalled rank's reads fail after it, so a run ends.
const SlowReadTimeout = 2 * time.Second

// ModeAlone (slowpeer) runs the healthy requests only: the baseline the
// kvflow run, with the stalled rank's requests among them, is compared to.
const ModeAlone = "alone"

// startSlowPeer starts the stalled prefill rank of the slowpeer workload
// in this process: a side channel on loopback that answers GET_META with
// the real prefill rank 0's metadata (engine id "S", no leases) and ACKs
// DONEs, and a transfer-engine port that accepts connections and never
// answers. It sets c.slowPort and returns the function that stops it.
func (c *cluster) startSlowPeer(ctx context.Context) (func(), error) {
	zctx, err := sidechannel.NewContext(sidechannel.ContextOptions{CloseTimeout: time.Second})
	if err != nil {
		return nil, err
	}
	cl, err := sidechannel.NewClient(zctx, sidechannel.DefaultClientOptions())
	if err != nil {
		zctx.Close()
		return nil, err
	}
	md, err := cl.GetMeta(ctx, net.JoinHostPort(c.host, strconv.Itoa(c.kvPort)))
	cl.Close()
	if err != nil {
		zctx.Close()
		return nil, fmt.Errorf("slow peer: metadata of the healthy rank: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		zctx.Close()
		return nil, err
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Go(func() {
		for {
			cn, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, cn) // held open, never answered
			mu.Unlock()
		}
	})
	md.EngineID = "S"
	md.TERPCPort = ln.Addr().(*net.TCPAddr).Port
	md.Ext.LeaseTTL, md.Ext.BatchDone = 0, false
	srv, err := sidechannel.NewServer(zctx, sidechannel.ServerOptions{Addr: "127.0.0.1:0"},
		sidechannel.HandlerFuncs{MetadataFunc: func() sidechannel.Metadata { return md }})
	if err != nil {
		ln.Close()
		wg.Wait()
		zctx.Close()
		return nil, err
	}
	_, port, _ := net.SplitHostPort(srv.Addr())
	c.slowPort, _ = strconv.Atoi(port)
	return func() {
		srv.Close()
		ln.Close()
		wg.Wait()
		mu.Lock()
		for _, cn := range conns {
			cn.Close()
		}
		mu.Unlock()
		zctx.Close()
	}, nil
}
