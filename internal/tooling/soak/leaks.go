package soak

import (
	"fmt"
	"os"
	"runtime"
	"time"
)

// Resources is a count of the process's goroutines and open file
// descriptors.
type Resources struct{ Goroutines, FDs int }

// Measure counts goroutines and /proc/self/fd entries.
func Measure() Resources {
	fds := -1
	if ents, err := os.ReadDir("/proc/self/fd"); err == nil {
		fds = len(ents)
	}
	return Resources{Goroutines: runtime.NumGoroutine(), FDs: fds}
}

// Leaks waits up to settle for the process to come back to before's
// counts (goroutines and connections wind down asynchronously) and returns
// what is still above them.
func Leaks(before Resources, settle time.Duration) Resources {
	deadline := time.Now().Add(settle)
	for {
		now := Measure()
		over := Resources{Goroutines: max(0, now.Goroutines-before.Goroutines), FDs: max(0, now.FDs-before.FDs)}
		if over == (Resources{}) || time.Now().After(deadline) {
			return over
		}
		runtime.GC()
		time.Sleep(20 * time.Millisecond)
	}
}

func (r Resources) String() string { return fmt.Sprintf("%d goroutines, %d fds", r.Goroutines, r.FDs) }
