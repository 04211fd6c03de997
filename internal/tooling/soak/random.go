package soak

import (
	"math/rand/v2"
	"time"

	"github.com/kvflow/kvflow/internal/tooling/faults"
)

// RandomSchedule draws a fault schedule: each rate uniform in [0, its
// bound], delays up to 1..30 ms. The bounds keep most requests alive (a
// third or so fail) so that the invariants of done requests are exercised
// as much as those of failed ones. ShortRead is left out: it is the known
// gap the byte ledger is to close (see TestShortReadGap); so are the
// metadata corruptions the pipeline cannot detect.
func RandomSchedule(rng *rand.Rand) faults.Schedule {
	p := func(bound float64) float64 { return rng.Float64() * bound }
	return faults.Schedule{
		Seed:     rng.Uint64(),
		MaxDelay: time.Duration(1+rng.IntN(30)) * time.Millisecond,
		Read:     faults.Rates{Fail: p(.08), Delay: p(.3), Truncate: p(.08), Duplicate: p(.15)},
		Meta:     faults.Rates{Fail: p(.3), Delay: p(.3), Corrupt: p(.2)},
		Done:     faults.Rates{Drop: p(.05), Delay: p(.3), Duplicate: p(.2)},
	}
}
