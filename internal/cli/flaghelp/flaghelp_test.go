package flaghelp

import (
	"bytes"
	"flag"
	"strings"
	"testing"
	"time"
)

func TestPrint(t *testing.T) {
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	fs.String("exe", "", "the kvflow `path` to run")
	fs.String("mode", "both", "runs,\n   in order")
	fs.Int("n", 3, "count")
	fs.Bool("json", false, "print JSON")
	fs.Duration("timeout", time.Minute, "bound")
	fs.String("hidden", "", "not listed")
	fs.Var(durVar{}, "abort", "force-free after this")
	for _, tc := range []struct {
		names []string
		want  string
	}{
		{[]string{"exe", "mode", "n", "json", "timeout"}, "" +
			"  -exe path         the kvflow path to run\n" +
			"  -mode string      runs, in order (default \"both\")\n" +
			"  -n int            count (default 3)\n" +
			"  -json             print JSON\n" +
			"  -timeout duration  bound (default 1m0s)\n"},
	} {
		var b bytes.Buffer
		if err := Print(&b, fs, tc.names...); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(b.String(), "hidden") || strings.Count(b.String(), "\n") != len(tc.names) {
			t.Errorf("got:\n%s", b.String())
		}
		for _, line := range strings.Split(strings.TrimSpace(tc.want), "\n") {
			f := strings.Fields(line)
			if !strings.Contains(b.String(), strings.Join(f[2:], " ")) {
				t.Errorf("lacks %q:\n%s", line, b.String())
			}
		}
	}
	if err := Print(&bytes.Buffer{}, fs, "nope"); err == nil || !strings.Contains(err.Error(), "-nope") {
		t.Errorf("unknown name: %v", err)
	}
	var all bytes.Buffer
	if err := Print(&all, fs); err != nil || strings.Count(all.String(), "\n") != 7 || !strings.Contains(all.String(), "-abort duration ") {
		t.Errorf("all flags: %v\n%s", err, all.String())
	}
}

// durVar is a flag.Value holding a duration, as config.Duration.
type durVar struct{}

func (durVar) String() string   { return "8m0s" }
func (durVar) Set(string) error { return nil }
