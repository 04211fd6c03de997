package testkit

import (
	"fmt"
	"math/rand/v2"
)

// PortAttempts is how many random ports OnFreePort tries.
const PortAttempts = 8

// OnFreePort calls start with random ports in [10000, 30000), below the ephemeral range, until one
// call succeeds, and returns that port; after PortAttempts failures it
// returns the last error. start must release what it took when it fails (a
// worker whose second port was taken closes its first). logf, when not
// nil, logs each failed attempt (t.Logf).
func OnFreePort(logf func(format string, args ...any), start func(port int) error) (int, error) {
	var lastErr error
	for attempt := range PortAttempts {
		port := 10000 + rand.IntN(20000) // below the ephemeral range (32768+): :0 binds and outgoing connections take ports there
		if lastErr = start(port); lastErr == nil {
			return port, nil
		}
		if logf != nil {
			logf("attempt %d on port %d: %v", attempt, port, lastErr)
		}
	}
	return 0, fmt.Errorf("%d ports tried: %w", PortAttempts, lastErr)
}
