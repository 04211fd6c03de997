// Package clierr marks the errors of kvflow's subcommands that are the
// caller's fault (bad flags, bad configuration, bad input), so that
// cmd/kvflow can exit with code 2 for them and 1 for everything else.
//
// # Contract
//
//	err := plancmd.Run(ctx, args, stdout, stderr)
//	switch {
//	case errors.Is(err, flag.ErrHelp): // -h: usage was printed, exit 0
//	case clierr.IsUsage(err):          // exit 2
//	case err != nil:                   // exit 1
//	}
//
// A usage error is always a *UsageError somewhere in the chain (errors.As with
// a **UsageError target, or IsUsage). flag.ErrHelp is passed through
// unwrapped, never as a usage error.
//
// # Never
//
// This package never prints, never exits and holds no state.
package clierr
