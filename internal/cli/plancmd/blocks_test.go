package plancmd

import (
	"slices"
	"testing"
)

func TestParseBlocks(t *testing.T) {
	tests := []struct {
		in   string
		want []int
		bad  bool
	}{
		{"", []int{}, false},
		{"0,1,2", []int{0, 1, 2}, false},
		{" 5 , 7 ", []int{5, 7}, false},
		{"0-3,8,10-11", []int{0, 1, 2, 3, 8, 10, 11}, false},
		{"4-4", []int{4}, false},
		{"-1", nil, true},
		{"1,-2", nil, true},
		{"3-1", nil, true},
		{"a", nil, true},
		{"1,,2", nil, true},
		{"1-x", nil, true},
		{"0-99999999", nil, true},
	}
	for _, tt := range tests {
		got, err := parseBlocks(tt.in)
		if (err != nil) != tt.bad || !tt.bad && !slices.Equal(got, tt.want) {
			t.Errorf("parseBlocks(%q) = %v, %v; want %v (error %v)", tt.in, got, err, tt.want, tt.bad)
		}
	}
}

func TestFormatBlocks(t *testing.T) {
	tests := []struct {
		in   []int
		want string
	}{
		{nil, "-"},
		{[]int{3}, "3"},
		{[]int{0, 1, 2, 5, 7, 8}, "0-2,5,7-8"},
		{[]int{2, 1}, "2,1"},
	}
	for _, tt := range tests {
		if got := formatBlocks(tt.in); got != tt.want {
			t.Errorf("formatBlocks(%v) = %q, want %q", tt.in, got, tt.want)
		}
		if len(tt.in) > 0 && slices.IsSorted(tt.in) {
			back, err := parseBlocks(tt.want)
			if err != nil || !slices.Equal(back, tt.in) {
				t.Errorf("parseBlocks(formatBlocks(%v)) = %v, %v", tt.in, back, err)
			}
		}
	}
}
