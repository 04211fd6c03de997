//go:build !linux || 386

package mooncake

import "net"

// eventLoop exists on Linux only (loop_linux.go; not on 386, whose
// syscall package has no accept4).
type eventLoop struct{}

func newEventLoop(*TCPEngine, net.Listener) (*eventLoop, error) { return nil, errNoLoop }
func (*eventLoop) run()                                         {}
func (*eventLoop) close()                                       {}

// loopAcceptHook is loop_linux.go's test hook; never called here.
var loopAcceptHook func(fd int)
