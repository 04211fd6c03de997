package main

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
)

// runVersion prints what identifies this binary: kvflow's version (set
// with -ldflags "-X main.version=..."; else the module version), the VCS
// commit and whether the tree was modified, the Go version, the build
// tags and cgo, and the platform.
func runVersion(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("version")
	if err := parseFlags(fs, args, stdout); err != nil {
		return err
	}
	fmt.Fprint(stdout, versionText())
	return nil
}

func versionText() string {
	module, commit, modified, tags, cgo := "(unknown)", "(unknown)", "", "", ""
	if bi, ok := debug.ReadBuildInfo(); ok {
		module = bi.Main.Path + " " + bi.Main.Version
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				commit = s.Value
			case "vcs.modified":
				if s.Value == "true" {
					modified = " (modified)"
				}
			case "-tags":
				tags = s.Value
			case "CGO_ENABLED":
				cgo = s.Value
			}
		}
	}
	if tags == "" {
		tags = "(none)"
	}
	return fmt.Sprintf("kvflow %s\nmodule     %s\ncommit     %s%s\ngo         %s\nbuild tags %s\ncgo        %s\nplatform   %s/%s\n",
		version, module, commit, modified, runtime.Version(), tags, cgo, runtime.GOOS, runtime.GOARCH)
}
