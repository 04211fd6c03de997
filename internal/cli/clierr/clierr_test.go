package clierr

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"testing"
)

func TestUsage(t *testing.T) {
	base := errors.New("boom")
	tests := []struct {
		name  string
		err   error
		usage bool
	}{
		{"nil", nil, false},
		{"plain", base, false},
		{"usagef", Usagef("--x: %w", base), true},
		{"wrapped usage", fmt.Errorf("ctx: %w", Usage(base)), true},
		{"help", Usage(flag.ErrHelp), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := IsUsage(tt.err); got != tt.usage {
				t.Fatalf("IsUsage(%v) = %v, want %v", tt.err, got, tt.usage)
			}
		})
	}
	if u := Usagef("--x: %w", base); !errors.Is(u, base) || u.Error() != "--x: boom" {
		t.Fatalf("Usagef: %v", u)
	}
	if Usage(nil) != nil {
		t.Fatal("Usage(nil) != nil")
	}
	u := Usage(base)
	if Usage(u) != u {
		t.Fatal("Usage wrapped a usage error twice")
	}
}

func TestParseFlags(t *testing.T) {
	newFS := func() *flag.FlagSet {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		fs.Int("n", 0, "")
		return fs
	}
	tests := []struct {
		name  string
		args  []string
		usage bool
		help  bool
	}{
		{"ok", []string{"-n", "3"}, false, false},
		{"bad value", []string{"-n", "x"}, true, false},
		{"unknown", []string{"-m"}, true, false},
		{"positional", []string{"extra"}, true, false},
		{"help", []string{"-h"}, false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := ParseFlags(newFS(), tt.args)
			if IsUsage(err) != tt.usage || errors.Is(err, flag.ErrHelp) != tt.help {
				t.Fatalf("ParseFlags(%q) = %v", tt.args, err)
			}
			if !tt.usage && !tt.help && err != nil {
				t.Fatalf("ParseFlags(%q) = %v", tt.args, err)
			}
		})
	}
}
