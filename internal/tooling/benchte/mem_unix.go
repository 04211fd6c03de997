//go:build unix

package benchte

import (
	"fmt"
	"math"
	"syscall"
)

// allocBuffer maps n bytes of anonymous, zeroed, private memory: it never
// moves, as registered memory must not, and is returned to the system by
// free (only after the engine that registered it has been closed).
func allocBuffer(n uint64) (mem []byte, free func() error, err error) {
	if n == 0 || n > math.MaxInt {
		return nil, nil, fmt.Errorf("buffer of %d bytes: size out of range", n)
	}
	mem, err = syscall.Mmap(-1, 0, int(n), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return nil, nil, fmt.Errorf("mmap %d bytes: %w", n, err)
	}
	return mem, func() error { return syscall.Munmap(mem) }, nil
}
