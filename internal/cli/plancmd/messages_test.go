package plancmd

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"
)

// TestImpossibleTopologySaysWhatIsWrong: prefill TP 3 to decode TP 2 is
// refused for what is wrong (the sizes, the heads), not for a consequence
// of it (the rank grouping derived from sizes that do not divide).
func TestImpossibleTopologySaysWhatIsWrong(t *testing.T) {
	err := Run(context.Background(), with(small, append([]string{"--prefill-tp", "3", "--decode-tp", "2"}, req...)...), &bytes.Buffer{}, &bytes.Buffer{})
	if err == nil {
		t.Fatal("prefill tp 3, decode tp 2 planned")
	}
	msg := err.Error()
	for _, w := range []string{"decode.tp_size: 2 does not divide", "prefill.tp_size: 3 and model.num_kv_heads 4: neither divides the other"} {
		if !strings.Contains(msg, w) {
			t.Errorf("error lacks %q:\n%s", w, msg)
		}
	}
	for _, bad := range []string{"maps to", "tp_num_need_pulls"} {
		if strings.Contains(msg, bad) {
			t.Errorf("error says %q, a consequence of the sizes already refused:\n%s", bad, msg)
		}
	}
}

// onePlural matches a count of one with a plural noun ("1 tasks").
var onePlural = regexp.MustCompile(`(^|[^0-9.])1 (tasks|ops|decode ranks|prefill ranks|layers|kv heads|bytes)\b`)

// TestPlanTablePlurals: a count of one takes the singular.
func TestPlanTablePlurals(t *testing.T) {
	for _, args := range [][]string{
		with(small, append([]string{"--prefill-tp", "1", "--decode-tp", "2"}, req...)...),
		with(small, "--prefill-tp", "1", "--decode-tp", "1", "--layers", "1", "--kv-heads", "1", "--request-id", "r", "--local-blocks", "0", "--remote-port", "30000"),
	} {
		var out bytes.Buffer
		if err := Run(context.Background(), args, &out, &bytes.Buffer{}); err != nil {
			t.Fatal(err)
		}
		if m := onePlural.FindString(out.String()); m != "" {
			t.Errorf("%q in:\n%s", m, out.String())
		}
		if !strings.Contains(out.String(), "1 task,") {
			t.Errorf("no rank with 1 task:\n%s", out.String())
		}
	}
}

// TestHelpShowsPlanFlags: -h lists plan's flags and the configuration
// flags that change a plan, one line each, not every serve flag.
func TestHelpShowsPlanFlags(t *testing.T) {
	var out bytes.Buffer
	Run(context.Background(), []string{"-h"}, &out, &bytes.Buffer{})
	help := out.String()
	for _, w := range []string{"-request-id", "-local-blocks", "-json", "-config", "-prefill-tp", "-decode-pp", "-layers", "-kv-heads", "-dtype", "-mla", "kvflow serve -h"} {
		if !strings.Contains(help, w) {
			t.Errorf("help lacks %s:\n%s", w, help)
		}
	}
	for _, bad := range []string{"-te-port", "-abort-timeout", "-read-workers", "-auth", "-log-level", "-tp-rank", "-cache-path"} {
		if strings.Contains(help, bad+" ") {
			t.Errorf("help lists %s, which does not change a plan", bad)
		}
	}
	for _, line := range strings.Split(help, "\n") {
		if strings.HasPrefix(line, "    \t") {
			t.Errorf("explanation on its own line: %q", line)
		}
	}
}
