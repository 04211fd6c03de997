package clierr

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
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

func TestArgsLeftNamesTheBoolFlag(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string // "" = no error
	}{
		{"none", []string{"-v"}, ""},
		{"after bool", []string{"--v", "off"}, `unexpected arguments ["off"]: --v takes no separate value; write --v=off`},
		{"after bool, more", []string{"-n", "1", "--v", "off", "x"}, `write --v=off`},
		{"bool with value", []string{"--v=true", "off"}, `unexpected arguments ["off"]`},
		{"after int", []string{"-n", "1", "extra"}, `unexpected arguments ["extra"]`},
		{"after terminator", []string{"--", "x"}, `unexpected arguments ["x"]`},
		{"first", []string{"extra", "-v"}, `unexpected arguments ["extra" "-v"]`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := flag.NewFlagSet("t", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			fs.Int("n", 0, "")
			fs.Bool("v", false, "")
			err := ParseFlags(fs, tt.args)
			if tt.want == "" {
				if err != nil {
					t.Fatalf("ParseFlags(%q) = %v", tt.args, err)
				}
				return
			}
			if !IsUsage(err) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("ParseFlags(%q) = %v, want a usage error containing %q", tt.args, err, tt.want)
			}
			if tt.want == `unexpected arguments ["off"]` && strings.Contains(err.Error(), "takes no separate value") {
				t.Fatalf("ParseFlags(%q) = %v: hint after a bool flag given its value", tt.args, err)
			}
		})
	}
}
