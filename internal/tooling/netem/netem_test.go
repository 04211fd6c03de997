package netem

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

var idSeq atomic.Int64

func testID() string { return fmt.Sprintf("t%d-%d", os.Getpid(), idSeq.Add(1)) }

// needNetns skips unless this test may create network namespaces.
func needNetns(t *testing.T) {
	t.Helper()
	if err := Available(); err != nil {
		t.Skipf("skipping: needs root and working `ip netns add`: %v", err)
	}
}

func setup(t *testing.T, o Options) *Net {
	t.Helper()
	if o.ID == "" {
		o.ID = testID()
	}
	n, err := Setup(context.Background(), o)
	if err != nil {
		t.Fatalf("Setup(%+v): %v", o, err)
	}
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		assertGone(t, n.PrefillNS(), n.DecodeNS())
	})
	return n
}

// assertGone checks that `ip netns list` names none of nss.
func assertGone(t *testing.T, nss ...string) {
	t.Helper()
	out, err := exec.Command("ip", "netns", "list").CombinedOutput()
	if err != nil {
		t.Fatalf("ip netns list: %v: %s", err, out)
	}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		for _, ns := range nss {
			if len(f) > 0 && f[0] == ns {
				t.Errorf("namespace %s still listed:\n%s", ns, out)
			}
		}
	}
}

// echoServer listens on 127.0.0.1:0 inside ns and echoes every
// connection; it returns the port.
func echoServer(t *testing.T, n *Net, ns string) int {
	t.Helper()
	return echoServerAt(t, n, ns, "127.0.0.1")
}

// echoServerAt is echoServer listening on host.
func echoServerAt(t *testing.T, n *Net, ns, host string) int {
	t.Helper()
	ln, err := n.Listen(ns, "tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				io.Copy(c, c)
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return ln.Addr().(*net.TCPAddr).Port
}

// noLeak fails if goroutines started during the test outlive it.
func noLeak(t *testing.T) {
	t.Helper()
	base := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(10 * time.Second)
		for runtime.NumGoroutine() > base && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if g := runtime.NumGoroutine(); g > base {
			buf := make([]byte, 1<<20)
			t.Errorf("goroutines: %d before, %d after Close:\n%s", base, g, buf[:runtime.Stack(buf, true)])
		}
	})
}

// relayedEcho starts an echo server in n's prefill namespace, relays its
// port and dials it from the decode namespace.
func relayedEcho(t *testing.T, n *Net) (net.Conn, int) {
	t.Helper()
	port := echoServer(t, n, n.PrefillNS())
	if err := n.Relay(port); err != nil {
		t.Fatal(err)
	}
	c, err := n.DialContext(context.Background(), n.DecodeNS(), "tcp", portAddr(port))
	if err != nil {
		t.Fatal(err)
	}
	return c, port
}

func portAddr(p int) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(p)) }

// TestUserspaceEchoThroughRelay runs with the splice line (TCP to TCP,
// the default) and with the copying one.
func TestUserspaceEchoThroughRelay(t *testing.T) {
	t.Run("splice", testUserspaceEcho)
	t.Run("copy", func(t *testing.T) {
		copyRelay = true
		defer func() { copyRelay = false }()
		testUserspaceEcho(t)
	})
}

func testUserspaceEcho(t *testing.T) {
	needNetns(t)
	noLeak(t) // registered first: checked after Close
	n := setup(t, Options{Spec: "delay 1ms", Mode: ModeUserspace, RelayBuffer: 256 << 10})
	if n.Mode() != ModeUserspace || n.PrefillAddr() != "127.0.0.1" || n.DecodeAddr() != "127.0.0.1" {
		t.Fatalf("mode %v, addrs %s %s", n.Mode(), n.PrefillAddr(), n.DecodeAddr())
	}
	port := echoServer(t, n, n.PrefillNS())
	if err := n.Relay(port); err != nil {
		t.Fatal(err)
	}
	if err := n.Relay(port); err != nil { // again: no-op
		t.Fatal(err)
	}
	const conns, size = 4, 3 << 20
	var wg sync.WaitGroup
	errs := make(chan error, conns)
	for i := 0; i < conns; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- echoOnce(n, port, size)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}

// echoOnce sends size random bytes from decode through the relay,
// half-closes, and checks the echo is exact.
func echoOnce(n *Net, port, size int) error {
	return echoOnceAt(n, portAddr(port), size)
}

// echoOnceAt is echoOnce against addr.
func echoOnceAt(n *Net, addr string, size int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := n.DialContext(ctx, n.DecodeNS(), "tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Minute))
	payload := make([]byte, size)
	rand.Read(payload)
	werr := make(chan error, 1)
	go func() {
		// Odd-sized writes so chunks do not line up with reads.
		p := payload
		for len(p) > 0 {
			k := min(len(p), 12345)
			if _, err := c.Write(p[:k]); err != nil {
				werr <- err
				return
			}
			p = p[k:]
		}
		werr <- c.(*net.TCPConn).CloseWrite()
	}()
	got, err := io.ReadAll(c)
	if err != nil {
		return fmt.Errorf("read echo: %w", err)
	}
	if err := <-werr; err != nil {
		return fmt.Errorf("write: %w", err)
	}
	if !bytes.Equal(got, payload) {
		return fmt.Errorf("echo differs: sent %d bytes, got %d", len(payload), len(got))
	}
	return nil
}

// pingRTTs returns the round trips of one-byte ping-pongs over c.
func pingRTTs(t *testing.T, c net.Conn, k int) []time.Duration {
	t.Helper()
	c.SetDeadline(time.Now().Add(time.Minute))
	b := []byte{0}
	var rtts []time.Duration
	for i := 0; i < k; i++ {
		b[0] = byte(i)
		t0 := time.Now()
		if _, err := c.Write(b); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, b); err != nil {
			t.Fatal(err)
		}
		rtts = append(rtts, time.Since(t0))
		if b[0] != byte(i) {
			t.Fatalf("ping %d echoed %d", i, b[0])
		}
	}
	return rtts
}

func TestUserspaceRTTFloor(t *testing.T) {
	needNetns(t)
	for _, spec := range []string{"delay 2ms", "delay 3ms 1ms"} {
		t.Run(spec, func(t *testing.T) {
			n := setup(t, Options{Spec: spec, Mode: ModeUserspace})
			c, _ := relayedEcho(t, n)
			defer c.Close()
			s, _ := n.Spec()
			floor := s.RTTFloor()
			rtts := pingRTTs(t, c, 20)
			for i, r := range rtts {
				if r < floor { // lower bound only: the machine is noisy
					t.Errorf("ping %d: RTT %v < floor %v", i, r, floor)
				}
			}
			t.Logf("%s (%s): RTTs %v, floor %v", spec, n.Describe(), rtts, floor)
		})
	}
}

func TestUserspaceIsolation(t *testing.T) {
	needNetns(t)
	n := setup(t, Options{Spec: "delay 1ms", Mode: ModeUserspace})
	port := echoServer(t, n, n.PrefillNS())
	// Reachable inside prefill itself ...
	c, err := n.DialContext(context.Background(), n.PrefillNS(), "tcp", portAddr(port))
	if err != nil {
		t.Fatalf("dial inside prefill: %v", err)
	}
	c.Close()
	// ... but not from decode without the relay.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if c, err := n.DialContext(ctx, n.DecodeNS(), "tcp", portAddr(port)); err == nil {
		c.Close()
		t.Fatal("decode reached prefill's 127.0.0.1 without the relay")
	}
	// No link at all between the namespaces: only lo.
	for _, ns := range []string{n.PrefillNS(), n.DecodeNS()} {
		out, err := n.Command(ns, "ip", "-o", "link", "show").CombinedOutput()
		if err != nil {
			t.Fatalf("ip link in %s: %v: %s", ns, err, out)
		}
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		if len(lines) != 1 || !strings.Contains(lines[0], " lo:") || !strings.Contains(lines[0], "UP") {
			t.Errorf("%s links, want only lo up:\n%s", ns, out)
		}
	}
}

func TestRelayBounded(t *testing.T) {
	needNetns(t)
	noLeak(t)
	n := setup(t, Options{Spec: "delay 1ms", Mode: ModeUserspace, RelayBuffer: 64 << 10})
	// A prefill server that accepts and never reads.
	ln, err := n.Listen(n.PrefillNS(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
		close(accepted)
	}()
	defer func() {
		ln.Close()
		if c := <-accepted; c != nil {
			c.Close()
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	if err := n.Relay(port); err != nil {
		t.Fatal(err)
	}
	c, err := n.DialContext(context.Background(), n.DecodeNS(), "tcp", portAddr(port))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// Far more than socket buffers plus the 64 KiB line can hold: the
	// write must stall, not be swallowed by the relay.
	const total = 256 << 20
	c.SetWriteDeadline(time.Now().Add(3 * time.Second))
	buf := make([]byte, 1<<20)
	sent := 0
	for sent < total {
		k, err := c.Write(buf)
		sent += k
		if err != nil {
			break
		}
	}
	if sent >= total {
		t.Fatalf("relay took all %d bytes from a peer that never reads", sent)
	}
	t.Logf("stalled after %d bytes in flight (socket buffers + 64 KiB line)", sent)
}

func TestRelayNoPrefillListener(t *testing.T) {
	needNetns(t)
	n := setup(t, Options{Spec: "delay 1ms", Mode: ModeUserspace})
	// Pick a free port in prefill and close it again.
	ln, err := n.Listen(n.PrefillNS(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	if err := n.Relay(port); err != nil {
		t.Fatal(err)
	}
	c, err := n.DialContext(context.Background(), n.DecodeNS(), "tcp", portAddr(port))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Minute))
	if k, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatalf("read %d bytes from a relay with no prefill listener", k)
	}
}

func TestCloseRemovesEverything(t *testing.T) {
	needNetns(t)
	noLeak(t)
	n, err := Setup(context.Background(), Options{Spec: "delay 1ms", Mode: ModeUserspace, ID: testID()})
	if err != nil {
		t.Fatal(err)
	}
	// A connection open through the relay when Close comes.
	c, port := relayedEcho(t, n)
	defer c.Close()
	pingRTTs(t, c, 1)
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	assertGone(t, n.PrefillNS(), n.DecodeNS())
	if err := n.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := n.Relay(port); !errors.Is(err, ErrClosed) {
		t.Errorf("Relay after Close: %v", err)
	}
	if _, err := n.DialContext(context.Background(), n.DecodeNS(), "tcp", portAddr(port)); !errors.Is(err, ErrClosed) {
		t.Errorf("DialContext after Close: %v", err)
	}
	c.SetDeadline(time.Now().Add(time.Minute))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("relayed connection still open after Close")
	}
}

func TestStaleNamespacesCleaned(t *testing.T) {
	needNetns(t)
	id := testID()
	// As a crashed run would leave them.
	for _, ns := range []string{PrefillPrefix + id, DecodePrefix + id} {
		if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
			t.Fatalf("ip netns add %s: %v: %s", ns, err, out)
		}
	}
	n := setup(t, Options{Spec: "delay 1ms", Mode: ModeUserspace, ID: id})
	_ = n
	// And Cleanup by ID, as a driver would after a crash.
	id2 := testID()
	if out, err := exec.Command("ip", "netns", "add", DecodePrefix+id2).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	if err := Cleanup(id2); err != nil {
		t.Fatal(err)
	}
	assertGone(t, DecodePrefix+id2)
	if err := Cleanup("../etc"); err == nil {
		t.Error("Cleanup accepted a bad ID")
	}
}

func TestCommandAndDialChecks(t *testing.T) {
	needNetns(t)
	n := setup(t, Options{Spec: "delay 1ms", Mode: ModeUserspace})
	if err := n.Command("some-other-ns", "true").Run(); err == nil {
		t.Error("Command ran in a namespace not of this Net")
	}
	if _, err := n.DialContext(context.Background(), "kvD-other", "tcp", "127.0.0.1:1"); err == nil {
		t.Error("DialContext into a namespace not of this Net")
	}
	if _, err := n.Listen("", "tcp", "127.0.0.1:0"); err == nil {
		t.Error("Listen into a namespace not of this Net")
	}
	if err := n.Relay(0); err == nil {
		t.Error("Relay(0) accepted")
	}
	out, err := n.Command(n.PrefillNS(), "ip", "netns", "identify").CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != n.PrefillNS() {
		t.Errorf("Command runs in %q (%v), want %s", out, err, n.PrefillNS())
	}
}

// TestKernelMode: here (no sch_netem) forced kernel mode must fail with
// ErrNetemUnavailable and leave nothing; where netem exists it must give
// a veth link whose RTT is at least twice the delay.
func TestKernelMode(t *testing.T) {
	needNetns(t)
	id := testID()
	n, err := Setup(context.Background(), Options{Spec: "delay 2ms", Mode: ModeKernel, ID: id})
	if errors.Is(err, ErrNetemUnavailable) {
		t.Logf("kernel netem unavailable, as expected on this kernel: %v", err)
		if n != nil {
			t.Error("Setup returned a Net with its error")
		}
		assertGone(t, PrefillPrefix+id, DecodePrefix+id)
		return
	}
	if err != nil {
		t.Fatalf("Setup kernel: %v", err)
	}
	defer func() {
		if err := n.Close(); err != nil {
			t.Error(err)
		}
		assertGone(t, PrefillPrefix+id, DecodePrefix+id)
	}()
	if n.Mode() != ModeKernel || n.PrefillAddr() == "127.0.0.1" {
		t.Fatalf("mode %v, prefill addr %s", n.Mode(), n.PrefillAddr())
	}
	if err := n.Relay(1234); err != nil {
		t.Fatal(err)
	}
	ln, err := n.Listen(n.PrefillNS(), "tcp", net.JoinHostPort(n.PrefillAddr(), "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err == nil {
			defer c.Close()
			io.Copy(c, c)
		}
	}()
	c, err := n.DialContext(context.Background(), n.DecodeNS(), "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i, r := range pingRTTs(t, c, 10) {
		if r < 4*time.Millisecond {
			t.Errorf("ping %d: RTT %v < 2×2ms", i, r)
		}
	}
}

func TestAutoMode(t *testing.T) {
	needNetns(t)
	n := setup(t, Options{Spec: "delay 1ms"})
	t.Logf("auto chose: %s", n.Describe())
	switch n.Mode() {
	case ModeUserspace:
		if !strings.Contains(n.Describe(), "no sch_netem") {
			t.Errorf("Describe = %q", n.Describe())
		}
		// The probe veth is gone: nothing bypasses the relay.
		out, _ := n.Command(n.DecodeNS(), "ip", "-o", "link", "show").CombinedOutput()
		if strings.Contains(string(out), "veth") {
			t.Errorf("veth left in userspace mode:\n%s", out)
		}
	case ModeQueue:
		if !strings.Contains(n.Describe(), "no sch_netem") || n.PrefillAddr() == "127.0.0.1" {
			t.Errorf("Describe = %q, prefill at %s", n.Describe(), n.PrefillAddr())
		}
		if err := n.Relay(1234); err != nil { // nothing to relay over the veth
			t.Error(err)
		}
	case ModeKernel:
	default:
		t.Fatalf("mode %v", n.Mode())
	}

	// A spec only the kernel could do: an error naming it here, success
	// where netem exists.
	id := testID()
	m, err := Setup(context.Background(), Options{Spec: "delay 1ms loss 1%", ID: id})
	if err == nil {
		if m.Mode() != ModeKernel {
			t.Errorf("loss accepted in mode %v", m.Mode())
		}
		m.Close()
	} else if !strings.Contains(err.Error(), `"loss"`) || !strings.Contains(err.Error(), "sch_netem") {
		t.Errorf("error %v; want it to name \"loss\" and sch_netem", err)
	}
	assertGone(t, PrefillPrefix+id, DecodePrefix+id)
}

// TestSetupBadInput needs no root: input is checked before anything is
// made.
func TestSetupBadInput(t *testing.T) {
	for _, o := range []Options{
		{Spec: ""},
		{Spec: "loss 1%", Mode: ModeUserspace},
		{Spec: "delay -1ms", Mode: ModeUserspace},
		{Spec: "delay -1ms"},
		{Spec: "delay 1ms; reboot"},
		{Spec: "\x00\xff garbage"},
		{Spec: "delay 1ms", ID: "../etc"},
		{Spec: "delay 1ms", ID: strings.Repeat("x", 33)},
		{Spec: "delay 1ms", Mode: Mode(7)},
		{Spec: "delay 1ms", RelayBuffer: -1},
	} {
		n, err := Setup(context.Background(), o)
		if err == nil {
			n.Close()
			t.Errorf("Setup(%+v) accepted", o)
			continue
		}
		if n != nil {
			t.Errorf("Setup(%+v) returned a Net with error %v", o, err)
		}
		t.Logf("Setup(%q, mode %v, id %q): %v", o.Spec, o.Mode, o.ID, err)
	}
	var n *Net
	if err := n.Close(); err != nil {
		t.Errorf("nil Close: %v", err)
	}
}

// TestQueueMode: with the netfilter queue delay, decode reaches prefill
// over the veth; every round trip takes at least twice the delay (it is
// applied leaving either end); bulk echoes over several connections come
// back exact (GSO packets held whole, none lost); Close leaves no
// namespace and no goroutine.
func TestQueueMode(t *testing.T) {
	needNetns(t)
	if _, err := exec.LookPath("iptables"); err != nil {
		t.Skipf("iptables(8) not installed (apt-get install iptables): %v", err)
	}
	noLeak(t)
	id := testID()
	n, err := Setup(context.Background(), Options{Spec: "delay 2ms", Mode: ModeQueue, ID: id})
	if err != nil {
		t.Fatalf("Setup queue: %v", err)
	}
	defer func() {
		if err := n.Close(); err != nil {
			t.Error(err)
		}
		assertGone(t, PrefillPrefix+id, DecodePrefix+id)
	}()
	if n.Mode() != ModeQueue || n.PrefillAddr() == "127.0.0.1" || n.DecodeAddr() == "127.0.0.1" {
		t.Fatalf("mode %v, addrs %s %s", n.Mode(), n.PrefillAddr(), n.DecodeAddr())
	}
	port := echoServerAt(t, n, n.PrefillNS(), n.PrefillAddr())
	addr := net.JoinHostPort(n.PrefillAddr(), strconv.Itoa(port))
	c, err := n.DialContext(context.Background(), n.DecodeNS(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	rtts := pingRTTs(t, c, 10)
	c.Close()
	for i, r := range rtts {
		if r < 4*time.Millisecond { // lower bound only: the machine is noisy
			t.Errorf("ping %d: RTT %v < 2×2ms", i, r)
		}
	}
	t.Logf("%s: RTTs %v", n.Describe(), rtts)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Go(func() { errs <- echoOnceAt(n, addr, 8<<20) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	// Nothing reaches prefill's loopback from decode: only the veth.
	if c, err := n.DialContext(context.Background(), n.DecodeNS(), "tcp", portAddr(port)); err == nil {
		c.Close()
		t.Error("decode reached 127.0.0.1 of prefill's namespace")
	}
}
