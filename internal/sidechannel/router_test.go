package sidechannel

import (
	"bytes"
	"fmt"
	"sync"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// routerCall sends payload on a fresh REQ socket and waits up to wait for
// the reply.
func routerCall(t *testing.T, e *testEnv, endpoint string, payload []byte, wait time.Duration) ([]byte, error) {
	t.Helper()
	s, err := e.zctx.newSocket(zmq.REQ)
	if err != nil {
		return nil, err
	}
	defer e.zctx.closeSocket(s)
	if err := s.Connect(endpoint); err != nil {
		return nil, err
	}
	if _, err := s.SendBytes(payload, 0); err != nil {
		return nil, err
	}
	p := zmq.NewPoller()
	p.Add(s, zmq.POLLIN)
	polled, err := p.Poll(wait)
	if err != nil {
		return nil, err
	}
	if len(polled) == 0 {
		return nil, ErrTimeout
	}
	return s.RecvBytes(0)
}

// TestRouterConcurrent: with ServerOptions.Concurrent, a handler call that
// blocks (a load waiting for room) does not hold up other peers' calls;
// its own reply comes when it returns; Close waits for calls in flight.
// Without it, calls run one at a time (the fast one waits).
func TestRouterConcurrent(t *testing.T) {
	for _, conc := range []int{0, 4} {
		t.Run(fmt.Sprintf("concurrent=%d", conc), func(t *testing.T) {
			e := newEnv(t)
			gate := make(chan struct{})
			r, err := NewRouter(e.zctx, ServerOptions{Addr: "tcp://127.0.0.1:0", Concurrent: conc}, func(p []byte) []byte {
				if bytes.Equal(p, []byte("slow")) {
					<-gate
				}
				return append([]byte("re:"), p...)
			})
			if err != nil {
				t.Fatal(err)
			}
			ep := "tcp://" + r.Addr()
			var wg sync.WaitGroup
			var slow []byte
			var slowErr error
			wg.Go(func() { slow, slowErr = routerCall(t, e, ep, []byte("slow"), 10*time.Second) })
			// Give the slow call time to reach the handler, so the fast
			// one arrives while it blocks.
			time.Sleep(100 * time.Millisecond)
			fast, err := routerCall(t, e, ep, []byte("fast"), time.Second)
			if conc > 1 {
				if err != nil || string(fast) != "re:fast" {
					t.Errorf("fast call behind a blocked one: %q, %v", fast, err)
				}
			} else if err == nil {
				t.Errorf("one at a time: fast call answered (%q) while the slow one blocks", fast)
			}
			close(gate)
			wg.Wait()
			if slowErr != nil || string(slow) != "re:slow" {
				t.Errorf("slow call: %q, %v", slow, slowErr)
			}
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestRouterConcurrentClose: Close with a handler call in flight waits for
// it (no goroutine outlives the server) and its reply is dropped.
func TestRouterConcurrentClose(t *testing.T) {
	e := newEnv(t)
	entered, release := make(chan struct{}), make(chan struct{})
	r, err := NewRouter(e.zctx, ServerOptions{Addr: "tcp://127.0.0.1:0", Concurrent: 2}, func(p []byte) []byte {
		close(entered)
		<-release
		return []byte("late")
	})
	if err != nil {
		t.Fatal(err)
	}
	ep := "tcp://" + r.Addr()
	var caller sync.WaitGroup
	defer caller.Wait() // the caller's socket closes before the context
	caller.Go(func() { routerCall(t, e, ep, []byte("x"), 200*time.Millisecond) })
	<-entered
	closed := make(chan struct{})
	go func() { r.Close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("Close returned while a handler call was running")
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return after the handler call ended")
	}
}
