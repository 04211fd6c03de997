package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvflow/kvflow/internal/cli/clierr"
	"github.com/kvflow/kvflow/internal/cli/flaghelp"
)

// Exit codes.
const (
	exitOK      = 0
	exitRuntime = 1
	exitUsage   = 2
)

// usageError marks errors that exit with code 2.
type usageError struct{ err error }

func (u usageError) Error() string { return u.err.Error() }
func (u usageError) Unwrap() error { return u.err }

func usagef(format string, a ...any) error { return usageError{fmt.Errorf(format, a...)} }

var version = "dev"

type command struct {
	name, summary string
	run           func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		{"serve", "run one prefill or decode worker", runServe},
		{"demo", "prefill and decode workers on loopback, every byte verified", runDemo},
		{"plan", "validate a topology and print a request's plan", runPlan},
		{"probe", "fetch a side channel's metadata and cache fingerprint, compare it with a decode config, optionally send a DONE", runProbe},
		{"bench", "benchmarks: te (transfer engine), e2e", runBench},
		{"keygen", "write a CURVE key pair for auth.mode curve", runKeygen},
		{"version", "print the version, commit, Go version and build tags", runVersion},
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: kvflow <command> [flags]\n\ncommands:")
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-8s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w, "\nRun 'kvflow <command> -h' for a command's flags.")
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return exitUsage
	}
	if args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stdout)
		return exitOK
	}
	for _, c := range commands() {
		if c.name != args[0] {
			continue
		}
		err := c.run(ctx, args[1:], stdout, stderr)
		switch {
		case err == nil:
			return exitOK
		case errors.Is(err, flag.ErrHelp):
			return exitOK
		case errors.As(err, new(usageError)), clierr.IsUsage(err):
			fmt.Fprintf(stderr, "kvflow %s: %v\nRun 'kvflow %s --help' for usage.\n", c.name, err, c.name)
			return exitUsage
		default:
			fmt.Fprintf(stderr, "kvflow %s: %v\n", c.name, err)
			return exitRuntime
		}
	}
	fmt.Fprintf(stderr, "kvflow: unknown command %q\n\n", args[0])
	usage(stderr)
	return exitUsage
}

// newFlagSet is a subcommand's flag set. The flag package prints nothing
// itself: a parse error is returned (and printed once by run, with a
// pointer to --help), and -h/--help prints the flags on stdout (printHelp).
func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// printHelp writes the usage line and flags of fs to w.
func printHelp(fs *flag.FlagSet, w io.Writer) {
	n := 0
	fs.VisitAll(func(*flag.Flag) { n++ })
	if n == 0 {
		fmt.Fprintf(w, "usage: kvflow %s\n\n(no flags)\n", fs.Name())
		return
	}
	fmt.Fprintf(w, "usage: kvflow %s [flags]\n\nflags:\n", fs.Name())
	flaghelp.Print(w, fs)
}

// parseFlags parses fs, turning flag errors into usage errors; -h prints
// the flags on stdout and returns flag.ErrHelp.
func parseFlags(fs *flag.FlagSet, args []string, stdout io.Writer) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printHelp(fs, stdout)
			return err
		}
		return usageError{err}
	}
	return clierr.ArgsLeft(fs, args)
}
