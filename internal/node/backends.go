package node

import (
	"fmt"
	"log/slog"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/config"
)

// The backends a worker is built on, chosen by config: its KV-cache memory
// (an npu.Device) and its transfer engine (a mooncake.Engine). The rest of
// the node holds only those interfaces; an engine's optional capabilities
// (read grants, data-plane authentication, peer buffers, strided reads)
// are resolved once, where they are wired (Start, read.Engine). A new
// backend is a case here. Mooncake's engine (cgo) is opened by
// backends_mooncake.go, built only with -tags mooncake, so that default
// builds neither import cgo for it nor need Mooncake.

// openDevice opens the KV-cache memory cfg.Cache.Mode names.
func openDevice(cfg config.Config, layout npu.Layout, shape npu.Shape, log *slog.Logger) (npu.Device, error) {
	hopts := npu.HostOptions{NoHugePages: cfg.Cache.NoHugePages, RemoveOnClose: cfg.Cache.RemoveOnClose, NoLock: cfg.Cache.NoLock}
	var h *npu.Host
	var err error
	switch cfg.Cache.Mode {
	case config.CacheShm:
		h, err = npu.CreateShm(cfg.CachePath(), layout, hopts)
	case config.CacheShmAttach:
		hopts.Expect = &shape
		h, err = npu.OpenShm(cfg.CachePath(), hopts)
	default:
		h, err = npu.NewHost(layout, hopts)
	}
	if err != nil {
		return nil, err
	}
	if how := h.Reclaimed(); how != "" {
		log.Warn("kv cache file left by a dead worker taken over", "path", h.Path(), "how", how)
	}
	if locked, lerr := h.Locked(); !locked && lerr != nil {
		log.Warn("kv cache memory not locked: transfers may fault pages in, and reclaim may take them", "err", lerr)
	}
	return h, nil
}

// openEngine starts the transfer engine cfg.Node.TEBackend names, and
// logs at warn what it cannot do of what cfg asks (config.BackendFallbacks:
// Mooncake's engine has no read grants, no data-plane credential, no
// strided reads).
func openEngine(cfg config.Config, deps Deps, log *slog.Logger) (mooncake.Engine, error) {
	for _, f := range cfg.BackendFallbacks() {
		log.Warn("transfer backend falls back", "te_backend", cfg.Node.TEBackend, "setting", f.Key, "instead", f.Note)
	}
	switch cfg.Node.TEBackend {
	case "", config.BackendTCP, config.BackendShm: // shm: TCP for every peer whose same-host claim does not hold
	case config.BackendMooncake:
		// backends_mooncake.go with -tags mooncake; a refusal without.
		return openMooncake(cfg, deps, log)
	default:
		return nil, fmt.Errorf("node.te_backend %q: unknown backend", cfg.Node.TEBackend)
	}
	tc := mooncake.DefaultTCPConfig()
	tc.Host = cfg.TEHost()
	// Both ports fixed (node.te_port, node.te_data_port) or 0: a free one.
	// shm reads peers on other hosts over this engine, so they apply there
	// too; mooncake picks its own (config.Validate refuses fixed ones).
	tc.RPCPort, tc.DataPort = cfg.Node.TEPort, cfg.Node.TEDataPort
	lim := cfg.Node.Limits
	tc.FirstByteTimeout, tc.IdleTimeout = lim.TEFirstByteTimeout.D(), lim.TEIdleTimeout.D()
	tc.MaxConns, tc.MaxConnsPerPeer, tc.FDReserve = lim.TEMaxConns, lim.TEMaxConnsPerPeer, lim.FDReserve
	// A decode worker's cache is read by no one (kvflow and the seed only
	// pull from prefill): it serves no read at all (grants on, none ever
	// given), so a peer that reaches its data port cannot read it.
	tc.ReadGrants = (cfg.Read.Grants != config.GrantsOff && cfg.Role() == config.Prefill) || cfg.Role() == config.Decode
	// With auth.mode curve both ports serve only peers holding a
	// credential this worker's side channel issued (a decode worker
	// issues none: no one may handshake with it or read it).
	tc.RequireAuth = cfg.DataPlaneAuth()
	e, err := mooncake.NewTCPEngine(tc, deps.Registerer, log)
	if err != nil {
		// Name the keys: "listen data 10.0.0.2:17001: address already in
		// use" alone does not say which setting to change.
		return nil, fmt.Errorf("node.te_port %d, node.te_data_port %d: %w", tc.RPCPort, tc.DataPort, err)
	}
	return e, nil
}
