//go:build !amd64

package mooncake

import "unsafe"

const hasNT = false

func copyNT(dst, src unsafe.Pointer, n uintptr) {
	copy(unsafe.Slice((*byte)(dst), n), unsafe.Slice((*byte)(src), n))
}

func storeFence() {}
