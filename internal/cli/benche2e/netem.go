package benche2e

import (
	"context"
	"fmt"

	"github.com/kvflow/kvflow/internal/netem"
)

// checkNetem checks a --netem spec's syntax (before anything starts).
func checkNetem(spec string) error {
	_, err := netem.Tokens(spec)
	return err
}

// setupNet makes the namespaces and the emulated link of --netem (kernel
// netem over a veth pair, or the userspace delay relay where the kernel
// has no sch_netem). Without root or namespaces it fails with a message
// saying why (netem.ErrUnavailable).
func setupNet(ctx context.Context, spec string) (Net, error) {
	n, err := netem.Setup(ctx, netem.Options{Spec: spec})
	if err != nil {
		return nil, fmt.Errorf("bench e2e: --netem %q: %w", spec, err)
	}
	return n, nil
}

var _ Net = (*netem.Net)(nil)
