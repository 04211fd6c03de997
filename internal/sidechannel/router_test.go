package sidechannel

import (
	"bytes"
	"fmt"
	"sync"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// routerCall sends payload on a fresh REQ socket (a CURVE client with c's
// keys, if set) and waits up to wait for the reply.
func routerCall(t *testing.T, e *testEnv, endpoint string, c *Curve, payload []byte, wait time.Duration) ([]byte, error) {
	t.Helper()
	s, err := e.zctx.newSocket(zmq.REQ)
	if err != nil {
		return nil, err
	}
	defer e.zctx.closeSocket(s)
	if c != nil {
		if err := setCurveClient(s, c); err != nil {
			return nil, err
		}
	}
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

// isSlow picks the payloads the tests serve in the background.
func isSlow(p []byte) bool { return bytes.HasPrefix(p, []byte("slow")) }

// TestRouterBackground: with ServerOptions.Background, a picked request
// that blocks (a load waiting for room) does not hold up the others (a
// finished poll), even while more picked requests queue behind it; its
// own reply comes when it returns. Without Background, requests run one
// at a time (the fast one waits).
func TestRouterBackground(t *testing.T) {
	for _, bg := range []bool{false, true} {
		t.Run(fmt.Sprintf("background=%v", bg), func(t *testing.T) {
			e := newEnv(t)
			gate := make(chan struct{})
			opts := ServerOptions{Addr: "tcp://127.0.0.1:0"}
			if bg {
				opts.Background = isSlow
			}
			r, err := NewRouter(e.zctx, opts, func(p []byte) []byte {
				if isSlow(p) {
					<-gate
				}
				return append([]byte("re:"), p...)
			})
			if err != nil {
				t.Fatal(err)
			}
			ep := "tcp://" + r.Addr()
			var wg sync.WaitGroup
			slow := make([][]byte, 3)
			slowErr := make([]error, 3)
			for i := range slow {
				wg.Go(func() { slow[i], slowErr[i] = routerCall(t, e, ep, nil, []byte(fmt.Sprint("slow", i)), 10*time.Second) })
			}
			// Let the slow calls reach the server, so the fast ones
			// arrive while the first blocks and the others queue.
			time.Sleep(100 * time.Millisecond)
			for range 3 {
				fast, err := routerCall(t, e, ep, nil, []byte("fast"), time.Second)
				if bg {
					if err != nil || string(fast) != "re:fast" {
						t.Errorf("fast call behind a blocked one: %q, %v", fast, err)
					}
				} else if err == nil {
					t.Errorf("one at a time: fast call answered (%q) while the slow one blocks", fast)
					break
				}
				if !bg {
					break
				}
			}
			close(gate)
			wg.Wait()
			for i := range slow {
				if slowErr[i] != nil || string(slow[i]) != fmt.Sprint("re:slow", i) {
					t.Errorf("slow call %d: %q, %v", i, slow[i], slowErr[i])
				}
			}
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestRouterBackgroundOrder: picked requests are handled in arrival
// order, one at a time.
func TestRouterBackgroundOrder(t *testing.T) {
	e := newEnv(t)
	var mu sync.Mutex
	var got []string
	running := 0
	r, err := NewRouter(e.zctx, ServerOptions{Addr: "tcp://127.0.0.1:0", Background: isSlow}, func(p []byte) []byte {
		mu.Lock()
		running++
		if running > 1 {
			t.Errorf("%d background calls at once", running)
		}
		got = append(got, string(p))
		mu.Unlock()
		time.Sleep(2 * time.Millisecond)
		mu.Lock()
		running--
		mu.Unlock()
		return p
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	ep := "tcp://" + r.Addr()
	// One REQ socket per call, sent in sequence (each waits for its
	// reply), then a burst from concurrent sockets: sequence first.
	for i := range 5 {
		if _, err := routerCall(t, e, ep, nil, []byte(fmt.Sprint("slow", i)), 5*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for i, g := range got {
		if g != fmt.Sprint("slow", i) {
			t.Fatalf("background calls in order %v", got)
		}
	}
}

// TestRouterBackgroundClose: Close with a background call in flight waits
// for it (no goroutine outlives the server) and its reply is dropped.
func TestRouterBackgroundClose(t *testing.T) {
	e := newEnv(t)
	entered, release := make(chan struct{}), make(chan struct{})
	r, err := NewRouter(e.zctx, ServerOptions{Addr: "tcp://127.0.0.1:0", Background: isSlow}, func(p []byte) []byte {
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
	caller.Go(func() { routerCall(t, e, ep, nil, []byte("slow"), 200*time.Millisecond) })
	<-entered
	closed := make(chan struct{})
	go func() { r.Close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("Close returned while a background call was running")
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return after the background call ended")
	}
}
