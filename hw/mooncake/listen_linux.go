package mooncake

import (
	"net"
	"syscall"
)

// listenConfig sets, once on each listening socket, what Go's net package
// would otherwise set with five setsockopt calls on every accepted
// connection (TCP_NODELAY, and keep-alive with Go's defaults: on, 15 s
// idle, 15 s interval, 9 probes): Linux copies a listener's socket options
// into the connections it accepts (TestListenerOptionsInherited), so a
// new connection costs one setsockopt (the TCP_NODELAY net always sets)
// instead of six. A connection per request is what Mooncake's initiator
// does by default.
func listenConfig() net.ListenConfig {
	return net.ListenConfig{
		KeepAlive: -1, // set on the listener below, inherited
		Control: func(_, _ string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) {
				for _, o := range listenerOptions {
					if serr == nil {
						serr = syscall.SetsockoptInt(int(fd), o.level, o.name, o.value)
					}
				}
			})
			if err != nil {
				return err
			}
			return serr
		},
	}
}

// listenerOptions are the options set on both listeners and inherited by
// every connection they accept. Keep-alive: a peer that vanished without a
// FIN (host down, cable out) is found within ~2.5 min instead of holding a
// connection slot until IdleTimeout.
var listenerOptions = []struct{ level, name, value int }{
	{syscall.IPPROTO_TCP, syscall.TCP_NODELAY, 1},
	{syscall.SOL_SOCKET, syscall.SO_KEEPALIVE, 1},
	{syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE, 15},
	{syscall.IPPROTO_TCP, syscall.TCP_KEEPINTVL, 15},
	{syscall.IPPROTO_TCP, syscall.TCP_KEEPCNT, 9},
}
