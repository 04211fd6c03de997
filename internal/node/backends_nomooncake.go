//go:build !(mooncake && cgo)

package node

import (
	"fmt"
	"log/slog"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/internal/config"
)

// openMooncake refuses node.te_backend mooncake: this binary was built
// without -tags mooncake, so it has no binding to Mooncake's C API
// (config.Validate says so first).
func openMooncake(config.Config, Deps, *slog.Logger) (mooncake.Engine, error) {
	return nil, fmt.Errorf("node.te_backend %q: %w", config.BackendMooncake, config.ErrMooncakeNotBuilt)
}
