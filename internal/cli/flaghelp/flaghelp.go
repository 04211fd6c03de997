package flaghelp

import (
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// Print writes fs's flags called names, in that order (none: all of fs's,
// sorted), to w, one line each: "  -name kind  explanation (default v)";
// the default is left out when it is its type's zero or the explanation
// already says what happens without the flag ("(default: ...)", "required").
// A name fs lacks is an error (a help list out of step with its flags).
func Print(w io.Writer, fs *flag.FlagSet, names ...string) error {
	var flags []*flag.Flag
	if len(names) == 0 {
		fs.VisitAll(func(f *flag.Flag) { flags = append(flags, f) })
	}
	for _, n := range names {
		f := fs.Lookup(n)
		if f == nil {
			return fmt.Errorf("flaghelp: %s has no flag -%s", fs.Name(), n)
		}
		flags = append(flags, f)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, f := range flags {
		kind, usage := flag.UnquoteUsage(f)
		usage = strings.Join(strings.Fields(usage), " ")
		if _, err := time.ParseDuration(f.DefValue); kind == "value" && err == nil {
			kind = "duration" // a Var holding a duration (config.Duration)
		}
		switch {
		case f.DefValue == "" || f.DefValue == "0" || f.DefValue == "false" || f.DefValue == "0s" || f.DefValue == "[]":
		case strings.Contains(usage, "(default") || strings.Contains(usage, "required"):
			// The explanation says what is used when the flag is not given.
		default:
			if g, ok := f.Value.(flag.Getter); ok {
				if _, isString := g.Get().(string); isString {
					usage += fmt.Sprintf(" (default %q)", f.DefValue)
					break
				}
			}
			usage += fmt.Sprintf(" (default %s)", f.DefValue)
		}
		name := "-" + f.Name
		if kind != "" {
			name += " " + kind
		}
		fmt.Fprintf(tw, "  %s\t%s\n", name, usage)
	}
	return tw.Flush()
}
