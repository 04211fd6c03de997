package bench

import (
	"testing"

	zmq "github.com/pebbe/zmq4"
)

// bareREQREP is the baseline of the side-channel benchmarks: one zmq4 REQ
// socket and one REP socket on loopback TCP, a goroutine owning the REP
// that answers every request with reply. roundTrip sends req and waits for
// the answer: the least a ZMQ request/reply can cost here.
type bareREQREP struct {
	ctx  *zmq.Context
	req  *zmq.Socket
	done chan struct{}
}

func newBareREQREP(tb testing.TB, reply []byte) *bareREQREP {
	ctx, err := zmq.NewContext()
	if err != nil {
		tb.Fatal(err)
	}
	rep, err := ctx.NewSocket(zmq.REP)
	if err != nil {
		tb.Fatal(err)
	}
	rep.SetLinger(0)
	if err := rep.Bind("tcp://127.0.0.1:*"); err != nil {
		tb.Fatal(err)
	}
	ep, err := rep.GetLastEndpoint()
	if err != nil {
		tb.Fatal(err)
	}
	b := &bareREQREP{ctx: ctx, done: make(chan struct{})}
	go func() {
		defer close(b.done)
		defer rep.Close()
		for {
			msg, err := rep.RecvBytes(0)
			if err != nil || string(msg) == "\x00quit" {
				if err == nil {
					rep.SendBytes(nil, 0)
				}
				return
			}
			if _, err := rep.SendBytes(reply, 0); err != nil {
				return
			}
		}
	}()
	if b.req, err = ctx.NewSocket(zmq.REQ); err != nil {
		tb.Fatal(err)
	}
	b.req.SetLinger(0)
	if err := b.req.Connect(ep); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		b.roundTrip(tb, []byte("\x00quit"))
		<-b.done
		b.req.Close()
		ctx.Term()
	})
	return b
}

func (b *bareREQREP) roundTrip(tb testing.TB, req []byte) []byte {
	if _, err := b.req.SendBytes(req, 0); err != nil {
		tb.Fatal(err)
	}
	r, err := b.req.RecvBytes(0)
	if err != nil {
		tb.Fatal(err)
	}
	return r
}
