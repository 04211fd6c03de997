//go:build !linux

package mooncake

import "net"

// eventLoop exists on Linux only (loop_linux.go).
type eventLoop struct{}

func newEventLoop(*TCPEngine, net.Listener) (*eventLoop, error) { return nil, errNoLoop }
func (*eventLoop) run()                                         {}
func (*eventLoop) close()                                       {}
