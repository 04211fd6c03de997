package npu

import (
	"fmt"
	"strings"
)

// DType is the element type of a KV cache. Only its size matters to kvflow:
// block lengths are bytes and the stitch kernel moves bytes.
type DType uint8

// The cache element types vLLM and vllm-ascend allocate. The zero DType is
// invalid so that a forgotten field is caught by Shape.Validate.
const (
	BF16 DType = iota + 1
	FP16
	FP32
	INT8
	FP8 // fp8_e4m3 and fp8_e5m2 alike: one byte
)

var dtypeInfo = [...]struct {
	name string
	size int
}{
	BF16: {"bf16", 2},
	FP16: {"fp16", 2},
	FP32: {"fp32", 4},
	INT8: {"int8", 1},
	FP8:  {"fp8", 1},
}

// Size is the element size in bytes (torch's element_size()); 0 for an
// unknown DType.
func (d DType) Size() int {
	if !d.Valid() {
		return 0
	}
	return dtypeInfo[d].size
}

// Valid reports whether d is one of the defined types.
func (d DType) Valid() bool { return d >= BF16 && int(d) < len(dtypeInfo) }

func (d DType) String() string {
	if !d.Valid() {
		return fmt.Sprintf("DType(%d)", uint8(d))
	}
	return dtypeInfo[d].name
}

// ParseDType accepts kvflow's short names and the spellings of torch and of
// vLLM's --kv-cache-dtype / model dtype ("bfloat16", "half", "fp8_e4m3", ...).
func ParseDType(s string) (DType, error) {
	switch strings.ToLower(strings.TrimPrefix(strings.TrimSpace(s), "torch.")) {
	case "bf16", "bfloat16":
		return BF16, nil
	case "fp16", "float16", "half":
		return FP16, nil
	case "fp32", "float32", "float":
		return FP32, nil
	case "int8":
		return INT8, nil
	case "fp8", "fp8_e4m3", "fp8_e5m2", "float8_e4m3fn", "float8_e5m2":
		return FP8, nil
	}
	return 0, fmt.Errorf("npu: unknown dtype %q (want bf16, fp16, fp32, int8 or fp8)", s)
}
