package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/kvflow/kvflow/internal/cli/plancmd"
	"github.com/kvflow/kvflow/internal/tooling/benche2e"
	"github.com/kvflow/kvflow/internal/tooling/benchte"
)

func runPlan(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return plancmd.Run(ctx, args, stdout, stderr)
}

// benchCommands are the subcommands of `kvflow bench`.
var benchCommands = map[string]func(ctx context.Context, args []string, stdout, stderr io.Writer) error{
	"te":  benchte.Run,
	"e2e": benche2e.Run,
}

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "-help" || args[0] == "help") {
		fmt.Fprint(stdout, "usage: kvflow bench te|e2e [flags]\n\n"+
			"  te   the transfer engine alone (Mooncake transfer_engine_bench's flags)\n"+
			"  e2e  kvflow's pipeline against a serial baseline on the same workers\n\n"+
			"Run 'kvflow bench te --help' or 'kvflow bench e2e --help' for their flags.\n")
		return flag.ErrHelp
	}
	if len(args) == 0 {
		return usagef("bench: want a subcommand: te (transfer engine, Mooncake transfer_engine_bench flags) or e2e (end to end)")
	}
	run, ok := benchCommands[args[0]]
	if !ok {
		return usagef("bench: unknown subcommand %q (want te or e2e)", args[0])
	}
	return run(ctx, args[1:], stdout, stderr)
}
