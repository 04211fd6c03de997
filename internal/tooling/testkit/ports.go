package testkit

import (
	"fmt"
	"math/rand/v2"
	"net"
	"testing"
)

// PortAttempts is how many random ports OnFreePort tries.
const PortAttempts = 8

// The window test ports are drawn from: [PortLow, PortHigh). It ends below
// Linux's default ephemeral range (net.ipv4.ip_local_port_range, 32768–60999),
// from which the OS also hands out :0 binds, with 2768 ports to spare for the offsets tests add to a drawn port (the
// decode side's kv_port+1000, one port per rank). A port inside the
// ephemeral range can be taken at any moment by the local end of an
// outgoing connection — one of the test's own, or another process's on a
// busy CI machine — so a worker restarted on its old port, or a rank bound
// after its first, failed with "bind: address already in use". Below it,
// only another test that drew the same port can collide, which a retry
// (OnFreePort) absorbs.
const (
	PortLow  = 10000
	PortHigh = 30000
)

// RandomPort is a random port in [PortLow, PortHigh): a base for a test
// cluster's fixed ports. Nothing checks that it is free: start on it with
// OnFreePort, or retry another on "address already in use".
func RandomPort() int { return PortLow + rand.IntN(PortHigh-PortLow) }

// OnFreePort calls start with random ports in [PortLow, PortHigh) until one
// call succeeds, and returns that port; after PortAttempts failures it
// returns the last error. start must release what it took when it fails (a
// worker whose second port was taken closes its first). logf, when not
// nil, logs each failed attempt (t.Logf).
func OnFreePort(logf func(format string, args ...any), start func(port int) error) (int, error) {
	var lastErr error
	for attempt := range PortAttempts {
		port := RandomPort()
		if lastErr = start(port); lastErr == nil {
			return port, nil
		}
		if logf != nil {
			logf("attempt %d on port %d: %v", attempt, port, lastErr)
		}
	}
	return 0, fmt.Errorf("%d ports tried: %w", PortAttempts, lastErr)
}

// ClosedPort is a loopback TCP port nothing listens on (a connect is
// refused): one the kernel just handed out and the test closed again.
func ClosedPort(tb testing.TB) int {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	return port
}
