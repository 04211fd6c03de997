package sidechannel

import (
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/prometheus/client_golang/prometheus"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if err := checkNoLeakedGoroutines(3 * time.Second); err != nil {
			fmt.Fprintln(os.Stderr, err)
			code = 1
		}
	}
	os.Exit(code)
}

// checkNoLeakedGoroutines waits until no goroutine runs this package's code
// (other than the test harness) and reports those that remain.
func checkNoLeakedGoroutines(wait time.Duration) error {
	deadline := time.Now().Add(wait)
	for {
		leaked := leakedGoroutines()
		if len(leaked) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("leaked goroutines:\n\n%s", strings.Join(leaked, "\n\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func leakedGoroutines() []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if !strings.Contains(g, "kvflow/internal/sidechannel.") {
			continue
		}
		if strings.Contains(g, "sidechannel.TestMain") { // this goroutine
			continue
		}
		out = append(out, g)
	}
	return out
}

// testLogger writes through t.Log at debug level when -v, discards otherwise.
func testLogger(t testing.TB) *slog.Logger {
	if !testing.Verbose() {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

type testEnv struct {
	zctx *Context
	reg  *prometheus.Registry
}

// newEnv makes a Context whose Close (at cleanup) must close every socket.
func newEnv(t *testing.T) *testEnv {
	t.Helper()
	reg := prometheus.NewRegistry()
	zctx, err := NewContext(ContextOptions{Registerer: reg, Logger: testLogger(t), CloseTimeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := zctx.Close(); err != nil {
			t.Errorf("Context.Close: %v", err)
		}
		if n := zctx.OpenSockets(); n != 0 {
			t.Errorf("%d sockets open after Context.Close", n)
		}
	})
	return &testEnv{zctx: zctx, reg: reg}
}

func fastClientOpts() ClientOptions {
	return ClientOptions{AttemptTimeout: 200 * time.Millisecond, Attempts: 2, RetryBackoff: 10 * time.Millisecond}
}

func (e *testEnv) client(t *testing.T, opts ClientOptions) *Client {
	t.Helper()
	c, err := NewClient(e.zctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// recorder is a Handler that records DONE ids.
type recorder struct {
	md Metadata

	mu    sync.Mutex
	dones []string
	err   error // returned by Done
	panic bool  // Done panics
	gate  chan struct{}
}

func (r *recorder) Metadata() Metadata { return r.md }

func (r *recorder) Done(id string) error {
	r.mu.Lock()
	gate, p, err := r.gate, r.panic, r.err
	r.mu.Unlock()
	if gate != nil {
		<-gate
	}
	if p {
		panic("boom")
	}
	r.mu.Lock()
	r.dones = append(r.dones, id)
	r.mu.Unlock()
	return err
}

func (r *recorder) doneIDs() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.dones...)
}

func (e *testEnv) server(t *testing.T, h Handler, opts ServerOptions) *Server {
	t.Helper()
	if opts.Addr == "" {
		opts.Addr = "127.0.0.1:0"
	}
	s, err := NewServer(e.zctx, opts, h)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// rawPeer is a test ROUTER (or other socket) driven by a handler func on its
// own goroutine; it stops at cleanup. reply returns the frames to send back
// (nil: no answer).
type rawPeer struct {
	addr string
	stop chan struct{}
	done chan struct{}
}

func (e *testEnv) rawRouter(t *testing.T, handle func(frames [][]byte) [][]byte) *rawPeer {
	t.Helper()
	s, err := e.zctx.newSocket(zmq.ROUTER)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Bind("tcp://127.0.0.1:*"); err != nil {
		t.Fatal(err)
	}
	last, _ := s.GetLastEndpoint()
	p := &rawPeer{addr: strings.TrimPrefix(last, "tcp://"), stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		defer e.zctx.closeSocket(s)
		poller := zmq.NewPoller()
		poller.Add(s, zmq.POLLIN)
		for {
			select {
			case <-p.stop:
				return
			default:
			}
			polled, err := poller.Poll(20 * time.Millisecond) // test-only: wakes to check stop
			if err != nil || len(polled) == 0 {
				continue
			}
			frames, err := s.RecvMessageBytes(0)
			if err != nil {
				continue
			}
			if out := handle(frames); out != nil {
				_, _ = s.SendMessage(out)
			}
		}
	}()
	t.Cleanup(func() { close(p.stop); <-p.done })
	return p
}

// blackHole binds a ROUTER that never reads: peers connect, nobody answers.
func (e *testEnv) blackHole(t *testing.T) string {
	t.Helper()
	s, err := e.zctx.newSocket(zmq.ROUTER)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Bind("tcp://127.0.0.1:*"); err != nil {
		t.Fatal(err)
	}
	last, _ := s.GetLastEndpoint()
	t.Cleanup(func() { e.zctx.closeSocket(s) })
	return strings.TrimPrefix(last, "tcp://")
}

// dealer connects a raw DEALER with the given identity (test goroutine only).
func (e *testEnv) dealer(t *testing.T, addr string, identity []byte) *zmq.Socket {
	t.Helper()
	s, err := e.zctx.newSocket(zmq.DEALER)
	if err != nil {
		t.Fatal(err)
	}
	if len(identity) > 0 {
		if err := s.SetIdentity(string(identity)); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.SetRcvtimeo(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	if err := s.Connect("tcp://" + addr); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.zctx.closeSocket(s) })
	return s
}

// freePort returns a loopback port with no listener (bound then released).
func (e *testEnv) freePort(t *testing.T) string {
	t.Helper()
	s, err := e.zctx.newSocket(zmq.ROUTER)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Bind("tcp://127.0.0.1:*"); err != nil {
		t.Fatal(err)
	}
	last, _ := s.GetLastEndpoint()
	e.zctx.closeSocket(s)
	return strings.TrimPrefix(last, "tcp://")
}
