package clierr

import (
	"errors"
	"flag"
	"fmt"
	"strings"
)

// UsageError is an error caused by the command line or the configuration:
// the command should exit with code 2.
type UsageError struct{ Err error }

// Error returns the wrapped error's message.
func (e *UsageError) Error() string {
	if e.Err == nil {
		return "usage error"
	}
	return e.Err.Error()
}

// Unwrap returns the wrapped error.
func (e *UsageError) Unwrap() error { return e.Err }

// Usagef returns a *UsageError with a formatted message (%w is honoured).
func Usagef(format string, a ...any) error {
	return &UsageError{Err: fmt.Errorf(format, a...)}
}

// Usage wraps err as a usage error. nil stays nil, flag.ErrHelp is returned
// as is, and an error that already is a usage error is not wrapped twice.
func Usage(err error) error {
	if err == nil || errors.Is(err, flag.ErrHelp) || IsUsage(err) {
		return err
	}
	return &UsageError{Err: err}
}

// IsUsage reports whether err's chain holds a *UsageError.
func IsUsage(err error) bool {
	var u *UsageError
	return errors.As(err, &u)
}

// ParseFlags parses args with fs and turns flag errors and leftover
// positional arguments into usage errors. flag.ErrHelp (-h) is returned as
// is.
func ParseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		return Usage(err)
	}
	return ArgsLeft(fs, args)
}

// NoArgs is a usage error when fs was left positional arguments.
func NoArgs(fs *flag.FlagSet) error {
	if fs.NArg() > 0 {
		return Usagef("unexpected arguments %q", fs.Args())
	}
	return nil
}

// ArgsLeft is NoArgs for a flag set that parsed args: when the first
// leftover argument follows a flag that takes no separate value (a bool, or
// a mode such as --read-grants that may stand alone), the error says to
// join them with "=" — "--read-grants off" leaves "off" behind, and
// "unexpected arguments" alone does not say why.
func ArgsLeft(fs *flag.FlagSet, args []string) error {
	if fs.NArg() == 0 {
		return nil
	}
	err := fmt.Errorf("unexpected arguments %q", fs.Args())
	if i := len(args) - fs.NArg() - 1; i >= 0 && i < len(args) {
		prev := args[i]
		name := strings.TrimLeft(prev, "-")
		if prev != name && !strings.Contains(name, "=") && name != "" {
			if f := fs.Lookup(name); f != nil {
				if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
					err = fmt.Errorf("%w: --%s takes no separate value; write --%s=%s", err, name, name, fs.Arg(0))
				}
			}
		}
	}
	return &UsageError{Err: err}
}
