//go:build linux

package npu_test

import (
	"context"
	"fmt"

	"github.com/kvflow/kvflow/hw/npu"
)

func Example() {
	// A Llama-3-8B decode rank at TP 2: 4 KV heads of 128 dims, bf16.
	l, err := npu.NewLayout(npu.Shape{NumLayers: 32, NumBlocks: 64, BlockSize: 128, NumKVHeads: 4, HeadDim: 128, DType: npu.BF16})
	if err != nil {
		panic(err)
	}
	dev, err := npu.NewHost(l, npu.HostOptions{}) // or npu.CreateShm("/dev/shm/kvflow-rank0", l, ...)
	if err != nil {
		panic(err)
	}
	defer dev.Close()

	// Register every cache with a transfer engine (any Registrar).
	n := 0
	_ = npu.RegisterAll(npu.RegistrarFunc(func(addr, length uint64, name string) error { n++; return nil }), dev)

	// After all P = 2 slices of blocks 3 and 4 have landed:
	if err := dev.Stitch(context.Background(), []int{3, 4}, 2); err != nil {
		panic(err)
	}
	fmt.Println(l.Kind(), l.BlockLens(), len(dev.BaseAddrs()), n)
	// Output: gqa [131072] 64 64
}
