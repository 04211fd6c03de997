package main

import (
	"strings"
	"testing"
)

// TestHelpOneLinePerFlag: each subcommand's -h lists its flags one line
// each, with a kind that says what to give ("-exe path", not "-exe binary").
func TestHelpOneLinePerFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"bench", "e2e", "-h"}, []string{"-exe path", "the kvflow binary", "-workload string", "-in-process"}},
		{[]string{"plan", "-h"}, []string{"-request-id", "-prefill-tp int"}},
		{[]string{"probe", "-h"}, []string{"-remote"}},
	} {
		code, out, _ := runCmd(tc.args...)
		if code != exitOK {
			t.Fatalf("%v: exit %d", tc.args, code)
		}
		for _, w := range tc.want {
			if !strings.Contains(out, w) {
				t.Errorf("%v: help lacks %q:\n%s", tc.args, w, out)
			}
		}
		if strings.Contains(out, "-exe binary") {
			t.Errorf("%v: -exe's kind is the word \"binary\", unexplained", tc.args)
		}
		for _, line := range strings.Split(out, "\n") {
			if strings.HasPrefix(line, "    \t") {
				t.Errorf("%v: explanation on a line of its own: %q", tc.args, line)
			}
		}
	}
}
