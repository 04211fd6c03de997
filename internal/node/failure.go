package node

import (
	"errors"
	"syscall"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/stages/read"
)

var _ read.FailureClassifier = transfer{}

// ClassifyFailure tells the read stage how a batch of the engine failed
// (read.FailureClassifier): the connection lost (refused at the RPC or data
// port, or closed or reset by the peer: its process may have restarted),
// and whether any op landed first.
func (transfer) ClassifyFailure(err error) read.Failure {
	var f read.Failure
	var be *mooncake.BatchError
	if errors.As(err, &be) {
		for _, e := range be.Errs {
			if e == nil {
				f.Moved = true
				break
			}
		}
	}
	f.Refused = errors.Is(err, mooncake.ErrRejected)
	f.ConnLost = errors.Is(err, mooncake.ErrPeerClosed) || errors.Is(err, syscall.ECONNREFUSED) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
	return f
}
