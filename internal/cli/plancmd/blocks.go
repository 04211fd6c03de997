package plancmd

import (
	"fmt"
	"strconv"
	"strings"
)

// maxBlocks bounds one block list (ranges expand): far more than any
// request's blocks (a 1M-token context at block size 16 is 65536 blocks),
// small enough that a typo like "0-999999999" fails instead of allocating.
const maxBlocks = 1 << 20

// blockList is a flag.Value holding block ids written as "0,1,2", ranges
// "0-127" or a mix ("0-3,8,10-11"). The empty string is the empty list.
type blockList struct {
	ids []int
	set bool
}

func (b *blockList) String() string {
	if b == nil {
		return ""
	}
	return formatBlocks(b.ids)
}

func (b *blockList) Set(s string) error {
	ids, err := parseBlocks(s)
	if err != nil {
		return err
	}
	b.ids, b.set = ids, true
	return nil
}

// parseBlocks parses a block list. Block ids are never negative.
func parseBlocks(s string) ([]int, error) {
	ids := []int{}
	s = strings.TrimSpace(s)
	if s == "" {
		return ids, nil
	}
	for i, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			return nil, fmt.Errorf("item %d is empty", i)
		}
		lo, hi, isRange := f, f, false
		// A '-' after the first character is a range ("3-7"); a leading
		// one is a sign ("-1"), reported as a negative id below.
		if k := strings.Index(f[1:], "-"); k >= 0 {
			lo, hi, isRange = strings.TrimSpace(f[:k+1]), strings.TrimSpace(f[k+2:]), true
		}
		a, err := strconv.Atoi(lo)
		if err != nil {
			return nil, fmt.Errorf("item %d %q: not a block id", i, f)
		}
		c := a
		if isRange {
			if c, err = strconv.Atoi(hi); err != nil {
				return nil, fmt.Errorf("item %d %q: not a block id range", i, f)
			}
		}
		switch {
		case a < 0 || c < 0:
			return nil, fmt.Errorf("item %d %q: negative block id", i, f)
		case c < a:
			return nil, fmt.Errorf("item %d %q: range end before its start", i, f)
		case c-a >= maxBlocks-len(ids):
			return nil, fmt.Errorf("more than %d block ids", maxBlocks)
		}
		for id := a; id <= c; id++ {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

// formatBlocks writes ids compactly: consecutive runs as "a-b", "-" for
// none.
func formatBlocks(ids []int) string {
	if len(ids) == 0 {
		return "-"
	}
	var sb strings.Builder
	for i := 0; i < len(ids); {
		j := i
		for j+1 < len(ids) && ids[j+1] == ids[j]+1 {
			j++
		}
		if sb.Len() > 0 {
			sb.WriteByte(',')
		}
		sb.WriteString(strconv.Itoa(ids[i]))
		if j > i {
			sb.WriteByte('-')
			sb.WriteString(strconv.Itoa(ids[j]))
		}
		i = j + 1
	}
	return sb.String()
}
