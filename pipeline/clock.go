package pipeline

import (
	"time"
	_ "unsafe" // for go:linkname
)

// nanotime is the runtime's monotonic clock. time.Now also reads the wall
// clock, which doubles the cost of the two reads per item per stage on
// virtual machines whose clock source is slow (the profile of the no-op
// pipeline showed time.Now at a third of its CPU).
//
//go:linkname nanotime runtime.nanotime
func nanotime() int64

func since(t0 int64) time.Duration { return time.Duration(nanotime() - t0) }
