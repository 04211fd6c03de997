package plan

import (
	"fmt"
	"strings"
)

// PPIndices is vLLM's get_pp_indices(num_hidden_layers, pp_rank, pp_size):
// the [start, end) layers of prefill PP stage ppRank. partition is
// VLLM_PP_LAYER_PARTITION ("" for unset): comma-separated layer counts, one
// per stage, summing to numLayers. Without it layers are split evenly and the
// remainder goes one each to the stages before the last (partitions[-2],
// partitions[-3], ...).
func PPIndices(numLayers, ppRank, ppSize int, partition string) (start, end int, err error) {
	if ppSize < 1 || ppRank < 0 || ppRank >= ppSize {
		return 0, 0, fmt.Errorf("pp_rank %d outside [0, pp_size %d)", ppRank, ppSize)
	}
	if numLayers < 0 {
		return 0, 0, fmt.Errorf("model.num_hidden_layers: negative (%d)", numLayers)
	}
	if partition != "" {
		parts, err := parsePartition(partition, numLayers, ppSize)
		if err != nil {
			return 0, 0, err
		}
		for _, p := range parts[:ppRank] {
			start += p
		}
		return start, start + parts[ppRank], nil
	}
	per := numLayers / ppSize
	rem := numLayers % ppSize
	// Stage s gets one extra layer when it is among the rem stages just
	// before the last one: ppSize-1-rem <= s < ppSize-1.
	extra := func(s int) int {
		if s >= ppSize-1-rem && s < ppSize-1 {
			return 1
		}
		return 0
	}
	for s := 0; s < ppRank; s++ {
		start += per + extra(s)
	}
	return start, start + per + extra(ppRank), nil
}

// parsePartition parses VLLM_PP_LAYER_PARTITION as vLLM does
// ([int(x) for x in s.split(",")], then length and sum checks). "" is unset.
// Python's int() accepts surrounding whitespace, a sign and single
// underscores between digits; so does this. Negative counts are rejected
// (vLLM would produce inverted layer ranges).
func parsePartition(s string, numLayers, ppSize int) ([]int, error) {
	return parsePartitionFor("pp_layer_partition", "prefill.pp_size", s, numLayers, ppSize)
}

// parsePartitionFor is parsePartition with the names its errors use: the
// partition's field and the PP size it must match.
func parsePartitionFor(field, sizeField, s string, numLayers, ppSize int) ([]int, error) {
	if s == "" {
		return nil, nil
	}
	fields := strings.Split(s, ",")
	parts := make([]int, len(fields))
	sum := 0
	for i, f := range fields {
		v, ok := pyInt(f)
		if !ok {
			return nil, fmt.Errorf("%s: invalid partition string %q", field, s)
		}
		if v < 0 {
			return nil, fmt.Errorf("%s: negative layer count %d in %q", field, v, s)
		}
		parts[i] = v
		sum += v
	}
	if len(parts) != ppSize {
		return nil, fmt.Errorf("%s: %d partitions in %q do not match %s %d", field, len(parts), s, sizeField, ppSize)
	}
	if sum != numLayers {
		return nil, fmt.Errorf("%s: partitions in %q sum to %d, not model.num_hidden_layers %d", field, s, sum, numLayers)
	}
	return parts, nil
}

// pyInt parses a base-10 integer the way Python's int(str) does for ASCII
// input: optional surrounding whitespace, optional sign, digits with single
// underscores between them.
func pyInt(s string) (int, bool) {
	s = trimSpace(s)
	neg := false
	if s != "" && (s[0] == '+' || s[0] == '-') {
		neg = s[0] == '-'
		s = s[1:]
	}
	if s == "" || s[0] == '_' || s[len(s)-1] == '_' {
		return 0, false
	}
	v := 0
	prevUnderscore := false
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '_':
			if prevUnderscore {
				return 0, false
			}
			prevUnderscore = true
			continue
		case c >= '0' && c <= '9':
			prevUnderscore = false
			if v > (1 << 40) {
				return 0, false // far beyond any layer count
			}
			v = v*10 + int(c-'0')
		default:
			return 0, false
		}
	}
	if neg {
		v = -v
	}
	return v, true
}
