package benche2e

import (
	"context"
	"errors"
)

// ErrNoNetem: this build has no network shaping.
var ErrNoNetem = errors.New("bench e2e: --netem is not available in this build (internal/netem is missing)")

// setupNet makes the namespaces and the emulated link of --netem.
func setupNet(ctx context.Context, spec string) (Net, error) {
	return nil, ErrNoNetem
}
