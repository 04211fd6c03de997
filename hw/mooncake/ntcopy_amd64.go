package mooncake

import "unsafe"

// hasNT: copyNT is implemented (SSE2 non-temporal stores, every amd64).
const hasNT = true

// copyNT copies n bytes, a multiple of 64, from src to dst, which is
// 16-byte aligned, with non-temporal stores. Call storeFence before the
// bytes are published to another goroutine.
//
//go:noescape
func copyNT(dst, src unsafe.Pointer, n uintptr)

// storeFence orders the non-temporal stores before every later store.
func storeFence()
