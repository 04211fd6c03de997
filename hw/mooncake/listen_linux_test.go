package mooncake

import (
	"net"
	"strconv"
	"syscall"
	"testing"
)

// TestListenerOptionsInherited: connections accepted on either port carry
// the options set once on the listener (TCP_NODELAY, keep-alive and its
// timers), which kvflow no longer sets per connection.
func TestListenerOptionsInherited(t *testing.T) {
	srv, _ := newEngine(t, testConfig())
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
		rc.Control(func(fd uintptr) {
			for _, o := range listenerOptions {
				v, err := syscall.GetsockoptInt(int(fd), o.level, o.name)
				if err != nil || v != o.value {
					t.Errorf("port %d: option %d/%d = %d (%v), want %d", port, o.level, o.name, v, err, o.value)
				}
			}
		})
		c.Close()
	}
}
