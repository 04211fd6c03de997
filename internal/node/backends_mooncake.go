//go:build mooncake && cgo

package node

import (
	"log/slog"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/hw/mooncake/mooncakec"
	"github.com/kvflow/kvflow/internal/config"
)

// openMooncake starts Mooncake's transfer engine through its C API
// (node.te_backend mooncake; this file is built only with -tags mooncake).
// Segment descriptors are exchanged peer to peer on the RPC port, so the
// engine's session is host:te_rpc_port as with the tcp engine, and the
// seed's metadata names it. Completion is polled with the binding's
// bounded backoff (20 µs doubling to 1 ms), never a spin.
//
// In that mode Mooncake picks its RPC port itself (at random in
// MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, environment read once per process;
// 15000–17000 by default), and its data port too: config.Validate refuses
// a fixed node.te_port or node.te_data_port.
func openMooncake(cfg config.Config, deps Deps, log *slog.Logger) (mooncake.Engine, error) {
	mc := mooncakec.DefaultCgoConfig()
	mc.Host = cfg.TEHost()
	mc.RPCPort = cfg.Node.TEPort
	mc.Protocol = cfg.Node.Mooncake.Protocol
	mc.Location = cfg.Node.Mooncake.Location
	mc.NICPriorityMatrix = cfg.Node.Mooncake.NICPriorityMatrix
	// No one reads from (or writes to) a decode cache: registered without
	// remote access, which Mooncake's rdma transport enforces (its tcp
	// transport does not: config.BackendFallbacks says so).
	mc.LocalOnly = cfg.Role() == config.Decode
	return mooncakec.NewCgoEngine(mc, deps.Registerer, log)
}
