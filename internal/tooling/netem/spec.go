package netem

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// MaxDelay bounds a delay or jitter: longer ones are refused as a typo.
const MaxDelay = time.Minute

// maxSpecTokens and maxTokenLen bound a spec passed to tc.
const (
	maxSpecTokens = 32
	maxTokenLen   = 64
)

// ErrBadSpec is wrapped by every error about a malformed or unsupported
// netem spec.
var ErrBadSpec = errors.New("netem: bad spec")

// Spec is a netem spec that the userspace relay can emulate: a fixed
// delay in each direction, plus uniform jitter in [-Jitter, +Jitter]
// (clamped at zero, never reordering).
type Spec struct {
	Delay  time.Duration
	Jitter time.Duration
}

// String is the spec in netem syntax; ParseSpec reads it back.
func (s Spec) String() string {
	if s.Jitter == 0 {
		return "delay " + netemTime(s.Delay)
	}
	return "delay " + netemTime(s.Delay) + " " + netemTime(s.Jitter)
}

// netemTime writes d in the largest netem unit that keeps it exact.
func netemTime(d time.Duration) string {
	switch {
	case d%time.Second == 0 && d != 0:
		return strconv.FormatInt(int64(d/time.Second), 10) + "s"
	case d%time.Millisecond == 0:
		return strconv.FormatInt(int64(d/time.Millisecond), 10) + "ms"
	case d%time.Microsecond == 0:
		return strconv.FormatInt(int64(d/time.Microsecond), 10) + "us"
	}
	return strconv.FormatInt(int64(d), 10) + "ns"
}

// RTTFloor is the least round trip the spec allows over the emulated
// link: twice the delay less the jitter, since both directions are
// delayed.
func (s Spec) RTTFloor() time.Duration {
	d := s.Delay - s.Jitter
	if d < 0 {
		d = 0
	}
	return 2 * d
}

// Tokens splits a spec for tc and checks that every token is simple: at
// most 64 characters of letters, digits and ".%_+:/" (no leading '-',
// no quotes, no shell metacharacters), at most 32 tokens. It is what
// kernel mode passes to tc, verbatim, without a shell.
func Tokens(spec string) ([]string, error) {
	toks := strings.Fields(spec)
	if len(toks) == 0 {
		return nil, fmt.Errorf("%w: empty spec (want e.g. \"delay 1ms\")", ErrBadSpec)
	}
	if len(toks) > maxSpecTokens {
		return nil, fmt.Errorf("%w: %d tokens, at most %d", ErrBadSpec, len(toks), maxSpecTokens)
	}
	for _, t := range toks {
		if len(t) > maxTokenLen {
			return nil, fmt.Errorf("%w: token %.20q... longer than %d characters", ErrBadSpec, t, maxTokenLen)
		}
		if t[0] == '-' {
			return nil, fmt.Errorf("%w: token %q starts with '-' (negative values and options are not allowed)", ErrBadSpec, t)
		}
		for _, c := range t {
			if !simpleRune(c) {
				return nil, fmt.Errorf("%w: token %q has character %q (allowed: letters, digits, . %% _ + : /)", ErrBadSpec, t, c)
			}
		}
	}
	// Delays the relay understands are checked here too, so kernel mode
	// refuses "delay 99h" as the userspace mode would.
	if strings.EqualFold(toks[0], "delay") {
		for i := 1; i < len(toks) && i <= 2; i++ {
			if _, err := parseTime(toks[i]); err != nil {
				if i == 2 && !looksLikeTime(toks[i]) {
					break // e.g. "delay 1ms loss 1%": tc decides
				}
				return nil, fmt.Errorf("%w: %q: %v", ErrBadSpec, toks[i], err)
			}
		}
	}
	return toks, nil
}

func simpleRune(c rune) bool {
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	return strings.ContainsRune(".%_+:/", c)
}

func looksLikeTime(s string) bool {
	return s != "" && (s[0] >= '0' && s[0] <= '9' || s[0] == '.')
}

// ParseSpec parses a spec the userspace relay can emulate: "delay D" or
// "delay D J" (J: jitter). Times are netem's: a number with s, sec,
// secs, ms, msec, msecs, us, usec, usecs, ns, nsec or nsecs, or a bare
// number of microseconds. Anything else (loss, duplicate, reorder,
// corrupt, rate, slot, correlation, distribution, ...) is refused with
// an error that names it.
func ParseSpec(spec string) (Spec, error) {
	toks, err := Tokens(spec)
	if err != nil {
		return Spec{}, err
	}
	if !strings.EqualFold(toks[0], "delay") {
		return Spec{}, fmt.Errorf("%w: %q is not supported by the userspace delay relay; it emulates only \"delay D [JITTER]\"", ErrBadSpec, toks[0])
	}
	if len(toks) < 2 {
		return Spec{}, fmt.Errorf("%w: \"delay\" needs a time, e.g. \"delay 1ms\"", ErrBadSpec)
	}
	var s Spec
	if s.Delay, err = parseTime(toks[1]); err != nil {
		return Spec{}, fmt.Errorf("%w: delay %q: %v", ErrBadSpec, toks[1], err)
	}
	rest := toks[2:]
	if len(rest) > 0 && looksLikeTime(rest[0]) {
		if s.Jitter, err = parseTime(rest[0]); err != nil {
			return Spec{}, fmt.Errorf("%w: jitter %q: %v", ErrBadSpec, rest[0], err)
		}
		rest = rest[1:]
	}
	if len(rest) > 0 {
		what := rest[0]
		if looksLikeTime(what) {
			what = "correlation " + what
		}
		return Spec{}, fmt.Errorf("%w: %q is not supported by the userspace delay relay; it emulates only \"delay D [JITTER]\"", ErrBadSpec, what)
	}
	return s, nil
}

// parseTime parses a netem time: a non-negative number with an optional
// unit (default microseconds), at most MaxDelay.
func parseTime(s string) (time.Duration, error) {
	i := 0
	for i < len(s) && (s[i] >= '0' && s[i] <= '9' || s[i] == '.') {
		i++
	}
	num, unit := s[:i], strings.ToLower(s[i:])
	if num == "" {
		if strings.HasPrefix(s, "-") {
			return 0, errors.New("negative time")
		}
		return 0, errors.New("not a time (want e.g. 1ms, 100us, 1.5ms)")
	}
	v, err := strconv.ParseFloat(num, 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
		return 0, errors.New("not a number")
	}
	var per float64
	switch unit {
	case "s", "sec", "secs":
		per = float64(time.Second)
	case "ms", "msec", "msecs":
		per = float64(time.Millisecond)
	case "", "us", "usec", "usecs":
		per = float64(time.Microsecond)
	case "ns", "nsec", "nsecs":
		per = 1
	default:
		return 0, fmt.Errorf("unknown unit %q (want s, ms, us or ns)", s[i:])
	}
	ns := v * per
	if ns > float64(MaxDelay) {
		return 0, fmt.Errorf("longer than %v", MaxDelay)
	}
	return time.Duration(math.Round(ns)), nil
}
