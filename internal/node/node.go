package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/peers"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// Deps are what the caller injects.
type Deps struct {
	Registerer prometheus.Registerer
	Logger     *slog.Logger
	// OnFinish observes decode results (the demo's progress bar).
	OnFinish func(decode.Result)
	// BootEpoch is sent in the prefill side's metadata; 0 = unix nanos at
	// start.
	BootEpoch uint64
}

// Node is a running worker.
type Node struct {
	Config config.Config
	Shape  npu.Shape
	// Device is the KV-cache memory and Engine the transfer engine, the
	// backends cfg chose (backends.go).
	Device npu.Device
	Engine mooncake.Engine
	ZMQ    *sidechannel.Context
	// Client (decode) makes GET_META calls, with handshake.timeout,
	// handshake.attempts and handshake.retry_backoff.
	Client *sidechannel.Client
	// Notify (decode) makes DONE_RECVING, batched DONE and RENEW calls,
	// with notify.timeout, notify.attempts and notify.retry_backoff: a
	// client of its own (own socket pool), so each call gets its own
	// section's retries and a burst of one kind never waits for sockets
	// held by the other.
	Notify *sidechannel.Client
	// Fetcher and Transfer (decode) are the decode worker's GET_META and
	// read interfaces as this node built them: each GET_META reply's
	// data-plane credential handed to Engine (auth.mode curve), its
	// transfer session owned by the side-channel endpoint that first named
	// it (creds.go), its same-host claim taken (te_backend shm). A decode
	// worker built outside the node (the soak's) uses these so that it
	// reads as the node's own would.
	Fetcher  handshake.Fetcher
	Transfer read.Transfer
	Server   *sidechannel.Server
	Decode   *decode.Worker
	Prefill  *prefill.Worker
	// Peers (decode) is the prefill peers' health, served at /debug/peers.
	Peers *peers.Tracker
	// Curve is the side channel's CURVE configuration when auth.mode is
	// curve (nil: plain, seed-compatible).
	Curve *sidechannel.Curve

	deps    Deps
	closers []func(context.Context) error
}

// Start opens the cache, the engine, the side channel and the role of a
// validated configuration.
func Start(cfg config.Config, deps Deps) (_ *Node, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("node: config: %w", err)
	}
	if deps.Logger == nil {
		deps.Logger = slog.New(slog.DiscardHandler)
	}
	if deps.Registerer == nil {
		deps.Registerer = prometheus.NewRegistry()
	}
	n := &Node{Config: cfg, deps: deps}
	defer func() {
		if err != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			n.Close(ctx)
		}
	}()
	log := deps.Logger.With("role", cfg.Role().String(), "engine_id", cfg.KVTransfer.EngineID, "tp_rank", cfg.Rank.TP, "pp_rank", cfg.Rank.PP)

	shape, err := cfg.Shape()
	if err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	n.Shape = shape
	layout, err := npu.NewLayout(shape)
	if err != nil {
		return nil, fmt.Errorf("node: cache layout: %w", err)
	}
	if n.Device, err = openDevice(cfg, layout, shape, log); err != nil {
		return nil, fmt.Errorf("node: kv cache: %w", err)
	}
	n.closers = append(n.closers, func(context.Context) error { return n.Device.Close() })
	if n.Engine, err = openEngine(cfg, deps, log); err != nil {
		return nil, fmt.Errorf("node: transfer engine: %w", err)
	}
	n.closers = append(n.closers, func(context.Context) error { return n.Engine.Close() })
	if err := npu.RegisterAll(n.Engine, n.Device); err != nil {
		return nil, fmt.Errorf("node: register kv cache: %w", err)
	}

	if cfg.Auth.Mode == config.AuthCurve {
		c, err := sidechannel.LoadCurveKeys(cfg.Auth.SecretKeyFile, cfg.Auth.PublicKeyFile,
			cfg.Auth.ServerPublicKeyFile, cfg.Auth.AuthorizedKeysFile)
		if err != nil {
			return nil, fmt.Errorf("node: auth keys: %w", err)
		}
		n.Curve = &c
	}
	n.ZMQ, err = sidechannel.NewContext(sidechannel.ContextOptions{Registerer: deps.Registerer, Logger: log})
	if err != nil {
		return nil, fmt.Errorf("node: side channel: %w", err)
	}
	n.closers = append(n.closers, func(context.Context) error { return n.ZMQ.Close() })

	switch cfg.Role() {
	case config.Decode:
		err = n.startDecode(log, layout)
	case config.Prefill:
		err = n.startPrefill(log)
	}
	if err != nil {
		return nil, err
	}
	log.Info("worker started", "handshake_port", cfg.HandshakePort(), "te_session", n.Engine.SessionID(),
		"cache_bytes", layout.Size(), "layers", shape.NumLayers, "kv_heads", shape.NumKVHeads, "blocks", shape.NumBlocks)
	return n, nil
}

func (n *Node) startDecode(log *slog.Logger, layout npu.Layout) error {
	cfg := n.Config
	hc, err := n.sideClient("handshake", cfg.Handshake.Timeout.D(), cfg.Handshake.Attempts, cfg.Handshake.RetryBackoff.D())
	if err != nil {
		return err
	}
	n.Client = hc
	nc, err := n.sideClient("notify", cfg.Notify.Timeout.D(), cfg.Notify.Attempts, cfg.Notify.RetryBackoff.D())
	if err != nil {
		return err
	}
	n.Notify = nc
	fp := Fingerprint(cfg, layout)
	fetch := fetcher{c: hc, owners: newCredOwners(n.deps.Registerer, log)}
	if a, ok := n.Engine.(mooncake.PeerAuthenticator); ok {
		fetch.creds = a
	}
	health, err := peers.New(peers.Options{
		DownAfter: cfg.Peers.DownAfter, ProbeInterval: cfg.Peers.ProbeInterval.D(), MaxPeers: cfg.Peers.MaxPeers,
		Probe: func(ctx context.Context, endpoint string) error {
			_, err := fetch.GetMeta(ctx, endpoint)
			return err
		},
		Registerer: n.deps.Registerer, Logger: log,
	})
	if err != nil {
		return err
	}
	n.Peers = health
	probeCtx, stopProbes := context.WithCancel(context.Background())
	var probes sync.WaitGroup
	probes.Go(func() { health.Run(probeCtx) })
	n.closers = append(n.closers, func(context.Context) error { stopProbes(); probes.Wait(); return nil })
	transfer := read.Engine(n.Engine)
	if cfg.Node.TEBackend == config.BackendShm {
		sh := newSameHost(transfer, n.Device, n.deps.Registerer, log)
		n.closers = append(n.closers, func(context.Context) error { return sh.Close() })
		fetch.sh, transfer = sh, sh
	}
	n.Fetcher, n.Transfer = fetch, transfer
	w, err := decode.New(decode.Options{
		Topology:         cfg.Topology(),
		Self:             cfg.Self(),
		LocalEngineID:    cfg.KVTransfer.EngineID,
		Fetcher:          fetch,
		Transfer:         transfer,
		Kernel:           n.Device,
		Sender:           nc,
		Renewer:          nc,
		Layout:           CacheLayout(layout),
		Local:            plan.Caches{Base: n.Device.BaseAddrs(), NumBlocks: n.Shape.NumBlocks},
		LocalCache:       &fp,
		PeerBuffers:      PeerBuffers(n.Engine),
		Stages:           decode.SizesOf(cfg.Pipeline.Pool),
		Handshake:        cfg.Handshake,
		Read:             cfg.Read,
		Notify:           cfg.Notify,
		Peers:            cfg.Peers,
		Health:           health,
		BlockSize:        cfg.Model.BlockSize,
		PeerAbortTimeout: cfg.Tracker.AbortRequestTimeout.D(),
		OnFinish:         n.deps.OnFinish,
		Registerer:       n.deps.Registerer,
		Logger:           log,
	})
	if err != nil {
		return fmt.Errorf("node: decode worker: %w", err)
	}
	n.Decode = w
	n.closers = append(n.closers, w.Close)
	return nil
}

// sideClient opens a side-channel client with one config section's
// per-attempt timeout, attempts and backoff (what is the section's name,
// for errors), closed with the node.
func (n *Node) sideClient(what string, timeout time.Duration, attempts int, backoff time.Duration) (*sidechannel.Client, error) {
	sc := sidechannel.DefaultClientOptions()
	sc.AttemptTimeout = timeout
	sc.Attempts = attempts
	sc.RetryBackoff = backoff
	sc.Curve = n.Curve
	c, err := sidechannel.NewClient(n.ZMQ, sc)
	if err != nil {
		return nil, fmt.Errorf("node: side-channel client (%s): %w", what, err)
	}
	n.closers = append(n.closers, func(context.Context) error { return c.Close() })
	return c, nil
}

func (n *Node) startPrefill(log *slog.Logger) error {
	cfg := n.Config
	epoch := n.deps.BootEpoch
	if epoch == 0 {
		epoch = uint64(time.Now().UnixNano())
	}
	fp := Fingerprint(cfg, n.Device.Layout())
	var grants prefill.Grants
	mode := prefill.GrantsAuto
	switch cfg.ReadGrants() {
	case config.GrantsOff:
		if cfg.Read.Grants != config.GrantsOff {
			break // the backend has no grants: openEngine warned
		}
		log.Warn("read.grants=off: any peer that reaches the transfer engine's data port can read every registered block at any time, " +
			"and a decode reading after a forged or early DONE freed its request may get reused blocks and report them done; " +
			"set read.grants=auto (the default) unless a peer must read blocks no send names")
	case config.GrantsOn:
		mode = prefill.GrantsStrict
		fallthrough
	default:
		g, ok := n.Engine.(mooncake.Granter)
		if !ok {
			return fmt.Errorf("node: read.grants %q: the transfer engine has no read grants (set read.grants off)", cfg.Read.Grants)
		}
		grants = engineGrants{e: g, d: n.Device}
	}
	var claim *sidechannel.SameHost
	if cfg.Node.TEBackend == config.BackendShm {
		var err error
		if grants, claim, err = n.openGrantTable(grants, log); err != nil {
			return err
		}
	}
	w, err := prefill.New(prefill.Options{
		Topology:     cfg.Topology(),
		Self:         cfg.Self(),
		AbortTimeout: cfg.Tracker.AbortRequestTimeout.D(),
		HeldAgeAlert: cfg.Tracker.HeldAgeAlert.D(),
		LeaseTTL:     cfg.Tracker.LeaseTTL.D(),
		NoBatchDone:  !cfg.Tracker.BatchDone,
		Grants:       grants,
		GrantMode:    mode,
		Registerer:   n.deps.Registerer,
		Logger:       log,
		Metadata: sidechannel.Metadata{
			EngineID:         cfg.KVTransfer.EngineID,
			TERPCPort:        n.Engine.RPCPort(),
			KVCachesBaseAddr: n.Device.BaseAddrs(),
			NumBlocks:        n.Shape.NumBlocks,
			// The cache fingerprint lets kvflow decode workers refuse a
			// cache shaped other than theirs before reading it.
			Ext: sidechannel.Ext{BootEpoch: epoch, Cache: &fp, SameHost: claim},
		},
	})
	if err != nil {
		return fmt.Errorf("node: prefill worker: %w", err)
	}
	n.Prefill = w
	// The side-channel port is bounded like the transfer engine's: without
	// limits libzmq accepts until descriptors run out, and the control
	// socket's next ipc accept then aborts the process.
	sideLimits := sidechannel.DefaultLimits
	sideLimits.MaxConns = cfg.Node.Limits.SideChannelMaxConns
	sideLimits.MaxConnsPerPeer = cfg.Node.Limits.SideChannelMaxConnsPerPeer
	// The side channel may use the upper half of the descriptor reserve
	// the transfer engine leaves: a flood of the data port fills the
	// process up to the reserve, and decodes must still reach GET_META
	// (with the same threshold the side channel refused them until the
	// flood's connections hit their first-byte timeout). A side-channel
	// flood stops at half the reserve, which keeps the rest for the
	// control socket and HTTP.
	sideLimits.FDReserve = cfg.Node.Limits.FDReserve / 2
	so := sidechannel.ServerOptions{
		Addr:   net.JoinHostPort(cfg.Node.SideChannelHost, strconv.Itoa(cfg.HandshakePort())),
		Curve:  n.Curve,
		Limits: &sideLimits,
	}
	if cfg.DataPlaneAuth() {
		// Each authenticated decode gets the transfer-engine credential of
		// its own CURVE key in its GET_META reply.
		a, ok := n.Engine.(mooncake.PeerAuthenticator)
		if !ok {
			return fmt.Errorf("node: auth.mode %s: the transfer engine has no data-plane authentication", cfg.Auth.Mode)
		}
		so.AuthToken = a.AuthToken
	}
	srv, err := sidechannel.NewServer(n.ZMQ, so, w)
	if err != nil {
		return fmt.Errorf("node: side-channel server on port %d: %w", cfg.HandshakePort(), err)
	}
	n.Server = srv
	n.closers = append(n.closers, func(context.Context) error { return srv.Close() })
	return nil
}

// Close drains the role within ctx, then closes everything in reverse
// order of opening.
func (n *Node) Close(ctx context.Context) error {
	var errs []error
	for i := len(n.closers) - 1; i >= 0; i-- {
		if err := n.closers[i](ctx); err != nil {
			errs = append(errs, err)
		}
	}
	n.closers = nil
	return errors.Join(errs...)
}
