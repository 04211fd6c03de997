package benche2e

import (
	"context"
	"fmt"

	"github.com/kvflow/kvflow/internal/tooling/netem"
)

// checkNetem checks a --netem spec's syntax (before anything starts).
func checkNetem(spec string) error {
	_, err := netem.Tokens(spec)
	return err
}

// netemModeOf parses --netem-mode.
func netemModeOf(s string) (netem.Mode, error) {
	switch s {
	case "auto", "":
		return netem.ModeAuto, nil
	case "kernel":
		return netem.ModeKernel, nil
	case "queue":
		return netem.ModeQueue, nil
	case "relay":
		return netem.ModeUserspace, nil
	}
	return 0, fmt.Errorf("unknown mode %q: want auto, kernel, queue or relay", s)
}

// setupNet makes the namespaces and the emulated link of --netem (kernel
// netem over a veth pair; where the kernel has no sch_netem, a netfilter
// queue holding the veth's packets for the delay, else the userspace
// delay relay). Without root or namespaces it fails with a message saying
// why (netem.ErrUnavailable).
func setupNet(ctx context.Context, spec string, mode netem.Mode) (Net, error) {
	n, err := netem.Setup(ctx, netem.Options{Spec: spec, Mode: mode})
	if err != nil {
		return nil, fmt.Errorf("bench e2e: --netem %q: %w", spec, err)
	}
	return n, nil
}

var _ Net = (*netem.Net)(nil)
