package benchte

import (
	"testing"
	"time"
)

func TestPattern(t *testing.T) {
	buf := make([]byte, 4099)
	fillPattern(buf, 0)
	for _, off := range []uint64{0, 1, 7, 8, 13, 64, 4000} {
		for _, n := range []int{0, 1, 5, 8, 9, 33} {
			if int(off)+n > len(buf) {
				continue
			}
			part := make([]byte, n)
			fillPattern(part, off)
			for i := range part {
				if part[i] != buf[int(off)+i] {
					t.Fatalf("fillPattern(off %d) byte %d differs from the whole buffer's", off, i)
				}
			}
			if i := checkPattern(buf[off:int(off)+n], off); i >= 0 {
				t.Fatalf("checkPattern(off %d, n %d) = %d, want -1", off, n, i)
			}
		}
	}
	for _, pos := range []int{0, 3, 8, 17, 4098} {
		b := append([]byte(nil), buf...)
		b[pos] ^= 0x40
		if i := checkPattern(b, 0); i != pos {
			t.Errorf("flipped byte %d: checkPattern = %d", pos, i)
		}
		if i := checkPattern(b[1:], 1); i != pos-1 {
			t.Errorf("flipped byte %d, unaligned: checkPattern = %d, want %d", pos, i, pos-1)
		}
	}
	if checkPattern(make([]byte, 64), 0) < 0 {
		t.Error("zeroed memory verified")
	}
	if checkPattern(buf[8:72], 0) < 0 {
		t.Error("a block from the wrong offset verified")
	}
	big := make([]byte, 40<<20+5)
	fillPatternParallel(big)
	if i := checkPattern(big, 0); i >= 0 {
		t.Fatalf("fillPatternParallel: bad byte %d", i)
	}
}

func TestSecondsFlag(t *testing.T) {
	tests := []struct {
		in   string
		want time.Duration
		bad  bool
	}{
		{"10", 10 * time.Second, false},
		{"0.5", 500 * time.Millisecond, false},
		{"250ms", 250 * time.Millisecond, false},
		{"0", 0, true},
		{"-1", 0, true},
		{"soon", 0, true},
	}
	for _, tt := range tests {
		var s seconds
		err := s.Set(tt.in)
		if (err != nil) != tt.bad || !tt.bad && time.Duration(s) != tt.want {
			t.Errorf("Set(%q) = %v, %v; want %v (error %v)", tt.in, time.Duration(s), err, tt.want, tt.bad)
		}
	}
}

func TestRate(t *testing.T) {
	if got := rate(3_000_000_000, 2, "GB", 2); got != "1.50 GB/s" {
		t.Errorf("rate = %q", got)
	}
	if got := rate(1<<30, 1, "GiB", 1); got != "1.0 GiB/s" {
		t.Errorf("rate = %q", got)
	}
	if got := rate(1e9, 1, "Gb", 0); got != "8 Gb/s" {
		t.Errorf("rate = %q", got)
	}
}
