//go:build !unix

package benchte

import (
	"fmt"
	"math"
)

// allocBuffer falls back to Go heap memory where mmap is not available; the
// slice stays referenced until free, so its address stays valid.
func allocBuffer(n uint64) (mem []byte, free func() error, err error) {
	if n == 0 || n > math.MaxInt {
		return nil, nil, fmt.Errorf("buffer of %d bytes: size out of range", n)
	}
	mem = make([]byte, n)
	return mem, func() error { mem = nil; return nil }, nil
}
