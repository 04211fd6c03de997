package netem

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestParseSpec(t *testing.T) {
	ok := []struct {
		in   string
		want Spec
	}{
		{"delay 1ms", Spec{Delay: time.Millisecond}},
		{"  delay   1ms  ", Spec{Delay: time.Millisecond}},
		{"DELAY 2MS", Spec{Delay: 2 * time.Millisecond}},
		{"delay 1ms 100us", Spec{Delay: time.Millisecond, Jitter: 100 * time.Microsecond}},
		{"delay 1.5ms", Spec{Delay: 1500 * time.Microsecond}},
		{"delay 250", Spec{Delay: 250 * time.Microsecond}}, // bare number: µs, as tc
		{"delay 0ms", Spec{}},
		{"delay 1s", Spec{Delay: time.Second}},
		{"delay 2secs 3msec", Spec{Delay: 2 * time.Second, Jitter: 3 * time.Millisecond}},
		{"delay 500ns", Spec{Delay: 500}},
		{"delay 60s", Spec{Delay: time.Minute}},
	}
	for _, c := range ok {
		got, err := ParseSpec(c.in)
		if err != nil || got != c.want {
			t.Errorf("ParseSpec(%q) = %+v, %v; want %+v", c.in, got, err, c.want)
		}
	}
	bad := []struct{ in, mention string }{
		{"", "empty"},
		{"   ", "empty"},
		{"loss 1%", `"loss"`},
		{"delay", "needs a time"},
		{"delay -1ms", "negative"},
		{"delay 1ms -1ms", "negative"},
		{"delay 1ms loss 1%", `"loss"`},
		{"delay 1ms 100us 25%", "correlation"},
		{"delay 1ms 100us distribution normal", `"distribution"`},
		{"rate 1mbit", `"rate"`},
		{"delay 1ms; rm -rf /", "character"},
		{"delay $(reboot)", "character"},
		{"delay 1ms\x00", "character"},
		{"delay 1xs", "unknown unit"},
		{"delay ms", "not a time"},
		{"delay 1..2ms", "not a number"},
		{"delay .", "not a number"},
		{"delay 61s", "longer than"},
		{"delay 1ms 61s", "longer than"},
		{"delay 1ms 2h", "unknown unit"},
		{"delay 99999999999999999999999999999999999s", "longer than"},
		{"delay " + strings.Repeat("1", 70) + "ms", "longer than 64"},
		{strings.Repeat("delay ", 40), "tokens"},
		{"--help", "starts with '-'"},
	}
	for _, c := range bad {
		_, err := ParseSpec(c.in)
		if err == nil {
			t.Errorf("ParseSpec(%q): no error", c.in)
			continue
		}
		if !errors.Is(err, ErrBadSpec) || !strings.Contains(err.Error(), c.mention) {
			t.Errorf("ParseSpec(%q) = %v; want ErrBadSpec mentioning %q", c.in, err, c.mention)
		}
	}
}

func TestTokens(t *testing.T) {
	// Kernel mode hands these to tc as they are.
	for _, in := range []string{"delay 1ms", "delay 1ms loss 1%", "delay 10ms 1ms 25% distribution normal", "rate 100mbit", "loss random 0.1%"} {
		toks, err := Tokens(in)
		if err != nil || strings.Join(toks, " ") != in {
			t.Errorf("Tokens(%q) = %q, %v", in, toks, err)
		}
	}
	for _, in := range []string{"", "delay 1ms;", "delay `x`", "delay 1ms | tee", "delay 'x'", "delay -5ms", "delay 1ms -2ms", "delay 2h", "delay 1ms\ttc", "a\"b"} {
		if in == "delay 1ms\ttc" {
			continue // a tab is whitespace: two simple tokens
		}
		if toks, err := Tokens(in); err == nil {
			t.Errorf("Tokens(%q) = %q; want an error", in, toks)
		}
	}
}

func TestSpecString(t *testing.T) {
	for _, s := range []Spec{{}, {Delay: time.Millisecond}, {Delay: 1500 * time.Microsecond, Jitter: 7}, {Delay: time.Minute, Jitter: time.Second}} {
		back, err := ParseSpec(s.String())
		if err != nil || back != s {
			t.Errorf("%+v -> %q -> %+v, %v", s, s.String(), back, err)
		}
	}
	if got := (Spec{Delay: time.Millisecond, Jitter: 300 * time.Microsecond}).RTTFloor(); got != 1400*time.Microsecond {
		t.Errorf("RTTFloor = %v", got)
	}
	if got := (Spec{Delay: time.Millisecond, Jitter: 2 * time.Millisecond}).RTTFloor(); got != 0 {
		t.Errorf("RTTFloor = %v", got)
	}
}

func FuzzParseSpec(f *testing.F) {
	for _, s := range []string{"delay 1ms", "delay 1ms 100us", "loss 1%", "", "delay -1ms", "delay 1.5e3ms", "delay 1ms 2ms 3%", "delay 60s 60s"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		s, err := ParseSpec(in)
		toks, terr := Tokens(in)
		if err != nil {
			if !errors.Is(err, ErrBadSpec) {
				t.Fatalf("ParseSpec(%q): error %v does not wrap ErrBadSpec", in, err)
			}
			return
		}
		if terr != nil {
			t.Fatalf("ParseSpec(%q) ok but Tokens: %v", in, terr)
		}
		for _, tok := range toks {
			if strings.ContainsAny(tok, ";|&$`'\"\\<>(){}*?!#~ \t\n") || tok[0] == '-' {
				t.Fatalf("Tokens(%q): unsafe token %q", in, tok)
			}
		}
		if s.Delay < 0 || s.Jitter < 0 || s.Delay > MaxDelay || s.Jitter > MaxDelay {
			t.Fatalf("ParseSpec(%q) = %+v: out of range", in, s)
		}
		back, err := ParseSpec(s.String())
		if err != nil || back != s {
			t.Fatalf("ParseSpec(%q) = %+v; String %q parses to %+v, %v", in, s, s.String(), back, err)
		}
	})
}

// FuzzPacketID: the netfilter-queue attribute walker never panics or
// reads past its input, whatever the kernel (or a bug) hands it.
func FuzzPacketID(f *testing.F) {
	f.Add([]byte{12, 0, 1, 0, 0, 0, 0, 7, 8, 0, 3, 0})
	f.Add([]byte{4, 0, 2, 0, 8, 0, 1, 0, 0, 0, 0, 9})
	f.Add([]byte{0, 0, 1, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		id, ok := packetID(b)
		if ok && len(b) < 8 {
			t.Fatalf("id %d from %d bytes", id, len(b))
		}
	})
}
