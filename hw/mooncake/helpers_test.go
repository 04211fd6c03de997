package mooncake

import (
	"log/slog"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// mmap returns n bytes of anonymous memory, unmapped at test end.
func mmap(tb testing.TB, n int) []byte {
	tb.Helper()
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		tb.Fatalf("mmap %d: %v", n, err)
	}
	tb.Cleanup(func() { syscall.Munmap(b) })
	return b
}

// testConfig is DefaultTCPConfig with timeouts short enough for tests.
func testConfig() TCPConfig {
	c := DefaultTCPConfig()
	c.ConnectTimeout = time.Second
	c.HandshakeTimeout = 2 * time.Second
	c.IOTimeout = 2 * time.Second
	c.AcceptWrites = true // the write paths are tested too; TestWritesRefusedByDefault checks the default
	return c
}

// newEngine starts an engine with its own registry, closed at test end.
func newEngine(tb testing.TB, cfg TCPConfig) (*TCPEngine, *prometheus.Registry) {
	tb.Helper()
	reg := prometheus.NewRegistry()
	e, err := NewTCPEngine(cfg, reg, slog.New(slog.DiscardHandler))
	if err != nil {
		tb.Fatalf("NewTCPEngine: %v", err)
	}
	tb.Cleanup(func() { e.Close() })
	return e, reg
}

// register mmaps n bytes, fills them with a pattern and registers them.
func register(tb testing.TB, e *TCPEngine, n int, seed byte) []byte {
	tb.Helper()
	b := mmap(tb, n)
	for i := range b {
		b[i] = byte(i*7) ^ seed
	}
	if err := e.Register(AddrOf(b), uint64(len(b)), ""); err != nil {
		tb.Fatalf("register: %v", err)
	}
	return b
}

// checkGoroutines fails if the goroutine count does not return to base.
func checkGoroutines(tb testing.TB, base int) {
	tb.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for {
		n := runtime.NumGoroutine()
		if n <= base {
			return
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			tb.Fatalf("goroutine leak: %d running, %d before\n%s", n, base, buf)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitFor polls cond for up to 3 s.
func waitFor(tb testing.TB, cond func() bool) {
	tb.Helper()
	for deadline := time.Now().Add(3 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			tb.Fatal("condition not reached in 3 s")
		}
	}
}
