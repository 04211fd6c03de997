package mooncake

import (
	"net"
	"strconv"
	"syscall"
	"testing"
)

// TestListenerOptionsInherited: connections accepted on either port carry
// the options set once on the listener (TCP_NODELAY, keep-alive and its
// timers), which kvflow no longer sets per connection: on the goroutine
// path and on the data port's event loop.
func TestListenerOptionsInherited(t *testing.T) {
	check := func(t *testing.T, port int, fd int) {
		for _, o := range listenerOptions {
			v, err := syscall.GetsockoptInt(fd, o.level, o.name)
			if err != nil || v != o.value {
				t.Errorf("port %d: option %d/%d = %d (%v), want %d", port, o.level, o.name, v, err, o.value)
			}
		}
	}
	t.Run("goroutines", func(t *testing.T) {
		cfg := testConfig()
		cfg.NoEventLoop = true
		srv, _ := newEngine(t, cfg)
		for _, port := range []int{srv.DataPort(), srv.RPCPort()} {
			c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
			if err != nil {
				t.Fatal(err)
			}
			var accepted net.Conn
			waitFor(t, func() bool {
				srv.mu.Lock()
				defer srv.mu.Unlock()
				for a := range srv.conns {
					if a.RemoteAddr().String() == c.LocalAddr().String() {
						accepted = a
					}
				}
				return accepted != nil
			})
			rc, err := accepted.(*net.TCPConn).SyscallConn()
			if err != nil {
				t.Fatal(err)
			}
			rc.Control(func(fd uintptr) { check(t, port, int(fd)) })
			c.Close()
		}
	})
	t.Run("event loop", func(t *testing.T) {
		got := make(chan struct{}, 1)
		loopAcceptHook = func(fd int) {
			check(t, 0, fd) // on the loop's goroutine: the socket is open
			got <- struct{}{}
		}
		t.Cleanup(func() { loopAcceptHook = nil })
		srv, _ := newEngine(t, testConfig())
		if srv.loop == nil {
			t.Skip("no event loop on this platform") // TestEventLoopServesOneAtATime requires it where it exists
		}
		c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(srv.DataPort())))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		<-got
	})
}
